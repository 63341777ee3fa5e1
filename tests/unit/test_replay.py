"""Tests for async_dapo.replay.policy: hand-computed admission numbers, drops by reason, FIFO hand-out,
and a hypothesis state machine checking the staleness guarantee and the admission bound under
random interleavings (the arithmetic is in the comments)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from async_dapo.replay.policy import (
    ACCEPTED,
    DROPPED_ALL_CORRECT,
    DROPPED_ALL_WRONG,
    DROPPED_STALE,
    DROPPED_UNIFORM,
    FILTER_METRICS,
    FREES_ADMISSION,
    OUTCOMES,
    ReplayPolicy,
    split_admission,
    keeps_group,
    metric_values,
)


class FakeVersionSource:
    """A settable version source (``replay.VersionSource``), so the policy is testable without a learner."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def current(self) -> int:
        return self.version

    def advance(self, steps: int = 1) -> int:
        self.version += steps
        return self.version


MIXED = (True, False)
ALL_CORRECT = (True, True)
ALL_WRONG = (False, False)
_ids = itertools.count()


@dataclass(frozen=True)
class Grp:
    group_id: str
    min_version: int
    accuracies: tuple[bool, ...] = MIXED
    scores: tuple[float, ...] = ()  # reward-function scores (metric score)
    rewards: tuple[float, ...] = ()  # score + overlong penalty (metrics seq_reward, seq_final_reward)
    num_tokens: int = 0  # response tokens over the samples


def grp(min_version: int = 0, accuracies: tuple[bool, ...] = MIXED, scores=None, rewards=None,
        tokens: int | None = None) -> Grp:
    """Scores default to the built-in reward's +1/-1, rewards to the scores (no overlong penalty); every
    sample 10 response tokens unless ``tokens`` (the group's total) says otherwise."""
    scores = tuple(1.0 if a else -1.0 for a in accuracies) if scores is None else tuple(scores)
    return Grp(f"g{next(_ids)}", min_version, accuracies, scores, scores if rewards is None else tuple(rewards),
               10 * len(accuracies) if tokens is None else tokens)


def make(
    *, b: int, eta: int, capacity: int | None = None, ds: bool = True, start: int = 0, metric: str = "acc",
    order: str = "arrival",
) -> tuple[ReplayPolicy[Grp], FakeVersionSource]:
    versions = FakeVersionSource(start)
    policy: ReplayPolicy[Grp] = ReplayPolicy(
        batch_groups=b,
        max_staleness=eta,
        capacity=(eta + 1) * b if capacity is None else capacity,
        dynamic_sampling=ds,
        versions=versions,
        filter_metric=metric,
        batch_order=order,
    )
    return policy, versions


def arrive(policy: ReplayPolicy[Grp], *groups: Grp) -> list[str]:
    return [policy.on_group(g) for g in groups]


# --------------------------------------------------------------------------------- admission


def test_admission_hand_computed():
    policy, versions = make(b=4, eta=1)
    # (η + v + 1)·B = (1 + 0 + 1)·4 = 8 prompts admissible at v = 0.
    assert policy.admission_limit() == 8
    assert policy.capacity_to_admit() == 8
    assert policy.can_admit(8) and not policy.can_admit(9)
    assert policy.admit(8)
    assert policy.capacity_to_admit() == 0 and not policy.can_admit()
    assert not policy.admit()  # refused: nothing recorded
    assert policy.stats.admitted == 8 and policy.stats.running == 8
    # 3 accepted: accepted + running = 3 + 5 = 8 -> still no slot.
    assert arrive(policy, grp(), grp(), grp()) == [ACCEPTED] * 3
    assert policy.capacity_to_admit() == 0
    # A dynamic-sampling drop: 3 + 4 = 7 < 8 -> one slot.
    assert arrive(policy, grp(accuracies=ALL_CORRECT)) == [DROPPED_ALL_CORRECT]
    assert policy.capacity_to_admit() == 1
    # v = 1: limit (1 + 1 + 1)·4 = 12, 12 − 7 = 5 -> four more slots.
    versions.advance()
    assert policy.admission_limit() == 12
    assert policy.capacity_to_admit() == 5
    assert policy.admit(5) and not policy.can_admit()


