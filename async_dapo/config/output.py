"""logging and checkpoint: what a run writes (logs, TensorBoard, metrics, checkpoints)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from async_dapo.config.section import Section


class LoggingConfig(Section):
    """Run directory, TensorBoard, validation."""

    run_dir: Path = Field(Path("runs/tiny_cpu"), description="Everything of a run is written here.")
    tensorboard: bool = Field(True, description="Write TensorBoard events to run_dir/tb.")
    plan_profile: Path | None = Field(
        None, description="A planner profile (configs/profiles/*.yaml, or one written by "
        "tools/bench/calibrate.py for this machine): the run predicts its steady-state step time with "
        "`async-dapo plan`'s model when it starts, and the end-of-run phase table prints predicted against "
        "measured, so every run checks the model. None = no prediction.",
    )

    @field_validator("plan_profile")
    @classmethod
    def _profile_exists(cls, v: Path | None) -> Path | None:
        """`plan_profile`, when set, is an existing file."""
        if v is not None and not v.is_file():
            raise ValueError(f"no profile file at {v}")
        return v
    val_every_steps: int = Field(
        10, ge=0, description="Start a validation every k steps and at the last (0 = never). It runs on every "
        "engine beside training (the learner does not wait) and is logged against the step it started at.",
    )
    val_before_train: bool = Field(
        True, description="verl's trainer.val_before_train: also validate the initial weights at step 0 (when "
        "val_every_steps > 0).",
    )
    val_prompts: int = Field(
        256, ge=1, description="Most held-out prompts per validation; each distinct (repeated rows of a file are "
        "dropped, the synthetic split is not cycled), so fewer when the split has fewer.",
    )
    val_n: int = Field(4, ge=1, description="k: samples per validation prompt (avg@k, pass@k, maj@k).")
    val_temperature: float = Field(1.0, ge=0, le=10, description="Validation temperature.")
    val_top_p: float = Field(0.7, gt=0, le=1, description="Validation top_p (paper: 0.7).")
    val_timeout_s: float = Field(1800, gt=0, description="Bound (seconds) on one validation pass.")
    seed: int = Field(
        0, ge=0, description="Seed of python/numpy/torch in every process (learner ranks, rollout actors, "
        "the driver).",
    )
    record_batches: bool = Field(
        False, description="Write every trained batch to run_dir/batches/step_N.bin (wire format)."
    )


class CheckpointConfig(Section):
    """torch.distributed.checkpoint of the full training state + HF export."""

    every_steps: int = Field(0, ge=0, description="Checkpoint every k steps (0 = only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept.")
    export_hf: bool = Field(True, description="Write an HF-format copy of the final policy.")
