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

A checkpoint keeps the same work across a restart (:meth:`PartialStore.saved`): the latest report of every
outstanding ticket, the carried reports still waiting, and the queued groups (complete, not trained yet) as
reports whose samples have all finished. ``--resume`` gives their prompts back to the cursor as the
checkpoint always did, and :meth:`PartialStore.restore` carries each report to its prompt's next admission.

``replay.carry_partials: false`` keeps the reports (so a leave's loss is measured) but carries none: the
tokens of a leaving engine's reports are then counted as ``wasted_tokens/<reason>``, and those a checkpoint
saved as ``wasted_tokens/restart`` when the run resumes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from async_dapo.stream.wire import Group, Partial, Progress

# release reason (replay/abandoned/<reason>) -> the waste reason of the tokens a leave throws away
LEAVE_REASONS = {"actor_failed": "engine_loss", "scaled_down": "scale_down"}
WASTE_REASONS = (*LEAVE_REASONS.values(), "restart")


def saved_limit(capacity_groups: int) -> int:
    """The most reports a checkpoint keeps: queued groups (at most replay.capacity_groups), outstanding
    tickets and the carried reports of released prompts (each at most the admission window, which the config
    keeps within the capacity)."""
    return 3 * capacity_groups


def finished_report(group: Group) -> Partial:
    """A complete group as a report whose samples have all finished: the engine that is handed it scores them
    again and sends them as they are (a sample with no finish reason on record ended as "stop")."""
    return Partial(group_id=group.group_id, prompt_index=group.prompt_index, epoch=group.epoch,
                   engine_rank=group.engine_rank, sent_at=group.created_at,
                   samples=tuple(Progress(s.response_ids, s.logprobs, s.versions, s.finish_reason or "stop",
                                          s.gen_seconds) for s in group.samples))


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

    def saved(self, queued: tuple[Group, ...], limit: int) -> list[Partial]:
        """What a checkpoint keeps of the work not trained yet: the latest report of each outstanding ticket,
        the carried reports waiting for their prompt, and the ``queued`` groups as finished reports; at most
        ``limit`` of them (the newest reports first: a queue that respects its capacity never reaches it)."""
        reports = sorted((p for p in self.latest.values() if p.num_tokens), key=lambda p: -p.sent_at)
        saved = [*map(finished_report, queued), *self.carried.values(), *reports]
        return saved[:limit]

    def restore(self, partials: list[Partial]) -> None:
        """The reports a checkpoint saved: carried to the next admission of each one's prompt (with carrying
        off, their tokens are counted as ``wasted_tokens/restart`` instead)."""
        for partial in partials:
            self.counts["restored"] += 1
            if self.carry:
                self.carried[(partial.epoch, partial.prompt_index)] = partial
            else:
                self.wasted_tokens["restart"] += partial.num_tokens

    def stats(self) -> dict[str, int]:
        return {"partials_received": self.counts["received"], "partials_unexpected": self.counts["unexpected"],
                "partials_out_of_order": self.counts["out_of_order"], "partials_held": len(self.latest),
                "partials_carried": self.counts["carried"], "partials_waiting": len(self.carried),
                "partials_handed_out": self.counts["handed_out"],
                "partial_tokens_handed_out": self.counts["handed_out_tokens"],
                "partials_restored": self.counts["restored"],
                **{f"wasted_tokens/{reason}": self.wasted_tokens[reason] for reason in WASTE_REASONS}}