@pytest.mark.parametrize("rooms, capacity, shares", [
    ([16, 16], 16, [8, 8]),  # two idle engines: half each, not 16 to the first
    ([10, 4], 10, [8, 2]),  # rooms left 2 and 2
    ([4, 9], 6, [1, 5]),  # rooms left 3.5 and 3.5: the tie (one prompt) to the earlier ask
    ([3, 3, 3], 7, [3, 2, 2]),  # 7 = 2 + 2 + 2 + 1: the extra one to the earliest
    ([16, 2], 1, [1, 0]),  # one slot: the most room
    ([16, 2], 20, [16, 2]),  # more room than asked: everyone gets what it asked
    ([5], 0, [0]),
    ([], 5, []),
])
def test_split_admission_evens_the_rooms_left_hand_computed(rooms, capacity, shares):
    assert split_admission(rooms, capacity) == shares


def test_admit_is_all_or_nothing_and_checks_n():
    policy, _ = make(b=2, eta=0)
    assert not policy.admit(3)  # limit 2
    assert policy.stats.admitted == 0
    with pytest.raises(ValueError):
        policy.can_admit(0)


def test_eta_zero_is_synchronous():
    b = 2
    policy, versions = make(b=b, eta=0)
    for v in range(3):
        # Exactly one batch worth of prompts per version...
        assert policy.capacity_to_admit() == b
        assert policy.admit(b) and not policy.can_admit()
        assert arrive(policy, grp(v), grp(v)) == [ACCEPTED, ACCEPTED]
        batch = policy.take_batch()
        assert batch is not None and len(batch) == b
        # ...and none while the learner trains on it (handed_out counts against the window).
        assert policy.capacity_to_admit() == 0
        versions.advance()
    # A group generated at v = 2 arriving at v = 3 is stale when η = 0.
    policy.admit()
    assert arrive(policy, grp(2)) == [DROPPED_STALE]


def test_resume_counts_versions_from_start():
    # A resumed run at v = 5 with fresh counters admits (η + 1)·B, not (η + 5 + 1)·B (AReaL #1345).
    versions = FakeVersionSource(5)
    policy = ReplayPolicy(
        batch_groups=4, max_staleness=1, capacity=8, dynamic_sampling=True, versions=versions
    )
    assert policy.capacity_to_admit() == 8
    explicit = ReplayPolicy(
        batch_groups=4,
        max_staleness=1,
        capacity=8,
        dynamic_sampling=True,
        versions=FakeVersionSource(0),
        start_version=5,
    )
    assert explicit.admission_limit() == (1 + (0 - 5) + 1) * 4 == -12
    assert explicit.capacity_to_admit() == 0


def test_abandon_frees_slots():
    policy, _ = make(b=2, eta=0)
    policy.admit(2)
    policy.abandon()
    assert policy.stats.running == 1 and policy.capacity_to_admit() == 1
    with pytest.raises(ValueError):
        policy.abandon(2)


# ------------------------------------------------------------------------------ construction


def test_capacity_below_window_rejected():
    with pytest.raises(ValueError, match=r"\(1 \+ 1\) \* 4 = 8"):
        make(b=4, eta=1, capacity=7)
    make(b=4, eta=1, capacity=8)  # exactly (η + 1)·B is enough


