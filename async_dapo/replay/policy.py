"""Staleness-bounded replay queue: the POLICY (pure, synchronous, no I/O, no threads).

The replay actor wraps one :class:`ReplayPolicy` and does the waiting; this module only decides.
Three decisions, with v = the learner's current policy version (``versions.current()``), η =
``replay.max_staleness``, B = ``algorithm.train_batch_groups``:

* Admission (AReaL's rule, counted in prompts = groups): a rollout may start one more prompt only while

      in_window + running < (η + (v − v0) + 1) · B

  ``running`` = prompts admitted whose group has not arrived (nor been abandoned); ``in_window`` =
  groups accepted into the queue and not dropped afterwards (= handed_out + depth). v0 is the version
  the policy was created at: 0 in a fresh run, so the rule is AReaL's verbatim; on a resume the counters
  start from zero, and counting versions from v0 keeps the resumed run from bursting past the bound
  (AReaL #1345).
* Arrival: a group is dropped as stale if v − min_version > η (its oldest token is too old), otherwise,
  with dynamic sampling on, dropped if its samples' values of the filter metric are all equal
  (:func:`keeps_group`; verl's ``algorithm.filter_groups``, metric ``acc`` by default: all correct or all
  wrong), otherwise accepted (FIFO).
* Hand-out: queued groups with v − min_version > η are dropped, then exactly B groups are handed out,
  or nothing if fewer than B remain. Order ``arrival``: the B oldest arrivals. Order ``admission``: the
  B earliest-admitted queued groups, and only once no prompt admitted before the last of them is still
  running (the caller names the earliest running admission; it may force the batch when a late group
  has kept it waiting too long). Arrival order favours the groups that finish first (short, easy ones)
  in every async batch; admission order trains the population as it was admitted.
* Split: when several producers wait for admission at once, the room is shared (:func:`split_admission`)
  so that their prompts in flight end as even as possible; the first caller does not take it all.

Guarantee (PER SAMPLE): every token of every handed-out group was produced by a policy version
≥ v − η, where v is the version current at hand-out. The admission bound alone is only aggregate (it
bounds how far generation runs ahead of the learner); the drop at hand-out is what makes the
per-sample guarantee hold.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = [
    "ACCEPTED",
    "BATCH_ORDERS",
    "DROPPED_ALL_CORRECT",
    "DROPPED_ALL_WRONG",
    "DROPPED_STALE",
    "DROPPED_UNIFORM",
    "FILTER_METRICS",
    "FREES_ADMISSION",
    "OUTCOMES",
    "GroupLike",
    "ReplayPolicy",
    "ReplayStats",
    "VersionSource",
    "filter_outcome",
    "keeps_group",
    "metric_values",
]

ACCEPTED = "accepted"
DROPPED_ALL_CORRECT = "dropped_all_correct"
DROPPED_ALL_WRONG = "dropped_all_wrong"
DROPPED_UNIFORM = "dropped_uniform"  # non-acc metric all equal while the accuracies are mixed
DROPPED_STALE = "dropped_stale"
BATCH_ORDERS = ("arrival", "admission")
OUTCOMES = (ACCEPTED, DROPPED_ALL_CORRECT, DROPPED_ALL_WRONG, DROPPED_UNIFORM, DROPPED_STALE)
WASTE_REASONS = ("filtered", "stale", "capacity")
# Arrival outcomes that give an admission slot back (a dropped group never counts as in_window).
FREES_ADMISSION = frozenset({DROPPED_ALL_CORRECT, DROPPED_ALL_WRONG, DROPPED_UNIFORM, DROPPED_STALE})

# verl's algorithm.filter_groups.metric values -> the per-sample field read (wire.Sample):
#   acc              -> acc    (the reward function's correctness flag)
#   score            -> score  (the reward function's score, before the overlong penalty)
#   seq_reward       -> reward (score + overlong penalty: verl's token_level_scores summed)
#   seq_final_reward -> reward (verl's token_level_rewards summed = seq_reward − the KL-in-reward
#                      penalty; no KL term is ever put into the reward here, so it equals seq_reward)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
_METRIC_FIELD = {"acc": "accuracies", "score": "scores", "seq_reward": "rewards", "seq_final_reward": "rewards"}


class GroupLike(Protocol):
    """What the policy reads from a group (``wire.Group`` satisfies it). ``scores`` and ``rewards`` are read
    only when the filter metric needs them."""

    @property
    def min_version(self) -> int:
        """Policy version of the group's OLDEST token."""
        ...

    @property
    def accuracies(self) -> Sequence[bool]:
        """One correctness flag per sample (metric ``acc``; also names a uniform group's drop)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Response tokens over all samples (what a drop wastes; the trained-length ratio)."""
        ...

    @property
    def scores(self) -> Sequence[float]:
        """One reward-function score per sample (metric ``score``)."""
        ...

    @property
    def rewards(self) -> Sequence[float]:
        """One shaped reward per sample, score + overlong penalty (``seq_reward``, ``seq_final_reward``)."""
        ...


