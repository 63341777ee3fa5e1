"""reward: the rule-based score and DAPO's overlong shaping."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_dapo.config.section import Section


class RewardConfig(Section):
    """Rule-based math reward (+1/-1) and DAPO's soft overlong punishment."""

    @model_validator(mode="after")
    def _one_box_rule(self) -> "RewardConfig":
        """`boxed_fallback` is `off` with `strict_box_verify` (the strict mode scores the box alone: a fallback
        for a missing Answer line would mean nothing)."""
        if self.strict_box_verify and self.boxed_fallback != "off":
            raise ValueError("reward.boxed_fallback must be 'off' with reward.strict_box_verify: true (the strict "
                             "mode scores only the box)")
        return self

    overlong_buffer_enable: bool = Field(True, description="Add the soft overlong penalty.")
    overlong_buffer_length: int = Field(
        8, ge=1, description="L_cache: penalty ramps over the last this-many tokens before L_max."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, le=100, description="Penalty at L_max.")
    function: str | None = Field(
        None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="The reward function, verl's custom_reward_function (path + name) as one string: "
        "'path/to/file.py:name' or 'package.module:name'. Called in the rollout actors as "
        "name(data_source, solution_str, ground_truth, extra_info) with the decoded response and the row's "
        "reward_model.ground_truth and extra_info; returns a float score, or a dict with 'score' and "
        "optionally 'acc' (default score > 0) and 'pred', as verl's. None = the built-in DAPO math reward "
        "(math_dapo rules). An exception abandons that group (counted as replay/abandoned/score_error) and "
        "its prompt goes back to the cursor; the run goes on.",
    )
    strict_box_verify: bool = Field(
        False, description="verl's math_dapo strict_box_verify: the built-in reward scores only the last "
        "\\boxed{} in the response's last 100 characters, compared exactly with the ground truth, instead of the "
        "last 'Answer:' line (the default, verl's).",
    )
    boxed_fallback: Literal["off", "exact", "normalized"] = Field(
        "off", description="An extra, not in verl: in the default (Answer-line) mode, a response with no "
        "'Answer:' line is scored by its last \\boxed{} in the last 100 characters instead of -1, equal to the "
        "ground truth exactly ('exact') or after normalising both ('normalized'). 'off' = verl: -1. Shapes only "
        "the built-in reward; ignored under strict_box_verify.",
    )
    timeout_s: float = Field(
        30, gt=0, le=3600, description="Bound (seconds) on scoring one group (its G responses) or one "
        "validation prompt: the reward function runs in a worker process off the engine's event loop, and a "
        "worker still busy after this is killed and replaced; the group is abandoned as "
        "replay/abandoned/score_timeout and its prompt goes back to the cursor.",
    )
    workers: int = Field(
        1, ge=1, le=64, description="Reward worker processes per rollout actor (groups are scored in parallel "
        "up to this many).",
    )
    max_score_failures: int = Field(
        3, ge=1, le=1000, description="A training row whose groups failed scoring (timeout or exception) this "
        "many times is quarantined: never issued again for the rest of the run, counted as "
        "replay/quarantined_prompts, logged once with its row; checkpointed with the cursor.",
    )