@pytest.mark.parametrize("kwargs", [{"b": 0, "eta": 0, "capacity": 1}, {"b": 1, "eta": -1, "capacity": 1}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        make(**kwargs)


# ---------------------------------------------------------------------------------- arrival


def test_dynamic_sampling_drops_counted_by_reason():
    policy, _ = make(b=2, eta=0, capacity=4)
    policy.admit(2)
    assert arrive(policy, grp(accuracies=ALL_CORRECT), grp(accuracies=(False,) * 3)) == [
        DROPPED_ALL_CORRECT,
        DROPPED_ALL_WRONG,
    ]
    policy.admit(2)
    assert arrive(policy, grp(accuracies=(True,)), grp(accuracies=(True, False, True))) == [
        DROPPED_ALL_CORRECT,  # a group of one is never kept by dynamic sampling
        ACCEPTED,
    ]
    s = policy.stats
    assert (s.dropped_all_correct, s.dropped_all_wrong, s.accepted, s.received) == (2, 1, 1, 4)
    assert {DROPPED_ALL_CORRECT, DROPPED_ALL_WRONG} <= FREES_ADMISSION
    # Every received sample counts, kept or dropped: 2 + 3 + 1 + 3 samples, 2 + 0 + 1 + 2 of them correct.
    assert (s.received_samples, s.received_correct) == (9, 5)


def test_wasted_tokens_by_reason_and_the_trained_length_and_accuracy_ratios_hand_computed():
    policy, versions = make(b=2, eta=0, capacity=4)
    policy.admit(2)
    # filtered: an all-correct group of 30 tokens; kept: 20 and 60 tokens (2 samples each)
    arrive(policy, grp(accuracies=ALL_CORRECT, tokens=30), grp(tokens=20))
    policy.admit()
    arrive(policy, grp(tokens=60))
    batch = policy.take_batch()
    s = policy.stats
    assert [g.num_tokens for g in batch] == [20, 60] and s.wasted_tokens == {"filtered": 30, "stale": 0, "capacity": 0}
    # batch: 80 tokens over 4 samples = 20 per sample; arrivals since the last batch: 110 over 6 samples
    assert s.last_batch_length_ratio == pytest.approx(20 / (110 / 6), rel=1e-12)  # 12/11
    assert (s.received_tokens, s.handed_out_tokens, s.handed_out_samples) == (110, 80, 4)
    # accuracy: the batch 2 correct of 4 samples; the window 2 + 1 + 1 = 4 correct of 6
    assert s.last_batch_acc_ratio == pytest.approx((2 / 4) / (4 / 6), rel=1e-12)  # 3/4
    assert (s.handed_out_correct, s.received_correct) == (2, 4)
    versions.advance()
    policy.admit(2)
    arrive(policy, grp(1, accuracies=(True, False, False, False), tokens=8), grp(1, tokens=4))  # a new window
    policy.take_batch()
    assert s.last_batch_acc_ratio == pytest.approx((2 / 6) / (2 / 6), rel=1e-12)  # the window restarted
    assert s.last_batch_length_ratio == pytest.approx((12 / 6) / (12 / 6), rel=1e-12)
    versions.advance()
    policy.admit(2)
    arrive(policy, grp(0, tokens=40))  # v = 2, η = 0: stale on arrival
    assert s.wasted_tokens["stale"] == 40
    assert policy.stats.snapshot()["wasted_tokens/stale"] == 40


def test_admission_order_waits_for_an_earlier_admission_unless_forced():
    policy, _ = make(b=2, eta=1, order="admission")
    policy.admit(4)
    # admitted as orders 0, 1, 2, 3; order 2 and 3 arrive first (short), then 1; order 0 still generating
    short2, short3, long1 = grp(tokens=4), grp(tokens=5), grp(tokens=90)
    policy.on_group(short2, order=2)
    policy.on_group(short3, order=3)
    assert policy.blocked_by_running(oldest_running=0)
    assert policy.take_batch(oldest_running=0) is None and len(policy) == 2
    policy.on_group(long1, order=1)
    assert policy.take_batch(oldest_running=0) is None  # 1 and 2 are the earliest queued; 0 is before them
    assert policy.take_batch(oldest_running=0, force=True) == [long1, short2]  # the wait bound ran out
    assert policy.queued() == (short3,) and policy.stats.handed_out_tokens == 94


def test_admission_order_hands_out_the_earliest_admitted_once_nothing_earlier_runs():
    policy, _ = make(b=2, eta=1, order="admission")
    policy.admit(3)
    late, early, middle = grp(tokens=1), grp(tokens=2), grp(tokens=3)
    policy.on_group(late, order=7)
    policy.on_group(early, order=5)
    policy.on_group(middle, order=6)
    assert not policy.blocked_by_running(oldest_running=None)
    assert policy.take_batch(oldest_running=None) == [early, middle] and policy.queued() == (late,)
    # arrival order (the default) takes the first two that arrived
    arrival, _ = make(b=2, eta=1)
    arrival.admit(3)
    for g, order in ((late, 7), (early, 5), (middle, 6)):
        arrival.on_group(g, order=order)
    assert arrival.take_batch() == [late, early] and not arrival.blocked_by_running(oldest_running=0)


def test_dynamic_sampling_off_accepts_all_fresh_groups():
    policy, versions = make(b=3, eta=0, ds=False)
    policy.admit(3)
    assert arrive(policy, grp(accuracies=ALL_CORRECT), grp(accuracies=ALL_WRONG), grp()) == [ACCEPTED] * 3
    policy.take_batch()
    versions.advance()
    policy.admit()
    assert arrive(policy, grp(0, ALL_CORRECT)) == [DROPPED_STALE]  # staleness still applies


def test_stale_on_arrival_boundary():
    policy, versions = make(b=2, eta=1, start=3)
    policy.admit(2)
    # v = 3, η = 1: min_version 2 is 1 behind (kept), min_version 1 is 2 behind (dropped).
    assert arrive(policy, grp(2), grp(1)) == [ACCEPTED, DROPPED_STALE]
    assert policy.stats.dropped_stale == 1
    # limit (1 + 0 + 1)·2 = 4 (versions count from v0 = 3); in_window 1, running 0 -> 3: the
    # stale group gave its slot back.
    assert policy.capacity_to_admit() == 3
    # Stale is checked before dynamic sampling.
    policy.admit()
    assert arrive(policy, grp(0, ALL_CORRECT)) == [DROPPED_STALE]


def test_arrival_errors_change_nothing():
    policy, _ = make(b=1, eta=0)
    with pytest.raises(ValueError, match="no admitted prompt"):
        policy.on_group(grp())
    policy.admit()
    with pytest.raises(ValueError):
        policy.on_group(grp(accuracies=()))
    with pytest.raises(ValueError):  # a shaped reward is not an accuracy (replay.metric_values)
        policy.on_group(Grp("r", 0, (1.0, -1.0)))  # type: ignore[arg-type]
    assert policy.stats.received == 0 and policy.stats.running == 1


# ------------------------------------------------------------------- dynamic-sampling metrics
# verl's algorithm.filter_groups.metric: keep a group iff its per-sample values are not all equal.
# Per sample: acc -> acc, score -> score, seq_reward / seq_final_reward -> reward (score + overlong
# penalty; no KL term in the reward here). Overlong penalty with L_max 20, L_cache 4, factor 1:
# length 17 -> (16 - 17) / 4 = -0.25, length 20 -> -1.
METRIC_CASES = [
    # (accuracies, scores, rewards, {metric: outcome})
    # All correct, one sample 17 tokens long: rewards 1.0 and 1 - 0.25 = 0.75 differ.
    ((True, True), (1.0, 1.0), (1.0, 0.75),
     {"acc": DROPPED_ALL_CORRECT, "score": DROPPED_ALL_CORRECT, "seq_reward": ACCEPTED, "seq_final_reward": ACCEPTED}),
    # All wrong, one at L_max: rewards -1 and -1 - 1 = -2.
    ((False, False), (-1.0, -1.0), (-1.0, -2.0),
     {"acc": DROPPED_ALL_WRONG, "score": DROPPED_ALL_WRONG, "seq_reward": ACCEPTED, "seq_final_reward": ACCEPTED}),
    # Mixed, but the right answer is at L_max with penalty factor 2: 1 - 2 = -1 = the wrong one's -1 + 0.
    ((True, False), (1.0, -1.0), (-1.0, -1.0),
     {"acc": ACCEPTED, "score": ACCEPTED, "seq_reward": DROPPED_UNIFORM, "seq_final_reward": DROPPED_UNIFORM}),
    # A user's graded score: all "correct" (score > 0) but 0.5 vs 0.9.
    ((True, True), (0.5, 0.9), (0.5, 0.9),
     {"acc": DROPPED_ALL_CORRECT, "score": ACCEPTED, "seq_reward": ACCEPTED, "seq_final_reward": ACCEPTED}),
    # A user's dict with the same score and different acc flags.
    ((True, False), (0.0, 0.0), (0.0, 0.0),
     {"acc": ACCEPTED, "score": DROPPED_UNIFORM, "seq_reward": DROPPED_UNIFORM, "seq_final_reward": DROPPED_UNIFORM}),
    # Plain mixed and plain uniform groups: every metric agrees.
    ((True, False, True), (1.0, -1.0, 1.0), (1.0, -1.0, 0.75), dict.fromkeys(FILTER_METRICS, ACCEPTED)),
    ((True,) * 3, (1.0,) * 3, (1.0,) * 3, dict.fromkeys(FILTER_METRICS, DROPPED_ALL_CORRECT)),
    # A group of one is never kept (verl keeps it), whatever the metric.
    ((True,), (1.0,), (0.75,), dict.fromkeys(FILTER_METRICS, DROPPED_ALL_CORRECT)),
    ((False,), (-1.0,), (-1.5,), dict.fromkeys(FILTER_METRICS, DROPPED_ALL_WRONG)),
]


@pytest.mark.parametrize("metric", FILTER_METRICS)
@pytest.mark.parametrize(("accuracies", "scores", "rewards", "expected"), METRIC_CASES)
def test_dynamic_sampling_metric_keeps_and_drops(metric, accuracies, scores, rewards, expected):
    policy, _ = make(b=1, eta=0, capacity=2, metric=metric)
    policy.admit()
    assert arrive(policy, grp(0, accuracies, scores, rewards)) == [expected[metric]]
    s = policy.stats
    dropped = s.dropped_all_correct + s.dropped_all_wrong + s.dropped_uniform + s.dropped_stale
    assert s.received == s.accepted + dropped == 1
    assert policy.capacity_to_admit() == (0 if expected[metric] == ACCEPTED else 1)  # a drop frees its slot


def test_metric_counters_hand_computed():
    policy, _ = make(b=2, eta=0, capacity=4, metric="seq_reward")
    policy.admit(2)
    assert arrive(policy, grp(0, (True, True), rewards=(1.0, 0.75)), grp(0, (True, False), rewards=(-1.0, -1.0))) == [
        ACCEPTED, DROPPED_UNIFORM]
    policy.admit()
    assert arrive(policy, grp(0, (False, False), rewards=(-1.0, -1.0))) == [DROPPED_ALL_WRONG]
    s = policy.stats
    assert (s.accepted, s.dropped_uniform, s.dropped_all_wrong, s.dropped_all_correct, s.received) == (1, 1, 1, 0, 3)
    assert DROPPED_UNIFORM in OUTCOMES and DROPPED_UNIFORM in FREES_ADMISSION
    assert s.snapshot()["dropped_uniform"] == 1
    # limit (0 + 0 + 1)·2 = 2; in_window 1, running 0 -> 1 slot (both drops gave theirs back).
    assert policy.capacity_to_admit() == 1


def test_metric_values_read_the_right_field():
    g = grp(0, (True, False), scores=(1.0, -1.0), rewards=(0.75, -1.0))
    assert metric_values(g, "acc") == (1.0, 0.0)
    assert metric_values(g, "score") == (1.0, -1.0)
    assert metric_values(g, "seq_reward") == metric_values(g, "seq_final_reward") == (0.75, -1.0)
    with pytest.raises(ValueError, match="metric"):
        metric_values(g, "reward")


def test_keeps_group_is_exact_inequality():
    assert keeps_group((1.0, 0.75)) and keeps_group((0.0, 0.0, 1e-12))
    assert not keeps_group((0.1, 0.1, 0.1))  # numpy's std here is ~1.4e-17 > 0: verl would keep it
    assert not keeps_group((0.5,)) and not keeps_group(())


# The acc rule as the queue applies it, keeps_group(metric_values(group, "acc")): kept iff
# 0 < #correct < group size. The queue sees wire.Group.accuracies, a tuple of bools; the two cases
# that were torch tensors (the removed loss.keep_group took them) are given as that tuple.
@pytest.mark.parametrize(
    ("accuracies", "kept"),
    [
        ((True, False), True),
        ((1, 0, 0, 0), True),
        ((1.0, 1.0, 0.0), True),
        ((True, False, True), True),  # was torch.tensor([True, False, True])
        ((True, True, True), False),  # all correct: zero advantage, no gradient
        ((False, False), False),  # all wrong
        ((0, 0), False),  # was torch.tensor([0, 0])
        ((True,), False),  # a group of one is never mixed
        ((), False),
    ],
)
def test_acc_rule_keeps_only_mixed_groups(accuracies, kept: bool) -> None:
    assert keeps_group(metric_values(Grp("a", 0, accuracies), "acc")) is kept
    assert keeps_group(accuracies) is kept


@pytest.mark.parametrize("bad", [(1.0, -1.0), (0.5, 0.0), (1.0, 0.75)])
def test_acc_metric_refuses_shaped_rewards(bad: tuple[float, ...]) -> None:
    # +1/-1 scores or overlong-shaped rewards are not accuracies.
    with pytest.raises(ValueError, match="accuracies"):
        metric_values(Grp("r", 0, bad), "acc")  # type: ignore[arg-type]


def test_wire_group_exposes_the_metric_values():
    import numpy as np

    from async_dapo.stream.wire import Group, Sample

    def sample(reward: float, score: float, acc: bool) -> Sample:
        return Sample(response_ids=np.array([5, 6], np.int32), logprobs=np.array([-0.1, -0.2], np.float32),
                      versions=np.array([0, 0], np.int32), reward=reward, score=score, acc=acc, truncated=False,
                      finish_reason="stop", gen_seconds=0.1)

    g = Group(group_id="w", prompt_index=0, epoch=0, engine_rank=0, prompt_ids=np.array([1], np.int32),
              ground_truth="1", data_source="d", samples=(sample(1.0, 1.0, True), sample(0.75, 1.0, True)),
              created_at=1.0, admitted_version=0)
    assert (g.accuracies, g.scores, g.rewards) == ((True, True), (1.0, 1.0), (1.0, 0.75))
    for metric, outcome in [("acc", DROPPED_ALL_CORRECT), ("seq_reward", ACCEPTED)]:
        versions = FakeVersionSource()
        policy = ReplayPolicy(batch_groups=1, max_staleness=0, capacity=1, dynamic_sampling=True,
                              versions=versions, filter_metric=metric)
        policy.admit()
        assert policy.on_group(g) == outcome


def test_bad_metric_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="filter_metric"):
        make(b=1, eta=0, metric="seq_kl")
    policy, _ = make(b=1, eta=0, metric="seq_reward")
    policy.admit()
    with pytest.raises(ValueError, match="finite"):
        policy.on_group(grp(0, MIXED, rewards=(1.0, float("nan"))))
    assert policy.stats.received == 0 and policy.stats.running == 1


def test_replay_policy_needs_no_torch():
    import ast
    import inspect

    from async_dapo.replay import policy as replay

    imported: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(replay))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not {name for name in imported if name.split(".")[0] in ("torch", "numpy", "async_dapo")}


