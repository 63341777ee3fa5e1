"""replay: the staleness-bounded replay queue."""

from __future__ import annotations

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
    silence_timeout_s: float = Field(
        900, gt=0, description="The learner's wait for a batch fails when no group at all arrived for this "
        "many seconds (bounds silence, not duration: a slow engine that keeps delivering groups is never "
        "killed by it). Must exceed placement.health_check_timeout_s + weight_sync.timeout_s.",
    )