def metric_values(group: GroupLike, metric: str) -> tuple[float, ...]:
    """The per-sample values dynamic sampling compares under ``metric`` (see :data:`FILTER_METRICS`).
    Raises ValueError for an unknown metric, for an ``acc`` value that is not a boolean or 0/1 (a shaped
    reward is not an accuracy) and for a non-finite score or reward."""
    if metric not in _METRIC_FIELD:
        raise ValueError(f"dynamic-sampling metric must be one of {FILTER_METRICS}, got {metric!r}")
    values = tuple(getattr(group, _METRIC_FIELD[metric]))
    for value in values:
        if metric == "acc":
            if value not in (0, 1):  # True/False compare equal to 1/0
                raise ValueError(f"accuracies must be booleans or 0/1, got {value!r}: a shaped reward is "
                                 "filtered with metric score / seq_reward, not acc")
        elif not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{_METRIC_FIELD[metric]} must be finite numbers, got {value!r}")
    return tuple(float(v) for v in values)


def keeps_group(values: Sequence[float]) -> bool:
    """verl's dynamic-sampling rule on one group's metric values: kept iff they are not all equal.

    verl keeps ``std(values) > 0 or len(values) == 1``; two deliberate differences: a group of ONE sample
    is dropped here (it has no spread to learn from: its GRPO advantage would be its raw score), and
    "all equal" is exact equality, where numpy's std can leave ~1e-17 for equal floats (three 0.1s) and
    make verl keep such a group, whose advantages are all 0 anyway."""
    return len(values) > 1 and any(value != values[0] for value in values)


def filter_outcome(values: Sequence[float], accuracies: Sequence[bool]) -> str:
    """Dynamic sampling's verdict on a fresh group: ACCEPTED when :func:`keeps_group`, else the drop's name,
    by the accuracies so that the counters keep their meaning under any metric: all correct →
    DROPPED_ALL_CORRECT, all wrong → DROPPED_ALL_WRONG, mixed (possible only for a non-acc metric, e.g.
    +1 − 2·penalty = −1 + 0) → DROPPED_UNIFORM."""
    if keeps_group(values):
        return ACCEPTED
    if all(accuracies):
        return DROPPED_ALL_CORRECT
    if not any(accuracies):
        return DROPPED_ALL_WRONG
    return DROPPED_UNIFORM


class VersionSource(Protocol):
    """The learner's current policy version (the number of optimizer steps it has published)."""

    def current(self) -> int: ...


G = TypeVar("G", bound=GroupLike)