# --------------------------------------------------------------------------------- hand-out


def test_fifo_exactly_b_and_none_when_short():
    policy, _ = make(b=3, eta=2)
    policy.admit(7)
    groups = [grp() for _ in range(7)]
    arrive(policy, *groups)
    assert policy.take_batch() == groups[0:3]
    assert policy.take_batch() == groups[3:6]
    assert policy.take_batch() is None  # 1 < 3 left, and it stays queued
    assert len(policy) == policy.stats.depth == 1
    assert policy.stats.handed_out == 6 and policy.stats.batches == 2


def test_stale_at_handout_dropped_and_counted():
    # B = 1, η = 1. x1 is admitted at v = 0 but arrives late, behind x2, with tokens from v = 0.
    policy, versions = make(b=1, eta=1)
    assert policy.admit(2)  # limit (1 + 0 + 1)·1 = 2
    x0, x1 = grp(0), grp(0)
    arrive(policy, x0)
    assert policy.take_batch() == [x0]
    versions.advance()  # v = 1: limit 3, in_window 1 + running 1 -> one slot
    assert policy.capacity_to_admit() == 1 and policy.admit()
    x2 = grp(1)
    assert arrive(policy, x2, x1) == [ACCEPTED, ACCEPTED]  # x1: 1 − 0 = 1 ≤ η
    assert policy.take_batch() == [x2]
    versions.advance()  # v = 2: x1 is now 2 behind
    assert policy.take_batch() is None
    s = policy.stats
    assert s.dropped_stale_at_handout == 1 and s.depth == 0
    # limit (1 + 2 + 1)·1 = 4; in_window = 3 accepted − 1 dropped = 2 (x0, x2); running 0.
    assert s.in_window == 2 and policy.capacity_to_admit() == 2


