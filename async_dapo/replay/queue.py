"""The replay queue as its own process: an asyncio Ray actor around :class:`~async_dapo.replay.policy.ReplayPolicy`.

It owns three things and keeps them apart: the zmq receiver (transport), the policy (admission, staleness,
dynamic sampling), and the prompt cursor (which prompt comes next). Producers call ``admit`` over Ray and
wait on a condition — no busy loop — until the staleness bound lets them start more prompts; the learner
calls ``get_batch`` and waits the same way; ``set_version`` wakes both.

Accounting (nothing is lost): every admitted prompt holds a :class:`Ticket` until its group arrives. A
ticket ends in exactly one of three ways, and each one is counted:

* its group arrives → the policy accepts it (later trained, or dropped as stale/capacity) or drops it
  (all-correct, all-wrong, stale) — its counters (logged as ``replay/*``);
* the producer reports it failed (engine error, scoring exception, oversized or unsendable message,
  aborted or timed-out request) → :meth:`abandon`;
* nobody reports for ``replay.ticket_ttl_s``, or its rollout actor died → expired / released.

An abandoned, expired or released ticket gives its admission slot back and its prompt back to the cursor
(re-issued first), and is counted in ``abandoned/<reason>``. A ticket released because its engine left carries
that engine's last progress report (:mod:`async_dapo.replay.partials`) to the next admission of its prompt. A
group that arrives for a ticket that is no longer outstanding (expired, released, or from another run) is
dropped and counted (``rejected_unexpected``): the prompt was already given back, so it must not be trained
twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from async_dapo.config import Config, engine_ceiling, resolved_batch_order
from async_dapo.data.rows import PromptCursor, prompt_ids, train_rows
from async_dapo.replay.partials import Claim, PartialStore, saved_limit
from async_dapo.replay.policy import ACCEPTED, ReplayPolicy, split_admission
from async_dapo.stream.transport import GroupReceiver, new_secret
from async_dapo.stream.wire import Group, Partial, encode_partial

log = logging.getLogger(__name__)

SCORE_FAILURES = frozenset({"score_timeout", "score_error"})  # abandon reasons that count toward quarantine


class _Version:
    """The queue's view of the learner version (the policy reads it through ``current``)."""

    def __init__(self, version: int) -> None:
        self.value = version

    def current(self) -> int:
        return self.value


@dataclass(frozen=True)
class Ticket:
    """One admitted prompt: what the producer was given and what the queue needs to account for it."""

    group_id: str  # unique per admission: a re-issued prompt gets a new id, so a late group is recognised
    epoch: int
    index: int
    version: int  # the engines' version at admission
    engine_rank: int
    admitted_at: float  # time.monotonic() in the queue's process
    order: int = 0  # admission order (replay.batch_order = admission hands out by it)

    def wire(self) -> tuple[str, int, int, int]:
        return self.group_id, self.epoch, self.index, self.version

    def claim(self) -> Claim:
        return Claim(self.group_id, self.epoch, self.index, self.engine_rank)


