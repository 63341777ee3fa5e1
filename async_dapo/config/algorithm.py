"""algorithm: DAPO's batch, clip, loss aggregation, dynamic sampling and off-policy correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_dapo.config.section import Section


class CorrectionConfig(Section):
    """Off-policy correction for stale samples (see async_dapo.learner.loss.importance_weights)."""

    mode: Literal["decoupled", "naive", "none"] = Field(
        "decoupled",
        description="decoupled: clip around recomputed proximal logprobs x capped behaviour weight; "
        "naive: clip around behaviour logprobs; none: on-policy loss, stale samples uncorrected.",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate = min(w, cap) (TIS); mask = zero outside [low, cap] (IcePop)."
    )
    is_level: Literal["token", "sequence"] = Field("token", description="Weight per token or sequence.")
    is_cap: float = Field(2.0, gt=1, description="Upper cap C of the importance weight.")
    is_low: float | None = Field(
        None, gt=0, lt=1, description="Lower bound for mask mode (None = 1/is_cap)."
    )


class DynamicSamplingConfig(Section):
    """Keep only prompt groups whose `metric` values are not all equal (default accuracy: 0 < #correct < G)."""

    enable: bool = Field(True, description="Drop groups whose `metric` values are all equal (all-correct and "
                         "all-wrong groups under the default `acc`).")
    max_gen_rounds: int = Field(
        10, ge=1, description="Give up (error) after this many generation rounds' worth of groups "
        "without filling a batch.",
    )
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field(
        "acc", description="verl's algorithm.filter_groups.metric: the per-sample value whose spread decides "
        "whether a group is kept (kept when not all equal). acc = correctness; score = the reward function's "
        "score; seq_reward = score + overlong penalty (the trained reward); seq_final_reward = the same (no KL "
        "term is ever added to the reward here). Unlike verl, a group of one sample is always dropped; a uniform "
        "group is counted as all-correct / all-wrong by its accuracies, or as replay/dropped_uniform when they "
        "are mixed.",
    )
    retire_solved_after: int = Field(
        0, ge=0, le=1000, description="Retire a training prompt once this many of its groups came back "
        "all-correct: the prompt cursor skips its rows (every row with the same prompt) for the rest of the "
        "run, so generation is not spent on prompts the policy has solved (prime-rl's easy-prompt filter; "
        "Polaris and Skywork-OR1 drop solved prompts). Counted as replay/retired_prompts and "
        "replay/skipped_retired; checkpointed with the cursor. 0 = never. Needs `enable`.",
    )

    @model_validator(mode="after")
    def _retire_needs_filter(self) -> "DynamicSamplingConfig":
        """`retire_solved_after` needs `enable` (only dynamic sampling classifies a group as all-correct;
        without it nothing would ever retire)."""
        if self.retire_solved_after and not self.enable:
            raise ValueError("algorithm.dynamic_sampling.retire_solved_after needs "
                             "algorithm.dynamic_sampling.enable: true")
        return self


class AlgorithmConfig(Section):
    """DAPO loss: Clip-Higher, dual clip, token-level aggregation, overlong filtering, correction."""

    train_batch_groups: int = Field(
        16, ge=1, description="B: prompt groups per training step (train_prompt_bsz)."
    )
    clip_low: float = Field(0.2, gt=0, lt=1, description="epsilon_low: ratio clipped at 1 - this.")
    clip_high: float = Field(0.28, gt=0, le=10, description="epsilon_high: ratio clipped at 1 + this.")
    clip_c: float | None = Field(
        10.0, gt=1, description="Dual-clip constant c for A < 0 (None = off). DAPO recipe: 10."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="token-mean is DAPO; seq-mean-token-mean is naive GRPO."
    )
    scale_adv_by_std: bool = Field(True, description="GRPO advantage divides by the group std.")
    overlong_filtering: bool = Field(False, description="Mask the loss of truncated samples.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="after")
    def _clip_sane(self) -> "AlgorithmConfig":
        """`clip_high` is at least half of `clip_low` (DAPO's Clip-Higher wants clip_high >= clip_low)."""
        if self.clip_high < self.clip_low * 0.5:
            raise ValueError("clip_high is far below clip_low; DAPO's Clip-Higher wants clip_high >= clip_low")
        return self