def test_staleness_stats_of_handed_out_groups():
    policy, versions = make(b=2, eta=2, start=2)
    policy.admit(4)
    arrive(policy, grp(1), grp(2), grp(0), grp(0))
    policy.take_batch()  # staleness 1, 0
    s = policy.stats
    assert (s.last_batch_staleness_mean, s.last_batch_staleness_max) == (0.5, 1)
    policy.take_batch()  # staleness 2, 2
    assert (s.last_batch_staleness_mean, s.last_batch_staleness_max) == (2.0, 2)
    assert s.staleness_hist == {0: 1, 1: 1, 2: 2}
    snap = s.snapshot()
    assert snap["staleness_hist/2"] == 2 and snap["handed_out"] == 4 and snap["running"] == 0
    assert snap["depth"] == 0 and snap["in_window"] == 4
    assert all(isinstance(value, (int, float)) for value in snap.values())


def test_capacity_overflow_drops_oldest():
    # A version source moved without the learner taking batches can overfill the queue.
    policy, versions = make(b=2, eta=0, capacity=2, ds=False)
    policy.admit(2)
    a, b = grp(0), grp(0)
    arrive(policy, a, b)
    versions.advance()
    policy.admit(2)
    c, d = grp(1), grp(1)
    arrive(policy, c)
    assert policy.stats.dropped_capacity == 1 and len(policy) == 2
    arrive(policy, d)
    assert policy.stats.dropped_capacity == 2
    assert policy.take_batch() == [c, d]


