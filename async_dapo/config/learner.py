"""learner: the FSDP2 learner ranks' optimisation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_dapo.config.section import Section


class LearnerConfig(Section):
    """FSDP2 learner optimisation."""

    total_steps: int = Field(40, ge=1, description="Training steps (policy versions) to run.")
    lr: float = Field(1e-4, gt=0, le=1, description="AdamW peak learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="verl's lr_warmup_steps: the LR ramps linearly from 0 over this many TRAINING steps "
        "(the first step runs at 0; not optimizer updates: a step is train_batch_groups / mini_batch_groups "
        "updates), then stays constant.",
    )
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW weight decay (recipe: 0.1).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    mini_batch_groups: int = Field(
        16, ge=1, description="Groups per optimizer update; train_batch_groups / this = updates per epoch."
    )
    epochs: int = Field(1, ge=1, le=32, description="mu: passes over each training batch.")
    micro_batch_tokens: int = Field(
        4096, ge=16, description="Token budget of one packed forward/backward micro-batch."
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Token positions per chunk when the learner turns logits into log-probs and "
        "entropy: its extra memory is 2-4 fp32 chunks (8-16 x this x vocabulary bytes) instead of several fp32 "
        "copies of a whole micro-batch's logits (async_dapo.learner.loss.token_logprobs; docs/memory.md).",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype (MixedPrecisionPolicy); master weights are always fp32."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    cpu_offload: bool = Field(False, description="FSDP2 CPU offload of parameters.")
    collective_timeout_s: float = Field(
        600, gt=0, description="Timeout (seconds) of the learners' torch.distributed process group: a rank "
        "stuck in a collective raises after this.",
    )
