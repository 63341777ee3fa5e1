"""What the replay queue keeps of the groups still in flight, so that no generated token is thrown away when
an engine leaves the fleet.

Each rollout actor reports the progress of its groups every ``rollout.partial_every_s``
(:class:`~async_dapo.stream.wire.Partial`: each sample's tokens, log-probs and versions so far). The queue
keeps the latest report of each outstanding ticket here. When the ticket ends normally (its group arrived, or
its producer abandoned it) the report is forgotten. When the ticket is released because its engine left
(``actor_failed``: died or hung; ``scaled_down``) the report is **carried**: the prompt goes back to the
cursor as before, and the engine that is handed that prompt next receives the report with its ticket and
continues each unfinished sample from its prefix. A carried report is handed out once, with the next
admission of its prompt; if that engine leaves too, its own reports (which include the carried tokens) are
carried in turn. The prompt itself is accounted for by its tickets, as before: nothing is trained twice.

Memory: one report per outstanding ticket (each within transport.max_message_bytes; tickets are bounded by
admission) plus one per prompt released by a leaving engine until that prompt is admitted again.

``replay.carry_partials: false`` keeps the reports (so a leave's loss is measured) but carries none: the
tokens of a leaving engine's reports are then counted as ``wasted_tokens/<reason>``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from async_dapo.stream.wire import Partial

# release reason (replay/abandoned/<reason>) -> the waste reason of the tokens a leave throws away
LEAVE_REASONS = {"actor_failed": "engine_loss", "scaled_down": "scale_down"}


@dataclass(frozen=True)
class Claim:
    """What a report must match to be kept: the outstanding ticket it claims to be about."""

    group_id: str
    epoch: int
    index: int
    engine_rank: int


class PartialStore:
    """The latest progress report of each outstanding ticket, and the carried reports of released prompts."""

    def __init__(self, carry: bool) -> None:
        self.carry = carry
        self.latest: dict[str, Partial] = {}  # group_id -> the newest report of that outstanding ticket
        self.carried: dict[tuple[int, int], Partial] = {}  # (epoch, index) -> report for the next admission
        self.counts: Counter[str] = Counter()
        self.wasted_tokens: Counter[str] = Counter()

    def report(self, partial: Partial, ticket: Claim | None) -> bool:
        """Keep ``partial`` if it is about ``ticket`` (outstanding, same prompt and engine) and not older than
        the report already kept; a report for no outstanding ticket is counted as ``unexpected``."""
        if ticket is None or (ticket.group_id, ticket.epoch, ticket.index, ticket.engine_rank) != (
                partial.group_id, partial.epoch, partial.prompt_index, partial.engine_rank):
            self.counts["unexpected"] += 1
            return False
        kept = self.latest.get(partial.group_id)
        if kept is not None and kept.sent_at > partial.sent_at:  # one sender thread: only a clock step does this
            self.counts["out_of_order"] += 1
            return False
        self.latest[partial.group_id] = partial
        self.counts["received"] += 1
        return True

    def end(self, group_id: str) -> None:
        """The ticket ended without its engine leaving: its report is of no further use."""
        self.latest.pop(group_id, None)

    def release(self, ticket: Claim, reason: str) -> None:
        """The ticket was released with ``reason``: if its engine left, carry its last report to the next
        admission of its prompt (or, with carrying off, count its tokens as wasted by the leave)."""
        partial = self.latest.pop(ticket.group_id, None)
        if reason not in LEAVE_REASONS or partial is None or not partial.num_tokens:
            return
        if self.carry:
            self.carried[(ticket.epoch, ticket.index)] = partial
            self.counts["carried"] += 1
        else:
            self.wasted_tokens[LEAVE_REASONS[reason]] += partial.num_tokens

    def take(self, epoch: int, index: int) -> Partial | None:
        """The carried report of a prompt being admitted again, handed out once."""
        partial = self.carried.pop((epoch, index), None)
        if partial is not None:
            self.counts["handed_out"] += 1
            self.counts["handed_out_tokens"] += partial.num_tokens
        return partial

    def stats(self) -> dict[str, int]:
        return {"partials_received": self.counts["received"], "partials_unexpected": self.counts["unexpected"],
                "partials_out_of_order": self.counts["out_of_order"], "partials_held": len(self.latest),
                "partials_carried": self.counts["carried"], "partials_waiting": len(self.carried),
                "partials_handed_out": self.counts["handed_out"],
                "partial_tokens_handed_out": self.counts["handed_out_tokens"],
                **{f"wasted_tokens/{reason}": self.wasted_tokens[reason] for reason in LEAVE_REASONS.values()}}
