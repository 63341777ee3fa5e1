"""replay: the staleness-bounded replay queue."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_dapo.config.section import Section


class ReplayConfig(Section):
    """Staleness-bounded replay queue (AReaL's admission rule; per-sample staleness drop)."""

    max_staleness: int = Field(
        1, ge=0, le=1000, description="eta: 0 = synchronous; a group trained at version v has every "
        "token from a policy version >= v - eta.",
    )
    capacity_groups: int = Field(
        256, ge=1, description="Most groups held in the queue; >= (max_staleness + 1) * "
        "algorithm.train_batch_groups.",
    )
    ticket_ttl_s: float = Field(
        1800, gt=0, description="An admitted prompt whose group has not arrived after this many seconds is "
        "expired: its slot is released, it is counted as replay/abandoned/expired and the prompt goes back "
        "to the cursor; a group arriving later for it is dropped and counted.",
    )
    batch_order: Literal["auto", "arrival", "admission"] = Field(
        "auto", description="Which queued groups a batch takes: 'arrival' = the B that arrived first (the "
        "fastest-finishing, so shorter responses, in async runs); 'admission' = the B whose prompts were "
        "admitted first, waiting for a late one up to order_wait_s (trains the admitted population); 'auto' = "
        "admission with rollout.update_mode abort without rollout.partial_rollout (a push would otherwise keep "
        "restarting the long samples the batch never waits for), arrival otherwise (docs/concepts.md, 'What "
        "an async batch trains on').",
    )
    order_wait_s: float = Field(
        60, gt=0, description="With batch_order 'admission': the longest a batch that B queued groups could "
        "fill waits for an earlier-admitted group still generating; then it is handed out in admission "
        "order among the queued groups.",
    )
    carry_partials: bool = Field(
        True, description="With rollout.partial_every_s > 0: the prompts of an engine that leaves the fleet "
        "go back to the cursor with that engine's last progress report, and the engine that takes such a "
        "prompt next continues its samples from there. Also across a restart: what a checkpoint kept of the "
        "work not trained yet (the reports, the queued groups) is carried the same way after --resume. "
        "false = the reports are kept but never carried: what a leave or a restart throws away is counted "
        "(rollout/wasted_tokens/engine_loss, scale_down, restart), for comparison.",
    )
    silence_timeout_s: float = Field(
        900, gt=0, description="The learner's wait for a batch fails when no group at all arrived for this "
        "many seconds (bounds silence, not duration: a slow engine that keeps delivering groups is never "
        "killed by it). Must exceed placement.health_check_timeout_s + weight_sync.timeout_s.",
    )


def resolved_batch_order(batch_order: str, update_mode: str, partial_rollout: bool = False) -> str:
    """replay.batch_order with 'auto' resolved against rollout.update_mode and rollout.partial_rollout:
    'arrival' or 'admission'. Only an abort that throws the aborted tokens away needs admission order (the
    long samples would restart at every push); a kept prefix finishes on arrival order too, at half the
    staleness."""
    if batch_order == "auto":
        return "admission" if update_mode == "abort" and not partial_rollout else "arrival"
    return batch_order
