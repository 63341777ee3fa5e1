"""model: the policy to train (the embedded tiny model, or an HF checkpoint)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from async_dapo.config.section import Section


class TinyModelConfig(Section):
    """Shape and warm-start of the tiny Qwen2 model that ``async-dapo bootstrap`` builds (no hub)."""

    hidden_size: int = Field(128, ge=16, le=4096, description="Transformer width.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads (also key/value heads).")
    intermediate_size: int = Field(256, ge=16, le=16384, description="MLP hidden width.")
    sft_steps: int = Field(
        600, ge=1, le=100_000, description="Most warm-start optimizer steps: exactly this many without "
        "`sft_target_accuracy`; with it, the warm start stops once the target is reached (and held, see "
        "`sft_target_checks`)."
    )
    sft_target_accuracy: float | None = Field(
        None, gt=0, le=1, description="Greedy accuracy (fraction of problems, 0-1) that stops the warm start: "
        "it stops at the first check where accuracy on the training problems of `sft_target_level` reaches "
        "this (for `sft_target_checks` checks in a row); at most `sft_steps` steps either way. None = run "
        "exactly `sft_steps`.",
    )
    sft_target_checks: int = Field(
        1, ge=1, le=100, description="With `sft_target_accuracy`: consecutive checks at which the target level "
        "must be at or above the target before the warm start stops (a count; more than 1 keeps a single "
        "check's spike from stopping it).",
    )
    sft_target_level: int | None = Field(
        None, description="Synthetic level whose training problems the target is checked on (None = the "
        "easiest configured level)."
    )
    sft_level_floor: float | None = Field(
        None, ge=0, le=1, description="With `sft_target_accuracy`: stop only once every other configured level "
        "also has at least this greedy accuracy (fraction, 0-1) on its training problems (checked when the "
        "target level is there), so that every level gives RL some mixed groups. None = no floor.",
    )
    sft_check_every: int = Field(
        25, ge=1, le=10_000, description="Warm-start steps between two checks of the target."
    )
    sft_schedule_steps: int | None = Field(
        None, ge=1, description="Horizon of the cosine LR schedule (None = sft_steps). Longer than sft_steps "
        "stops the warm start mid-schedule: a half-trained policy, where RL has something to improve.",
    )
    sft_batch_size: int = Field(64, ge=1, le=4096, description="Warm-start batch size (examples).")
    sft_lr: float = Field(3e-3, gt=0, le=1.0, description="Warm-start peak AdamW learning rate (cosine).")
    eval_prompts: int = Field(
        400, ge=10, description="Prompts per split for the warm-start accuracy report (greedy)."
    )
    seed: int = Field(0, ge=0, description="Seed of tokenizer corpus, init and warm start.")


class ModelConfig(Section):
    """Which policy to train. ``path`` is an HF-format directory (config, tokenizer, safetensors)."""

    path: Path = Field(
        Path("runs/tiny_model"),
        description="HF-format model directory. With `bootstrap`, the tiny model is built here.",
    )
    bootstrap: TinyModelConfig | None = Field(
        default_factory=TinyModelConfig,
        description="Build a tiny model at `path` if absent (CPU default). null = `path` must exist.",
    )
    trust_remote_code: bool = Field(False, description="Passed to transformers/SGLang loaders.")