@dataclass
class ReplayStats:
    """Counters for the metrics layer; all cumulative except ``depth`` and the ``last_batch_*``.

    Identities (hold after every call):
    ``received = accepted + dropped_all_correct + dropped_all_wrong + dropped_uniform + dropped_stale``;
    ``depth = accepted − handed_out − dropped_stale_at_handout − dropped_capacity``.
    """

    admitted: int = 0  # prompts admitted
    abandoned: int = 0  # admitted prompts that will never send a group (aborted, actor died)
    received: int = 0  # groups that arrived
    received_samples: int = 0  # their samples, kept or dropped
    received_correct: int = 0  # ... judged correct: the policy's accuracy on the prompts it is asked
    accepted: int = 0  # groups put into the queue
    handed_out: int = 0  # groups given to the learner
    dropped_all_correct: int = 0  # on arrival, dynamic sampling
    dropped_all_wrong: int = 0  # on arrival, dynamic sampling
    dropped_uniform: int = 0  # on arrival, dynamic sampling: metric values equal, accuracies mixed
    dropped_stale: int = 0  # on arrival: v − min_version > η
    dropped_stale_at_handout: int = 0  # queued, then too old by the time the learner asked
    dropped_capacity: int = 0  # oldest queued group pushed out by a full queue
    depth: int = 0  # groups queued now
    batches: int = 0  # batches handed out
    last_batch_staleness_mean: float = 0.0
    last_batch_staleness_max: int = 0
    staleness_hist: dict[int, int] = field(default_factory=dict)  # staleness -> handed-out groups
    received_tokens: int = 0  # response tokens of the groups that arrived, kept or dropped
    handed_out_samples: int = 0
    handed_out_tokens: int = 0  # response tokens handed out (trained)
    handed_out_correct: int = 0  # samples handed out whose accuracy counts as correct
    # response tokens of dropped groups by reason: filtered (dynamic sampling), stale, capacity
    wasted_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WASTE_REASONS, 0))
    # the last batch's mean response length / the mean length of every group that arrived since the batch
    # before it (kept or not): < 1 when batches favour short responses
    last_batch_length_ratio: float = 0.0
    # the same for accuracy, the prompts' difficulty as the policy that sampled them sees it: > 1 when
    # batches favour easy prompts (dynamic sampling alone moves it: all-wrong groups are never trained)
    last_batch_acc_ratio: float = 0.0
    _window_tokens: int = 0  # arrivals since the last hand-out
    _window_samples: int = 0
    _window_correct: int = 0

    @property
    def running(self) -> int:
        """Prompts admitted whose group has not arrived yet."""
        return self.admitted - self.abandoned - self.received

    @property
    def in_window(self) -> int:
        """Accepted groups that still count against admission (= handed_out + depth)."""
        return self.accepted - self.dropped_stale_at_handout - self.dropped_capacity

    def snapshot(self) -> dict[str, float | int]:
        """Flat metrics dict; the histogram becomes ``staleness_hist/<k>`` keys."""
        out: dict[str, float | int] = {
            name: value for name, value in vars(self).items()
            if name not in ("staleness_hist", "wasted_tokens") and not name.startswith("_")
        }
        for reason, tokens in self.wasted_tokens.items():
            out[f"wasted_tokens/{reason}"] = tokens
        out["running"] = self.running
        out["in_window"] = self.in_window
        for staleness, count in sorted(self.staleness_hist.items()):
            out[f"staleness_hist/{staleness}"] = count
        return out