# ------------------------------------------------------------------------------ property tests


@dataclass(frozen=True)
class SimGroup:
    group_id: int
    min_version: int
    max_version: int
    accuracies: tuple[bool, ...]
    scores: tuple[float, ...]
    rewards: tuple[float, ...]
    num_tokens: int = 0


class Sim:
    """Producers admit prompts and deliver groups in any order, with token versions anywhere
    between the admission version and now (in-flight weight updates); the learner takes a batch,
    trains, then advances the version. A plain-list reference queue checks every decision."""

    def __init__(self, b: int, eta: int, extra: int, ds: bool, metric: str = "acc") -> None:
        self.b, self.eta, self.ds, self.metric = b, eta, ds, metric
        self.versions = FakeVersionSource()
        self.policy: ReplayPolicy[SimGroup] = ReplayPolicy(
            batch_groups=b,
            max_staleness=eta,
            capacity=(eta + 1) * b + extra,
            dynamic_sampling=ds,
            versions=self.versions,
            filter_metric=metric,
        )
        self.in_flight: list[int] = []  # admission version of each running prompt
        self.model_queue: list[SimGroup] = []
        self.training = False  # the learner holds a batch and has not advanced yet
        self.next_id = 0

    @property
    def v(self) -> int:
        return self.versions.current()

    def admit(self, n: int) -> None:
        allowed = self.policy.capacity_to_admit() >= n
        assert self.policy.can_admit(n) == allowed
        assert self.policy.admit(n) == allowed
        if allowed:
            self.in_flight += [self.v] * n

    def arrive(self, data: st.DataObject) -> None:
        # Newest-first arrivals and oldest-possible tokens are weighted up: they are the
        # overtaking, late groups that exercise the stale drops.
        last = len(self.in_flight) - 1
        admitted_at = self.in_flight.pop(data.draw(st.just(last) | st.integers(0, last)))
        lo = data.draw(st.just(admitted_at) | st.integers(admitted_at, self.v))
        hi = data.draw(st.integers(lo, self.v))
        # Half mixed groups, so that batches fill and versions advance despite dynamic sampling.
        accuracies = tuple(data.draw(st.just(MIXED) | st.lists(st.booleans(), min_size=1, max_size=4)))
        scores = tuple(1.0 if a else -1.0 for a in accuracies)
        # Overlong penalties: none, a quarter, or 2 (factor 2 at L_max: a right answer's 1 - 2 = a wrong one's -1).
        penalties = data.draw(st.lists(st.sampled_from([0.0, -0.25, -2.0]), min_size=len(scores),
                                       max_size=len(scores)))
        rewards = tuple(s + p for s, p in zip(scores, penalties))
        group = SimGroup(self.next_id, lo, hi, accuracies, scores, rewards)
        self.next_id += 1
        values = {"acc": accuracies, "score": scores, "seq_reward": rewards, "seq_final_reward": rewards}[self.metric]
        if self.v - lo > self.eta:
            expected = DROPPED_STALE
        elif self.ds and len(set(values)) < 2 and all(accuracies):
            expected = DROPPED_ALL_CORRECT
        elif self.ds and len(set(values)) < 2 and not any(accuracies):
            expected = DROPPED_ALL_WRONG
        elif self.ds and len(set(values)) < 2:
            expected = DROPPED_UNIFORM
        else:
            expected = ACCEPTED
            self.model_queue.append(group)
        assert self.policy.on_group(group) == expected

    def learner_take(self) -> None:
        self.model_queue = [g for g in self.model_queue if self.v - g.min_version <= self.eta]
        batch = self.policy.take_batch()
        if len(self.model_queue) < self.b:
            assert batch is None
            return
        assert batch == self.model_queue[: self.b]  # exactly B, oldest arrival first
        del self.model_queue[: self.b]
        for group in batch:  # (1) the per-sample guarantee
            assert 0 <= self.v - group.min_version <= self.eta
        self.training = True

    def learner_advance(self) -> None:
        self.versions.advance()
        self.training = False

    def check(self) -> None:
        s = self.policy.stats
        # (2) the admission bound.
        assert s.in_window + s.running <= (self.eta + self.v + 1) * self.b
        # (3) counters.
        dropped = s.dropped_all_correct + s.dropped_all_wrong + s.dropped_uniform + s.dropped_stale
        assert s.received == s.accepted + dropped
        if self.metric in ("acc", "score"):  # +1/-1 scores follow the accuracies: nothing else is uniform
            assert s.dropped_uniform == 0
        assert s.depth == len(self.policy) == len(self.model_queue)
        assert s.depth == s.accepted - s.handed_out - s.dropped_stale_at_handout - s.dropped_capacity
        assert s.running == len(self.in_flight) >= 0
        assert s.handed_out == (self.v + self.training) * self.b
        # The version advances only after a take, so depth ≤ (η + 1)·B ≤ capacity: no overflow.
        assert s.depth <= (self.eta + 1) * self.b and s.dropped_capacity == 0
        # No deadlock: nothing in flight, learner waiting, < B usable groups -> producers may admit.
        if not self.in_flight and not self.training:
            fresh = [g for g in self.model_queue if self.v - g.min_version <= self.eta]
            if len(fresh) < self.b:
                assert self.policy.can_admit()

    def step(self, data: st.DataObject) -> None:
        """One random enabled action (used by the long-sequence test)."""
        actions = ["admit", "learner_advance" if self.training else "learner_take"]
        if self.in_flight:
            actions.append("arrive")
        action = data.draw(st.sampled_from(actions))
        if action == "admit":
            self.admit(data.draw(st.integers(1, 3)))
        elif action == "arrive":
            self.arrive(data)
        else:
            getattr(self, action)()
        self.check()