class ReplayQueue:
    """Async actor body: ``admit`` / group arrival / ``get_batch`` / ``set_version`` / ``abandon``."""

    def __init__(self, cfg: Config, initial_version: int = 0) -> None:
        self.cfg = cfg
        self.version = _Version(initial_version)
        self.policy: ReplayPolicy[Group] = ReplayPolicy(
            batch_groups=cfg.algorithm.train_batch_groups, max_staleness=cfg.replay.max_staleness,
            capacity=cfg.replay.capacity_groups, dynamic_sampling=cfg.algorithm.dynamic_sampling.enable,
            versions=self.version, filter_metric=cfg.algorithm.dynamic_sampling.metric,
            batch_order=resolved_batch_order(cfg.replay.batch_order, cfg.rollout.update_mode,
                                             cfg.rollout.partial_rollout),
        )
        self.rows = train_rows(cfg)  # kept: a quarantined row is logged with its content
        self.cursor = self._new_cursor(cfg, self.rows)
        # Per run, handed to producers over Ray only: a sender without it is counted, never heard.
        self.secret = new_secret()
        self.receiver = GroupReceiver.from_config(cfg, secret=self.secret, bind_host=self._bind_host(cfg))
        self._changed: asyncio.Condition | None = None
        self._receiving: asyncio.Task | None = None
        self.tickets: dict[str, Ticket] = {}
        self.partials = PartialStore(carry=cfg.replay.carry_partials)  # progress of the groups in flight
        # engine rank -> the incarnation (one actor process) whose admissions count; a dead actor's admit
        # call that was still waiting must not take tickets nobody will produce.
        self.producers: dict[int, str] = {}
        self._serial = itertools.count()
        # The admit calls parked now, in the order they came: ask serial -> the prompts it asked for.
        self.asks: dict[int, int] = {}
        self._asks_serial = itertools.count()
        self._asks_changed = 0  # bumped whenever an ask comes or goes: the split below is reused until then
        self._split: tuple[tuple[int, int], dict[int, int]] = ((0, -1), {})
        self.abandoned: Counter[str] = Counter()
        self.score_failures: Counter[int] = Counter()  # row index -> groups of it that failed scoring
        self.wait_seconds = {"admit": 0.0, "batch": 0.0}
        self.unexpected = 0  # valid groups for tickets that are not outstanding
        self.last_arrival = time.monotonic()  # or the moment a group was last expected again (silent_s)
        self._since_batch: Counter[str] = Counter()  # arrival outcomes since the last hand-out
        self._blocked_since: float | None = None  # admission order: B queued, an earlier admission still running
        self.forced_batches = 0  # admission-order batches handed out when order_wait_s ran out

    @staticmethod
    def _new_cursor(cfg: Config, rows: list) -> PromptCursor:
        retire_after = cfg.algorithm.dynamic_sampling.retire_solved_after
        # Rows of one prompt retire together (DAPO-Math-17k repeats each problem; the synthetic task cycles).
        return PromptCursor(len(rows), seed=cfg.data.shuffle_seed, retire_after=retire_after,
                            keys=prompt_ids(rows) if retire_after else None)

    def _cond(self) -> asyncio.Condition:
        # Created lazily inside the actor's running event loop.
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._receiving = asyncio.ensure_future(self._receive_forever())
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    # ------------------------------------------------------------------ arrivals
    async def _receive_forever(self) -> None:
        while True:
            message = await self.receiver.arecv(timeout_ms=1000)
            expired = self._expire(time.monotonic())
            if isinstance(message, Partial):
                ticket = self.tickets.get(message.group_id)
                self.partials.report(message, None if ticket is None else ticket.claim())
                if not expired:
                    continue  # progress changes nothing anyone waits for: no wake-up
            elif message is not None:
                self._arrive(message)
            await self._notify()

    def _arrive(self, group: Group) -> None:
        ticket = self.tickets.pop(group.group_id, None)
        if ticket is None or (ticket.epoch, ticket.index) != (group.epoch, group.prompt_index):
            # Its prompt was already given back (expired, released) or never admitted here: counting it
            # would break the admission arithmetic and could train a prompt twice.
            self.unexpected += 1
            if ticket is not None:
                self.tickets[ticket.group_id] = ticket
            return
        self.last_arrival = time.monotonic()
        self.partials.end(ticket.group_id)
        try:
            outcome = self.policy.on_group(group, ticket.order)
        except Exception as exc:  # one bad group must not end the receive task
            log.error("group %s: %r", group.group_id, exc)
            self.tickets[ticket.group_id] = ticket
            self._abandon(ticket, "queue_error")
            return
        self._since_batch[outcome] += 1
        # solved = every sample correct, whatever the filter's metric kept or dropped the group for
        if all(group.accuracies) and self.cursor.solved(group.prompt_index):
            log.debug("prompt of row %d retired as solved", group.prompt_index)
        if outcome != ACCEPTED:
            log.debug("group %s: %s", group.group_id, outcome)

    def _abandon(self, ticket: Ticket, reason: str) -> bool:
        if self.tickets.pop(ticket.group_id, None) is None:
            return False
        self.partials.release(ticket.claim(), reason)
        self.policy.abandon(1)
        self.abandoned[reason] += 1
        if not (reason in SCORE_FAILURES and self._count_score_failure(ticket.index)):
            self.cursor.give_back([(ticket.epoch, ticket.index)])
        return True

    def _count_score_failure(self, index: int) -> bool:
        """One more group of row ``index`` failed scoring; True if that quarantined the row (a reward function
        that hangs or raises on it would otherwise get it re-issued first, again and again)."""
        self.score_failures[index] += 1
        limit = self.cfg.reward.max_score_failures
        if self.score_failures[index] < limit or not self.cursor.quarantine(index):
            return False
        row = self.rows[index]
        log.error("training row %d quarantined after %d scoring failures (reward.max_score_failures); it is not "
                  "issued again: data_source=%r ground_truth=%r prompt=%.300r", index, limit, row.data_source,
                  row.ground_truth, row.prompt[-1].content)
        return True

    def _expire(self, now: float) -> bool:
        """Abandon the tickets older than replay.ticket_ttl_s; True if there were any."""
        ttl = self.cfg.replay.ticket_ttl_s
        old = [t for t in self.tickets.values() if now - t.admitted_at > ttl]
        for ticket in old:
            log.warning("ticket %s (engine %d) expired after %.0f s", ticket.group_id, ticket.engine_rank, ttl)
            self._abandon(ticket, "expired")
        return bool(old)

    @staticmethod
    def _bind_host(cfg: Config) -> str:
        """transport.bind_host, with "node" resolved to the address Ray knows for this node (the one other
        nodes reach): the queue then listens there and nowhere else."""
        if cfg.transport.bind_host != "node":
            return cfg.transport.bind_host
        import ray

        return ray.util.get_node_ip_address()

    # ------------------------------------------------------------------ API (Ray methods)
    async def address(self) -> str:
        """Where producers connect. A wildcard bind (multi-node) is advertised as this node's IP."""
        self._cond()
        if self.cfg.transport.bind_host in ("0.0.0.0", "::"):
            import ray

            return f"tcp://{ray.util.get_node_ip_address()}:{self.receiver.port}"
        return self.receiver.address

    async def pid(self) -> int:
        return os.getpid()

    async def producer_secret(self) -> bytes:
        """The run's message key (travels over Ray, never over the zmq socket)."""
        return self.secret

    async def register_producer(self, engine_rank: int, incarnation: str) -> None:
        """From now on only ``incarnation`` admits prompts for ``engine_rank`` (a replacement registers)."""
        self.producers[engine_rank] = incarnation

    async def admit(self, engine_rank: int, max_prompts: int, wait_s: float = 5.0,
                    incarnation: str | None = None) -> list[tuple[str, int, int, int, Partial | None]]:
        """Wait up to ``wait_s`` until the admission rule allows at least one prompt for this call (calls
        parked together split the free room: policy.split_admission); returns up to ``max_prompts``
        tickets (group id, epoch, prompt index, version at admission, and the progress an engine that left
        made on that prompt, to continue from, or None), or [] on expiry or when
        ``incarnation`` is not (or no longer) the registered producer of ``engine_rank``."""
        t0 = time.perf_counter()
        ask = next(self._asks_serial)
        async with self._cond():
            self.asks[ask] = max_prompts
            self._asks_changed += 1
            try:
                await asyncio.wait_for(self._cond().wait_for(lambda: self._share(ask) > 0), wait_s)
                share = self._share(ask)
            except asyncio.TimeoutError:
                return []
            finally:
                del self.asks[ask]
                self._asks_changed += 1
                self._cond().notify_all()  # the asks left share the room without this one
            if incarnation is not None and self.producers.get(engine_rank) != incarnation:
                return []
            picks = self.cursor.take(share)
            if not picks:  # every prompt retired as solved: get_batch's problem says so
                return []
            if self.policy.stats.running == 0:  # nothing was expected until now: silence starts here
                self.last_arrival = time.monotonic()
            self.policy.admit(len(picks))
        now = time.monotonic()
        serials = [next(self._serial) for _ in picks]
        tickets = [Ticket(f"{e}-{i}-{n}", e, i, self.version.value, engine_rank, now, n)
                   for (e, i), n in zip(picks, serials)]
        self.tickets.update({t.group_id: t for t in tickets})
        self.wait_seconds["admit"] += time.perf_counter() - t0
        return [(*t.wire(), self.partials.take(t.epoch, t.index)) for t in tickets]

    def _share(self, ask: int) -> int:
        """This ask's part of the free room when every parked ask splits it (policy.split_admission). Every
        parked call evaluates this on every wake-up (each arrival): the split is computed once per change of
        the room or of the asks, and not at all while the window is full."""
        capacity = self.policy.capacity_to_admit()
        if capacity <= 0:
            return 0
        key = (capacity, self._asks_changed)
        if self._split[0] != key:
            self._split = (key, dict(zip(self.asks, split_admission(list(self.asks.values()), capacity))))
        return self._split[1][ask]

    async def abandon(self, group_id: str, reason: str) -> bool:
        """A producer will never send this ticket's group: free its slot, give its prompt back, count it.
        False if the ticket was no longer outstanding (already expired or released)."""
        ticket = self.tickets.get(group_id)
        done = ticket is not None and self._abandon(ticket, reason)
        await self._notify()
        return done

    async def release_engine(self, engine_rank: int, reason: str) -> int:
        """Abandon every outstanding ticket of one rollout actor (it died or was replaced)."""
        self.producers.pop(engine_rank, None)
        mine = [t for t in self.tickets.values() if t.engine_rank == engine_rank]
        carried = self.partials.counts["carried"]
        for ticket in mine:
            self._abandon(ticket, reason)
        log.info("engine %d left (%s): %d prompts back to the cursor, %d with its progress carried", engine_rank,
                 reason, len(mine), self.partials.counts["carried"] - carried)
        await self._notify()
        return len(mine)

    async def get_batch(self, learner_version: int | None = None, wait_s: float = 5.0) -> dict[str, Any]:
        """Wait up to ``wait_s`` for B fresh, mixed-outcome groups. Returns ``{"batch": [...]}`` or
        ``{"batch": None, "problem": str | None, "silent_s": float}``; ``problem`` says why no batch can
        come (dynamic sampling gave up, the receive task died). Staleness is judged against
        ``learner_version`` (the weights the batch will be trained on; default: the engines')."""
        t0 = time.perf_counter()
        batch: list[Group] = []

        def ready() -> bool:
            got = self._take(learner_version)
            batch.extend(got or [])
            return got is not None

        async with self._cond():
            try:
                await asyncio.wait_for(self._cond().wait_for(ready), wait_s)
            except asyncio.TimeoutError:
                pass
            self._cond().notify_all()  # stale drops inside take_batch may free admission slots
        self.wait_seconds["batch"] += time.perf_counter() - t0
        if batch:
            self._since_batch.clear()
            return {"batch": batch}
        return {"batch": None, "problem": self._problem(), "silent_s": self.silent_s()}

    def _take(self, learner_version: int | None) -> list[Group] | None:
        """The policy's batch; in admission order, held while an earlier admission still generates, at most
        replay.order_wait_s from the moment B groups could have made a batch."""
        oldest = min((t.order for t in self.tickets.values()), default=None)
        if not self.policy.blocked_by_running(learner_version, oldest):
            self._blocked_since = None
            return self.policy.take_batch(learner_version, oldest)
        now = time.monotonic()
        self._blocked_since = self._blocked_since or now
        if now - self._blocked_since < self.cfg.replay.order_wait_s:
            return None
        self._blocked_since = None
        self.forced_batches += 1
        return self.policy.take_batch(learner_version, oldest, force=True)

    def silent_s(self) -> float:
        """Seconds without a group while groups are expected (running > 0): time when nothing could arrive
        (the window is full and the learner is training, validating or checkpointing) is not silence."""
        return time.monotonic() - self.last_arrival if self.policy.stats.running else 0.0

    def _problem(self) -> str | None:
        if self._receiving is not None and self._receiving.done():
            exc = None if self._receiving.cancelled() else self._receiving.exception()
            return f"the replay queue's receive task ended: {exc!r}"
        if self.cursor.exhausted and not self.policy.stats.running:
            retired = (f"{len(self.cursor.retired)} prompts; algorithm.dynamic_sampling.retire_solved_after = "
                       f"{self.cursor.retire_after}")
            if not self.cursor.quarantined:
                return f"every training prompt is retired as solved ({retired})"
            return (f"no training row left to issue: retired as solved {retired}; quarantined "
                    f"{len(self.cursor.quarantined)} rows (reward.max_score_failures)")
        b, rounds = self.cfg.algorithm.train_batch_groups, self.cfg.algorithm.dynamic_sampling.max_gen_rounds
        got = sum(self._since_batch.values())
        if got < rounds * b:
            return None
        parts = ", ".join(f"{self._since_batch[k] / got:.0%} {k.removeprefix('dropped_').replace('_', '-')}"
                          for k in ("dropped_all_correct", "dropped_all_wrong", "dropped_uniform", "dropped_stale")
                          if k != "dropped_uniform" or self._since_batch[k])  # uniform: only under a non-acc metric
        return (f"{b} groups needed, {self._since_batch[ACCEPTED]} mixed in {got // b} rounds ({got} groups): "
                f"{parts} (algorithm.dynamic_sampling.max_gen_rounds = {rounds})")

    async def set_version(self, version: int) -> None:
        """The engines now run ``version``: advance, which widens admission and may make groups stale."""
        self.version.value = version
        await self._notify()

    async def stats(self) -> dict[str, Any]:
        wire = {k: v for k, v in self.receiver.counters.items() if k.startswith("rejected_")}
        return {**self.policy.stats.snapshot(), **wire, **{f"abandoned/{k}": v for k, v in self.abandoned.items()},
                "rejected_unexpected": self.unexpected, "retired_prompts": len(self.cursor.retired),
                **self.partials.stats(),
                # Counted from the ticket table itself, not from the counters (``running`` is derived from them):
                # a ticket lost without being counted shows as running > open_tickets.
                "open_tickets": len(self.tickets), "forced_batches": self.forced_batches,
                "quarantined_prompts": len(self.cursor.quarantined),
                "skipped_retired": self.cursor.skipped, "version": self.version.value,
                "admission_limit": self.policy.admission_limit(), "capacity_to_admit": self.policy.capacity_to_admit(),
                "wait_admit_s": self.wait_seconds["admit"], "wait_batch_s": self.wait_seconds["batch"],
                "silent_s": self.silent_s()}

    async def state_dict(self, untrained: tuple[Group, ...] | list[Group] = ()) -> dict[str, Any]:
        """Checkpointable state: the cursor with every admitted-but-untrained prompt given back (``untrained``:
        groups handed out in a batch the learner has not trained), and the work generated for them so far."""
        groups = (*self.policy.queued(), *untrained)
        cur = PromptCursor(self.cursor.num_rows, self.cursor.seed)  # the state carries retirement; keys are not state
        cur.load_state_dict(self.cursor.state_dict())
        cur.give_back([(t.epoch, t.index) for t in self.tickets.values()] + [(g.epoch, g.prompt_index) for g in groups])
        kept = self.partials.saved(groups, saved_limit(self.cfg.replay.capacity_groups))
        return {"cursor": cur.state_dict(), "version": self.version.value,
                "partials": [encode_partial(p) for p in kept]}

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (:meth:`state_dict`, its ``partials`` decoded by the checkpoint's reader)."""
        self.cursor.load_state_dict(state["cursor"])
        self.version.value = state["version"]
        partials = state.get("partials", [])
        self.partials.restore(partials)
        log.info("restored the generated work of %d prompts (%d tokens) with the checkpoint%s", len(partials),
                 sum(p.num_tokens for p in partials),
                 "" if self.partials.carry else ": counted as wasted (replay.carry_partials is false)")

    async def close(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()
        self.receiver.close()


def replay_actor_class(cfg: Config, **options):
    import ray

    # Each rollout actor keeps one admit call parked here while the window is full (up to rollout's
    # ADMIT_WAIT_S), a replacement's beside its predecessor's: with no more slots than that, get_batch and
    # set_version wait behind them (tools/bench/control_plane.py, 64 engines: 313 vs 707 groups/s).
    return ray.remote(ReplayQueue).options(num_cpus=cfg.placement.queue_cpus,
                                           max_concurrency=64 + 2 * engine_ceiling(cfg), **options)