class ReplayPolicy(Generic[G]):
    """Admission, arrival and hand-out decisions of the staleness-bounded replay queue.

    Formulas (v = ``versions.current()``, v0 = ``start_version``, η = ``max_staleness``,
    B = ``batch_groups``):

    * admit n more prompts iff ``in_window + running + n ≤ (η + (v − v0) + 1) · B``; for n = 1 this
      is exactly AReaL's ``accepted + running < (η + version + 1) · batch_size``, where a group
      dropped after acceptance (stale at hand-out, capacity) gives its slot back, as a
      dynamic-sampling drop does — otherwise every such drop would shrink the window for good
      and the run could deadlock with fewer than B groups queued and no slot left.
    * a group is stale iff ``v − min_version > η``; it is dropped on arrival and, if already
      queued, when the learner next asks for a batch.
    * with ``dynamic_sampling``, a fresh group is kept iff its values of ``filter_metric`` (verl's
      ``algorithm.filter_groups.metric``, see :data:`FILTER_METRICS`) are not all equal
      (:func:`keeps_group`; a group of one is dropped); a drop is named by :func:`filter_outcome`.

    Guarantee (PER SAMPLE): every token of every group returned by :meth:`take_batch` was produced
    by a policy version ≥ v − η, v being the version current at hand-out (the learner trains on
    the batch at v). Admission is only an aggregate bound on how far generation runs ahead; the
    stale drop is what makes the guarantee per sample.

    η = 0 is synchronous: the learner holds version v's batch while it trains, so in_window =
    (v − v0 + 1)·B and nothing more is admitted until the version advances; then exactly B
    prompts are admitted per version (plus one replacement per dropped group).

    Capacity: construction requires ``capacity ≥ (η + 1) · B``. When the version advances only
    after the learner has taken a batch, depth ≤ (η + 1) · B follows from the admission rule, so
    the queue never overflows; if an arrival still finds it full (a version source moved by
    someone else), the OLDEST queued group is dropped and counted in ``dropped_capacity``.

    Wake-ups for the actor that wraps this: admission capacity can only grow after a version
    advance, an arrival whose outcome is in :data:`FREES_ADMISSION` (or that pushed out an
    old group), a :meth:`take_batch` that dropped stale groups, or :meth:`abandon`; checking
    ``capacity_to_admit() > 0`` after each call is O(1) and enough. A batch can only become
    available after an ``accepted`` arrival.
    """

    def __init__(
        self,
        *,
        batch_groups: int,
        max_staleness: int,
        capacity: int,
        dynamic_sampling: bool,
        versions: VersionSource,
        start_version: int | None = None,
        filter_metric: str = "acc",
        batch_order: str = "arrival",
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if capacity < (max_staleness + 1) * batch_groups:
            raise ValueError(
                f"replay capacity {capacity} < (max_staleness + 1) * batch_groups = "
                f"({max_staleness} + 1) * {batch_groups} = {(max_staleness + 1) * batch_groups}: "
                "the admission rule lets that many groups be queued at once"
            )
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.capacity = capacity
        if filter_metric not in FILTER_METRICS:
            raise ValueError(f"filter_metric must be one of {FILTER_METRICS}, got {filter_metric!r}")
        if batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order must be one of {BATCH_ORDERS}, got {batch_order!r}")
        self.dynamic_sampling = dynamic_sampling
        self.filter_metric = filter_metric
        self.batch_order = batch_order
        self._arrivals = 0  # the order of a group given none
        self._versions = versions
        # On a resume pass the restored version explicitly: a queue actor started before the
        # learner restored its checkpoint would otherwise read 0 here and burst later.
        self.start_version = versions.current() if start_version is None else start_version
        self._queue: deque[tuple[int, G]] = deque()  # (order, group), in arrival order
        self.stats = ReplayStats()

    def __len__(self) -> int:
        return len(self._queue)

    def queued(self) -> tuple[G, ...]:
        """The queued groups, oldest first (a checkpoint gives their prompts back to the cursor)."""
        return tuple(group for _, group in self._queue)

    # ------------------------------------------------------------------------------ versions
    def version(self) -> int:
        return self._versions.current()

    def staleness(self, group: GroupLike, version: int | None = None) -> int:
        """``v − min_version``: how many versions the group's oldest token is behind v."""
        return (self.version() if version is None else version) - group.min_version

    def is_stale(self, group: GroupLike, version: int | None = None) -> bool:
        return self.staleness(group, version) > self.max_staleness

    # ----------------------------------------------------------------------------- admission
    def admission_limit(self) -> int:
        """``(η + (v − v0) + 1) · B``: the most in_window + running prompts allowed now."""
        return (self.max_staleness + self.version() - self.start_version + 1) * self.batch_groups

    def capacity_to_admit(self) -> int:
        """How many prompts :meth:`admit` would accept now (≥ 0)."""
        return max(0, self.admission_limit() - self.stats.in_window - self.stats.running)

    def can_admit(self, n: int = 1) -> bool:
        """True iff ``in_window + running + n ≤ (η + (v − v0) + 1) · B``."""
        _check_count(n)
        return n <= self.capacity_to_admit()

    def admit(self, n: int = 1) -> bool:
        """Admit n prompts at once if :meth:`can_admit` allows; all or nothing."""
        if not self.can_admit(n):
            return False
        self.stats.admitted += n
        return True

    def abandon(self, n: int = 1) -> None:
        """Give back the slots of n admitted prompts that will never send a group."""
        _check_count(n)
        if n > self.stats.running:
            raise ValueError(f"cannot abandon {n} prompts: only {self.stats.running} running")
        self.stats.abandoned += n

    # ------------------------------------------------------------------------------- arrival
    def on_group(self, group: G, order: int | None = None) -> str:
        """Classify an arriving group, queue it if accepted, and return the outcome. ``order``: its prompt's
        admission order (batch order ``admission`` hands out by it; default: the arrival order)."""
        if self.stats.running < 1:
            raise ValueError("a group arrived with no admitted prompt running (never admitted?)")
        accuracies = tuple(group.accuracies)
        outcome = self._classify(group)  # may raise: decide before changing any counter
        stats, tokens, correct = self.stats, int(group.num_tokens), sum(map(bool, accuracies))
        stats.received += 1
        stats.received_samples += len(accuracies)
        stats.received_correct += correct
        stats.received_tokens += tokens
        stats._window_tokens += tokens
        stats._window_samples += len(accuracies)
        stats._window_correct += correct
        self._arrivals += 1
        if outcome == ACCEPTED:
            self._enqueue(group, self._arrivals if order is None else order)
        else:
            setattr(stats, outcome, getattr(stats, outcome) + 1)
            stats.wasted_tokens["stale" if outcome == DROPPED_STALE else "filtered"] += tokens
        return outcome

    def _classify(self, group: GroupLike) -> str:
        accuracies = tuple(group.accuracies)
        if not accuracies:
            raise ValueError("a group with no samples")
        # Staleness first: a stale group is unusable whatever its accuracies, and counting it
        # as stale tells the operator η (or the rollout speed) is the problem.
        if self.is_stale(group):
            return DROPPED_STALE
        if not self.dynamic_sampling:
            return ACCEPTED
        return filter_outcome(metric_values(group, self.filter_metric), accuracies)

    def _enqueue(self, group: G, order: int) -> None:
        if len(self._queue) >= self.capacity:
            _, oldest = self._queue.popleft()  # the oldest is the nearest to going stale anyway
            self.stats.dropped_capacity += 1
            self.stats.wasted_tokens["capacity"] += int(oldest.num_tokens)
        self._queue.append((order, group))
        self.stats.accepted += 1
        self.stats.depth = len(self._queue)

    # ------------------------------------------------------------------------------ hand-out
    def take_batch(self, version: int | None = None, oldest_running: int | None = None,
                   force: bool = False) -> list[G] | None:
        """Drop queued groups stale at ``version`` (default: the current version), then return B groups in
        the batch order, or None (removing nothing more) when fewer than B remain.

        Pass the LEARNER's version when it runs ahead of the engines' (a push still in flight): the
        per-sample guarantee is about the weights the batch is trained on. Order ``admission``: also None
        while ``oldest_running`` (the earliest admission order still running) is before the last of the B
        earliest-admitted queued groups, unless ``force`` (the caller's bound on waiting for it ran out)."""
        version = self.version() if version is None else version
        self._drop_stale(version)
        if len(self._queue) < self.batch_groups:
            return None
        if self.batch_order == "arrival":
            picked = [self._queue.popleft() for _ in range(self.batch_groups)]
        else:
            if not force and self.blocked_by_running(version, oldest_running):
                return None
            ranked = sorted(self._queue, key=lambda entry: entry[0])[:self.batch_groups]
            chosen = {id(entry) for entry in ranked}
            self._queue = deque(entry for entry in self._queue if id(entry) not in chosen)
            picked = ranked
        batch = [group for _, group in picked]
        self.stats.depth = len(self._queue)
        self.stats.handed_out += len(batch)
        self._record_batch(batch, [self.staleness(group, version) for group in batch])
        return batch

    def blocked_by_running(self, version: int | None = None, oldest_running: int | None = None) -> bool:
        """Order ``admission``: B fresh groups are queued but an earlier admission is still running (what a
        caller times to bound the wait)."""
        version = self.version() if version is None else version
        fresh = sorted(order for order, group in self._queue if not self.is_stale(group, version))
        return (self.batch_order == "admission" and len(fresh) >= self.batch_groups and oldest_running is not None
                and oldest_running < fresh[self.batch_groups - 1])

    def _drop_stale(self, version: int) -> None:
        fresh = deque(entry for entry in self._queue if not self.is_stale(entry[1], version))
        if len(fresh) < len(self._queue):
            self.stats.dropped_stale_at_handout += len(self._queue) - len(fresh)
            self.stats.wasted_tokens["stale"] += sum(int(g.num_tokens) for _, g in self._queue) - sum(
                int(g.num_tokens) for _, g in fresh)
        self._queue = fresh
        self.stats.depth = len(fresh)

    def _record_batch(self, batch: list[G], values: list[int]) -> None:
        stats = self.stats
        samples = sum(len(tuple(group.accuracies)) for group in batch)
        tokens = sum(int(group.num_tokens) for group in batch)
        correct = sum(sum(map(bool, group.accuracies)) for group in batch)
        stats.handed_out_samples += samples
        stats.handed_out_tokens += tokens
        stats.handed_out_correct += correct
        if stats._window_samples and stats._window_tokens:
            stats.last_batch_length_ratio = (tokens / max(samples, 1)) / (stats._window_tokens / stats._window_samples)
        if stats._window_samples and stats._window_correct:
            stats.last_batch_acc_ratio = (correct / max(samples, 1)) / (stats._window_correct / stats._window_samples)
        stats._window_tokens = stats._window_samples = stats._window_correct = 0
        stats.batches += 1
        stats.last_batch_staleness_mean = sum(values) / len(values)
        stats.last_batch_staleness_max = max(values)
        for value in values:
            stats.staleness_hist[value] = stats.staleness_hist.get(value, 0) + 1


def split_admission(rooms: Sequence[int], capacity: int) -> list[int]:
    """How many of ``capacity`` free admission slots each waiting producer gets, given the ``rooms`` it asked
    for (its own in-flight cap minus what it runs), in the order they asked: the most room first, level by
    level, so that the rooms left end as equal as possible; a tie goes to the earlier ask. The shares sum to
    ``min(capacity, sum(rooms))``.

    Why: producers park on one condition and wake in the order they parked; handing the first one all the
    free room left the other engines idle for that version while one generated the whole window."""
    rooms = [max(0, r) for r in rooms]
    total = min(max(0, capacity), sum(rooms))
    lo, hi = 0, max(rooms, default=0)  # the lowest room level L with sum(max(0, r - L)) <= total
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max(0, r - mid) for r in rooms) <= total:
            hi = mid
        else:
            lo = mid + 1
    shares = [max(0, r - lo) for r in rooms]
    left = total - sum(shares)  # fewer than the asks still at level lo: one more each, earliest first
    for i, r in enumerate(rooms):
        if left == 0:
            break
        if r >= lo > 0:
            shares[i] += 1
            left -= 1
    return shares


def _check_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