SIM_PARAMS = {
    "b": st.integers(1, 4),
    "eta": st.integers(0, 2),
    "extra": st.integers(0, 3),
    "ds": st.booleans(),
    "metric": st.sampled_from(FILTER_METRICS),
}


class ReplayMachine(RuleBasedStateMachine):
    """The same simulation as a hypothesis state machine (short runs, good shrinking)."""

    @initialize(**SIM_PARAMS)
    def setup(self, b: int, eta: int, extra: int, ds: bool, metric: str) -> None:
        self.sim = Sim(b, eta, extra, ds, metric)

    @rule(n=st.integers(1, 3))
    def admit(self, n: int) -> None:
        self.sim.admit(n)

    @precondition(lambda self: self.sim.in_flight)
    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        self.sim.arrive(data)

    @precondition(lambda self: not self.sim.training)
    @rule()
    def learner_take(self) -> None:
        self.sim.learner_take()

    @precondition(lambda self: self.sim.training)
    @rule()
    def learner_advance(self) -> None:
        self.sim.learner_advance()

    @invariant()
    def invariants_hold(self) -> None:
        self.sim.check()


TestReplayMachine = ReplayMachine.TestCase
TestReplayMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), steps=st.integers(100, 300), **SIM_PARAMS)
def test_long_random_interleavings(
    data: st.DataObject, steps: int, b: int, eta: int, extra: int, ds: bool, metric: str
) -> None:
    # Long runs reach many versions, where late groups go stale on arrival and at hand-out.
    sim = Sim(b, eta, extra, ds, metric)
    for _ in range(steps):
        sim.step(data)


def test_take_batch_judges_staleness_at_the_learner_version():
    # Engines still at version 2 (push in flight), learner already at 3, eta = 1: a group whose
    # oldest token is version 1 is fresh for the engines (2 - 1 = 1) but stale for the learner (3 - 1 = 2).
    policy, versions = make(b=1, eta=1, capacity=4, ds=False)
    versions.version = 2
    assert policy.admit(2)
    old, new = grp(1), grp(2)
    assert arrive(policy, old, new) == ["accepted", "accepted"]
    batch = policy.take_batch(version=3)
    assert batch == [new]
    assert policy.stats.dropped_stale_at_handout == 1
