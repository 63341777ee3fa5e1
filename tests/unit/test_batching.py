"""Tests for async_dapo.learner.batching: hand-computed advantages and alignment, packing/split properties,
and the global-denominator contract (summed micro-batch losses == one full-batch loss).

Tiny tensors only; hypothesis runs ~50 examples per property (2-core CI).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_dapo.learner.batching import (
    MicroBatch,
    TrainSample,
    collate,
    mini_batches,
    pack_micro_batches,
    padding_micro_batch,
    plan_step,
    samples_from_groups,
    split_for_ranks,
    valid_seq_count,
    valid_token_count,
)
from async_dapo.learner.loss import policy_loss
from async_dapo.stream.wire import Group, Sample

PAD = 0
FEW = settings(max_examples=50, deadline=None)


def make_sample(response, *, reward=1.0, truncated=False, logprobs=None, versions=None) -> Sample:
    n = len(response)
    return Sample(
        response_ids=np.asarray(response, dtype=np.int32),
        logprobs=np.asarray(
            logprobs if logprobs is not None else [-0.1 * (k + 1) for k in range(n)], np.float32
        ),
        versions=np.asarray(versions if versions is not None else [3] * n, np.int32),
        reward=reward,
        score=reward,
        acc=reward > 0,
        truncated=truncated,
        finish_reason="length" if truncated else "stop",
        gen_seconds=0.0,
    )


def make_group(prompt, samples, index=0) -> Group:
    return Group(
        group_id=f"g{index}",
        prompt_index=index,
        epoch=0,
        engine_rank=0,
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        ground_truth="1",
        data_source="test",
        samples=tuple(samples),
        created_at=0.0,
        admitted_version=0,
    )


def train_sample(length: int, *, prompt_len: int = 1, group: int = 0, truncated=False) -> TrainSample:
    response_len = length - prompt_len
    return TrainSample(
        input_ids=torch.arange(1, length + 1, dtype=torch.int64),
        prompt_len=prompt_len,
        response_len=response_len,
        advantage=1.0,
        behav_logprobs=torch.full((response_len,), -0.5),
        versions=torch.zeros(response_len, dtype=torch.int64),
        truncated=truncated,
        group=group,
        reward=1.0,
        acc=True,
    )


def random_groups(rng: np.random.Generator, num_groups: int, group_size: int) -> list[Group]:
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(1, 50, size=int(rng.integers(1, 6)))
        samples = []
        for _ in range(group_size):
            n = int(rng.integers(0, 9))
            samples.append(
                make_sample(
                    rng.integers(1, 50, size=n),
                    reward=float(rng.choice([-1.0, 1.0, -0.5])),
                    truncated=bool(rng.random() < 0.3),
                    logprobs=-rng.random(n).astype(np.float32),
                    versions=rng.integers(0, 4, size=n),
                )
            )
        groups.append(make_group(prompt, samples, g))
    return groups


lengths_st = st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=30)


# ------------------------------------------------------------------------------------ samples
def test_advantages_hand_computed():
    groups = [
        make_group([5, 6], [make_sample([7], reward=r) for r in (1, -1, -1, 1)], 0),
        make_group([5, 6], [make_sample([7], reward=1) for _ in range(4)], 1),
    ]
    samples = samples_from_groups(groups)
    # Group 0: mean 0, unbiased std sqrt(4/3) = 1.1547 -> +-1/1.1547 = +-0.8660 (eps 1e-6).
    expected = [math.sqrt(3) / 2 * sign for sign in (1, -1, -1, 1)] + [0.0] * 4
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-5)
    assert [s.group for s in samples] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Without std scaling the advantage is reward - mean.
    unscaled = samples_from_groups(groups, scale_by_std=False)
    assert [s.advantage for s in unscaled] == pytest.approx([1, -1, -1, 1, 0, 0, 0, 0])


def test_sample_tensors_and_empty_response():
    group = make_group(
        [10, 11], [make_sample([20, 21, 22], versions=[1, 2, 2]), make_sample([], reward=-1)]
    )
    full, empty = samples_from_groups([group])
    assert full.input_ids.tolist() == [10, 11, 20, 21, 22] and full.input_ids.dtype == torch.int64
    assert (full.prompt_len, full.response_len, full.length) == (2, 3, 5)
    assert full.behav_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert full.versions.tolist() == [1, 2, 2] and full.versions.dtype == torch.int64
    # The empty response still shifts its group's mean (rewards 1, -1 -> +-0.7071) ...
    assert (full.advantage, empty.advantage) == pytest.approx((1 / math.sqrt(2), -1 / math.sqrt(2)), abs=1e-5)
    # ... but has no token to train on.
    assert empty.length == 2
    assert valid_token_count([full, empty], overlong_filtering=False) == 3
    assert valid_seq_count([full, empty], overlong_filtering=False) == 1
    batch = collate([full, empty], pad_id=PAD, overlong_filtering=False)
    assert batch.loss_mask[1].sum() == 0 and batch.num_tokens == 3 and batch.num_seqs == 1


# ------------------------------------------------------------------------------------ collate
def test_collate_alignment_by_hand():
    group = make_group(
        [10, 11, 12],
        [
            make_sample([20, 21], reward=1.0, logprobs=[-0.5, -0.25], versions=[4, 5]),
            make_sample([30, 31, 32, 33], reward=-1.0),
        ],
    )
    short, long = samples_from_groups([group])
    batch = collate([short, long], pad_id=99, overlong_filtering=False)

    assert batch.input_ids[0].tolist() == [10, 11, 12, 20, 21, 99, 99]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert batch.targets.tolist() == batch.input_ids[:, 1:].tolist()
    assert batch.loss_mask[0].tolist() == [False, False, True, True, False, False]
    assert batch.targets[0, 2].item() == 20 and batch.targets[0, 3].item() == 21
    assert batch.behav_logprobs[0].tolist() == [0, 0, -0.5, -0.25, 0, 0]
    assert batch.versions[0].tolist() == [-1, -1, 4, 5, -1, -1]
    adv = short.advantage
    assert batch.advantages[0].tolist() == pytest.approx([0, 0, adv, adv, 0, 0])
    # The longer row fills the width: response at columns 2..5.
    assert batch.loss_mask[1].tolist() == [False, False, True, True, True, True]
    assert batch.targets[1, 2:].tolist() == [30, 31, 32, 33]
    assert batch.num_tokens == 6 and batch.num_seqs == 2
    dtypes = [t.dtype for t in (batch.input_ids, batch.attention_mask, batch.targets, batch.loss_mask,
                                batch.advantages, batch.behav_logprobs, batch.versions)]
    assert dtypes == [torch.int64, torch.int64, torch.int64, torch.bool,
                      torch.float32, torch.float32, torch.int64]


@FEW
@given(st.integers(0, 2**31 - 1))
def test_collate_mask_matches_response_positions(seed):
    samples = samples_from_groups(random_groups(np.random.default_rng(seed), 2, 3))
    batch = collate(samples, pad_id=PAD, overlong_filtering=False)
    for row, s in enumerate(samples):
        cols = batch.loss_mask[row].nonzero().flatten().tolist()
        assert cols == list(range(s.prompt_len - 1, s.prompt_len + s.response_len - 1))
        assert batch.targets[row, cols].tolist() == s.input_ids[s.prompt_len:].tolist()
        assert batch.behav_logprobs[row, cols].tolist() == s.behav_logprobs.tolist()
        assert batch.versions[row, cols].tolist() == s.versions.tolist()
    assert batch.num_tokens == int(batch.loss_mask.sum())


def test_overlong_filtering_masks_truncated_and_drops_from_counts():
    group = make_group(
        [1, 2], [make_sample([3, 4, 5], truncated=True), make_sample([6, 7], reward=-1)]
    )
    samples = samples_from_groups([group])
    assert valid_token_count(samples, overlong_filtering=False) == 5
    assert valid_seq_count(samples, overlong_filtering=False) == 2
    assert valid_token_count(samples, overlong_filtering=True) == 2
    assert valid_seq_count(samples, overlong_filtering=True) == 1

    batch = collate(samples, pad_id=PAD, overlong_filtering=True)
    assert not batch.loss_mask[0].any()
    assert batch.loss_mask[1].tolist() == [False, True, True, False]
    assert batch.num_tokens == 2 and batch.num_seqs == 1
    plan = plan_step([group], world_size=1, rank=0, groups_per_mini_batch=1, token_budget=64,
                     pad_id=PAD, overlong_filtering=True)
    assert (plan[0].num_tokens, plan[0].num_seqs) == (2, 1)


# ------------------------------------------------------------------------------------ mini-batches
def test_mini_batches_whole_groups_in_order():
    samples = [train_sample(3, group=g) for g in (0, 0, 1, 1, 2, 2, 3, 3)]
    batches = mini_batches(samples, 2)
    assert [[s.group for s in b] for b in batches] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert all(a is b for a, b in zip(samples, [s for b in batches for s in b]))
    with pytest.raises(ValueError, match="groups_per_mini_batch"):
        mini_batches(samples, 3)
    with pytest.raises(ValueError, match="groups_per_mini_batch"):
        mini_batches(samples, 0)


# ------------------------------------------------------------------------------------ packing
@FEW
@given(lengths_st, st.integers(min_value=1, max_value=120))
def test_pack_respects_budget_and_keeps_every_sample_once(lengths, budget):
    samples = [train_sample(n) for n in lengths]
    packed = pack_micro_batches(samples, budget)
    flat = [s for mb in packed for s in mb]
    assert sorted(map(id, flat)) == sorted(map(id, samples))
    for mb in packed:
        assert mb, "no empty micro-batch"
        cost = len(mb) * max(s.length for s in mb)
        assert cost <= budget or len(mb) == 1
    assert packed == pack_micro_batches(samples, budget)  # deterministic (identity comparison)


def test_pack_by_hand_and_oversized_alone():
    samples = [train_sample(n) for n in (3, 10, 4, 4, 2)]
    packed = pack_micro_batches(samples, 9)
    # Sorted 10,4,4,3,2: 10 alone (> budget) | 4,4 (cost 8; a 3 would make it 12) | 3,2 (cost 6).
    assert [[s.length for s in mb] for mb in packed] == [[10], [4, 4], [3, 2]]
    assert packed[1][0] is samples[2] and packed[1][1] is samples[3]  # ties keep input order
    with pytest.raises(ValueError, match="token_budget"):
        pack_micro_batches(samples, 0)


# ------------------------------------------------------------------------------------ ranks
@FEW
@given(lengths_st, st.integers(min_value=1, max_value=5))
def test_split_union_deterministic_balanced(lengths, world_size):
    samples = [train_sample(n) for n in lengths]
    shares = split_for_ranks(samples, world_size)
    assert len(shares) == world_size
    assert sorted(id(s) for share in shares for s in share) == sorted(map(id, samples))
    position = {id(s): i for i, s in enumerate(samples)}
    for share in shares:
        assert [position[id(s)] for s in share] == sorted(position[id(s)] for s in share)
    assert shares == split_for_ranks(samples, world_size)
    if samples:
        loads = [sum(s.length for s in share) for share in shares]
        assert max(loads) - min(loads) <= max(lengths)


def test_split_by_hand():
    samples = [train_sample(n) for n in (5, 9, 3, 4)]
    shares = split_for_ranks(samples, 2)
    # LPT: 9 -> r0, 5 -> r1, 4 -> r1 (5 < 9), then 3 on a 9/9 tie -> r0 (lowest rank).
    assert [[s.length for s in share] for share in shares] == [[9, 3], [5, 4]]
    assert split_for_ranks(samples[:1], 3)[1:] == [[], []]


# ------------------------------------------------------------------------------------ plan
def plan_all_ranks(groups, world_size, **kw):
    return [
        plan_step(groups, world_size=world_size, rank=r, pad_id=PAD, **kw) for r in range(world_size)
    ]


@FEW
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.booleans())
def test_plan_global_counts_and_rank_agreement(seed, world_size, overlong):
    groups = random_groups(np.random.default_rng(seed), 4, 3)
    plans = plan_all_ranks(groups, world_size, groups_per_mini_batch=2, token_budget=24,
                           overlong_filtering=overlong)
    samples = samples_from_groups(groups)
    for m, reference in enumerate(mini_batches(samples, 2)):
        per_rank = [plan[m] for plan in plans]
        assert len({(p.num_tokens, p.num_seqs, p.num_samples) for p in per_rank}) == 1
        assert per_rank[0].num_tokens == valid_token_count(reference, overlong_filtering=overlong)
        assert per_rank[0].num_tokens == sum(mb.num_tokens for p in per_rank for mb in p.micro_batches)
        assert per_rank[0].num_seqs == sum(mb.num_seqs for p in per_rank for mb in p.micro_batches)
        assert sum(len(p.samples) for p in per_rank) == len(reference)
        # Equal number of forward/backward passes on every rank.
        assert len({len(p.micro_batches) for p in per_rank}) == 1
        for p in per_rank:
            for mb in p.micro_batches:
                assert mb.num_rows * mb.input_ids.shape[1] <= 24 or mb.num_rows == 1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_split_losses_sum_to_full_batch_loss(agg):
    """The aggregation contract end to end: per-micro-batch losses with the plan's global
    denominators, summed over ranks and micro-batches, equal one call on the whole mini-batch."""
    groups = random_groups(np.random.default_rng(7), 2, 4)

    def loss_of(mb: MicroBatch, num_tokens, num_seqs):
        # A stand-in "current policy": any fixed function of the aligned tensors will do.
        logprobs = mb.behav_logprobs * 0.8 + 0.01 * mb.targets.float().sin()
        loss, _ = policy_loss(logprobs, mb.behav_logprobs, mb.advantages, mb.loss_mask,
                              agg=agg, num_tokens=num_tokens, num_seqs=num_seqs)
        return loss

    plans = plan_all_ranks(groups, 3, groups_per_mini_batch=2, token_budget=20,
                           overlong_filtering=True)
    split = sum(
        loss_of(mb, max(p[0].num_tokens, 1), max(p[0].num_seqs, 1))
        for p in plans for mb in p[0].micro_batches
    )
    whole = collate(samples_from_groups(groups), pad_id=PAD, overlong_filtering=True)
    full = loss_of(whole, None, None)
    assert split.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert full.item() != 0.0


def test_empty_rank_gets_padding_micro_batches():
    groups = [make_group([1, 2, 3], [make_sample([4, 5])], 0)]
    plans = plan_all_ranks(groups, 2, groups_per_mini_batch=1, token_budget=64,
                           overlong_filtering=False)
    real, idle = plans[0][0], plans[1][0]
    assert not idle.samples and len(idle.micro_batches) == len(real.micro_batches) == 1
    pad_mb = idle.micro_batches[0]
    assert pad_mb.is_padding and pad_mb.num_tokens == 0 and not pad_mb.loss_mask.any()
    assert pad_mb.input_ids.tolist() == [[1, 2]] and pad_mb.attention_mask.tolist() == [[1, 1]]
    assert idle.num_tokens == real.num_tokens == 2
    assert padding_micro_batch(samples_from_groups(groups)[0], pad_id=PAD).targets.shape == (1, 1)


def test_micro_batch_to_device_copies_fields():
    mb = collate(samples_from_groups([make_group([1], [make_sample([2, 3])])]), pad_id=PAD,
                 overlong_filtering=False)
    moved = mb.to("cpu")
    assert moved.num_tokens == mb.num_tokens and torch.equal(moved.loss_mask, mb.loss_mask)


def test_plan_rejects_bad_rank():
    groups = [make_group([1], [make_sample([2])])]
    with pytest.raises(ValueError, match="rank"):
        plan_step(groups, world_size=2, rank=2, groups_per_mini_batch=1, token_budget=8,
                  pad_id=PAD, overlong_filtering=False)
