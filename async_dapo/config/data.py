"""data: the prompts (the embedded synthetic tasks, or a verl-style parquet/jsonl dataset)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from async_dapo.config.section import Section


class SyntheticTaskConfig(Section):
    """The built-in task: integer arithmetic with difficulty levels (see async_dapo.data.rows.LEVELS), or a walk
    along a cycle of syllables with a long tail of response lengths (async_dapo.data.rows.walk_rows)."""

    task: Literal["arith", "walk"] = Field(
        "arith", description="'arith': 'What is 47+8?', answered in 3-5 tokens (or ~16 with response_style "
        "'steps'). 'walk': 'Walk from qoo.', answered by every syllable from there to the end of a fixed "
        "cycle of 200 (about 2 tokens each), so the prompt sets the needed response length; the number of "
        "steps is lognormal (walk_median, walk_sigma), the right-skewed shape of long-CoT RL responses, and "
        "a response budget truncates the longest. The reward wants the exact sequence "
        "(async_dapo.data.reward.walk_score).",
    )
    walk_median: float = Field(
        25, ge=1, le=200, description="task 'walk': median number of steps (syllables) of a problem.")
    walk_sigma: float = Field(
        0.8, ge=0, le=3, description="task 'walk': sigma of the log of the number of steps (0 = every "
        "problem has walk_median steps).")
    levels: list[int] = Field(
        [1, 2, 3, 4], min_length=1, description="Difficulty levels to mix uniformly (1..4)."
    )
    heldout_fraction: float = Field(
        0.1, gt=0, lt=1, description="Fraction of the problem space held out (by hash) for validation."
    )
    response_style: Literal["answer", "steps"] = Field(
        "answer", description="The warm start's reference response. 'answer': the answer line only "
        "('Answer: 52', 3-5 tokens). 'steps': problems with a carry or a borrow first show it ('7+5=12, "
        "carry 1. Answer: 52'), so response length grows with difficulty and a response budget can truncate "
        "the harder ones (the DAPO ablation's overlong rows need that). The reward reads the answer line "
        "either way.",
    )

    @model_validator(mode="after")
    def _levels_known(self) -> "SyntheticTaskConfig":
        """`levels` are among 1, 2, 3, 4; task `walk` has level 1 only."""
        bad = [lv for lv in self.levels if lv not in (1, 2, 3, 4)]
        if bad:
            raise ValueError(f"unknown level(s) {bad}; known levels are 1, 2, 3, 4")
        if self.task == "walk" and self.levels != [1]:
            raise ValueError(f"task 'walk' has one level: levels must be [1], got {self.levels}")
        return self


class DataConfig(Section):
    """Where prompts come from: the built-in synthetic task, or DAPO-Math-17k-schema parquet/JSONL."""

    train: str = Field(
        "synthetic", description="'synthetic' or a path to a .parquet/.jsonl file of verl-style rows."
    )
    val: str = Field(
        "synthetic", description="'synthetic' (held-out split) or a path to a .parquet/.jsonl file."
    )
    synthetic: SyntheticTaskConfig = Field(default_factory=SyntheticTaskConfig)
    max_prompt_length: int = Field(
        256, ge=8, le=1_048_576, description="Most prompt tokens (chat template applied); what happens to "
        "a longer prompt is set by `truncation`.",
    )
    truncation: Literal["error", "left"] = Field(
        "error", description="verl's name: what happens to a prompt longer than max_prompt_length tokens. "
        "'error' = reject it at load, naming the file and row; 'left' = keep its last max_prompt_length "
        "tokens.",
    )
    shuffle_seed: int = Field(0, ge=0, description="Seed of the epoch-wise prompt order.")
    replay_batches: Path | None = Field(
        None, description="Debugging/determinism: train on the batches recorded by an earlier run "
        "(logging.record_batches) from this directory instead of the replay queue.",
    )
