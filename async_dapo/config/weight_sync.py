"""weight_sync: when and how weights go from the learner to the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_dapo.config.section import Section


class WeightSyncConfig(Section):
    """Learner rank 0 -> engines weight push over a dedicated torch.distributed group."""

    every_k_steps: int = Field(1, ge=1, description="Push after every k-th training step.")
    bucket_mb: int = Field(64, ge=1, le=16384, description="Bucket size of the streamed parameters.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on cuda else gloo.")
    timeout_s: float = Field(
        600, gt=0, description="Bound (seconds) on one weight push: the engines' load and each broadcast of "
        "the learner's side. Rules: 3 x this <= placement.call_timeout_s (a push call may first wait for the "
        "previous push); with rollout.update_mode drain, > rollout.drain_timeout_s.",
    )
