"""Tests for async_dapo.learner.loss with hand-computed numbers (arithmetic in the comments).

float64 throughout so that equalities are exact up to ~1e-12; tensors are tiny (2-core CI).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from async_dapo.learner.loss import (
    aggregate_loss,
    apply_overlong_filter,
    entropy_and_token_prob,
    group_advantages,
    importance_weights,
    masked_mean,
    policy_loss,
    token_logprobs,
)

F64 = torch.float64
ln = math.log


def t(rows, dtype=F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def assert_values(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    """Element-wise |actual - expected| <= atol (expected given as nested lists)."""
    expected = torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected, atol=atol, rtol=0.0)


def one_token_loss(ratio: float, advantage: float, **kwargs) -> tuple[float, float, dict]:
    """(loss, d loss / d logprob, metrics) for a single valid token with the given ratio."""
    logprobs = t([[ln(ratio)]]).requires_grad_()
    loss, metrics = policy_loss(logprobs, t([[0.0]]), t([[advantage]]), t([[1.0]]), **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad.item(), {k: float(v) for k, v in metrics.items()}


# ----------------------------------------------------------------------------- clip branches


def test_unclipped_token_loss_and_gradient() -> None:
    # ratio 1.1 inside [0.8, 1.28]: loss = -A * ratio = -2 * 1.1 = -2.2;
    # d/d logprob of -A * exp(logprob) = -A * ratio = -2.2 (num_tokens = 1).
    loss, grad, metrics = one_token_loss(1.1, 2.0)
    assert loss == pytest.approx(-2.2, abs=1e-12)
    assert grad == pytest.approx(-2.2, abs=1e-12)
    assert metrics["pg_clipfrac_upper"] == 0.0 and metrics["pg_clipfrac_low_side"] == 0.0
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0


def test_clip_upper_for_positive_advantage() -> None:
    # ratio 1.5 > 1.28, A = 1: max(-1.5, -1.28) = -1.28, the clipped branch: zero gradient.
    loss, grad, metrics = one_token_loss(1.5, 1.0)
    assert loss == pytest.approx(-1.28, abs=1e-12)
    assert grad == 0.0
    assert metrics["pg_clipfrac_upper"] == 1.0 and metrics["pg_clipfrac_low_side"] == 0.0
    assert metrics["pg_clipfrac"] == 1.0  # verl's: the clipped term is taken


def test_high_ratio_negative_advantage_is_not_clipped() -> None:
    # ratio 1.5, A = -1: max(1.5, 1.28) = 1.5 (pessimistic bound keeps the unclipped term);
    # gradient -A * ratio = 1.5.
    loss, grad, metrics = one_token_loss(1.5, -1.0)
    assert loss == pytest.approx(1.5, abs=1e-12)
    assert grad == pytest.approx(1.5, abs=1e-12)
    assert metrics["pg_clipfrac_upper"] == 0.0 and metrics["pg_clipfrac_low_side"] == 0.0
    assert metrics["pg_clipfrac"] == 0.0  # -A * clip(r) = 1.28 < -A * r = 1.5: not taken


def test_clip_lower_for_negative_advantage() -> None:
    # ratio 0.5 < 0.8, A = -1: max(0.5, 0.8) = 0.8, clipped: zero gradient.
    loss, grad, metrics = one_token_loss(0.5, -1.0)
    assert loss == pytest.approx(0.8, abs=1e-12)
    assert grad == 0.0
    assert metrics["pg_clipfrac_low_side"] == 1.0 and metrics["pg_clipfrac_upper"] == 0.0
    # verl's pg_clipfrac counts it (0.8 > 0.5); its pg_clipfrac_lower is the dual clip: not here.
    assert metrics["pg_clipfrac"] == 1.0 and metrics["pg_clipfrac_lower"] == 0.0


def test_low_ratio_positive_advantage_is_not_clipped() -> None:
    # ratio 0.5, A = 1: max(-0.5, -0.8) = -0.5, unclipped; gradient -1 * 0.5.
    loss, grad, _ = one_token_loss(0.5, 1.0)
    assert loss == pytest.approx(-0.5, abs=1e-12)
    assert grad == pytest.approx(-0.5, abs=1e-12)


def test_symmetric_clip_values_are_used() -> None:
    # clip_high = 0.2: ratio 1.25, A = 1 -> max(-1.25, -1.2) = -1.2.
    loss, _, metrics = one_token_loss(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-12)
    assert metrics["pg_clipfrac_upper"] == 1.0


def test_dual_clip_bounds_negative_advantage_tokens() -> None:
    # ratio 5, A = -1, c = 3: standard loss max(5, 1.28) = 5; dual min(5, -A * c = 3) = 3,
    # a constant: zero gradient.
    loss, grad, metrics = one_token_loss(5.0, -1.0, clip_c=3.0)
    assert loss == pytest.approx(3.0, abs=1e-12)
    assert grad == 0.0
    assert metrics["pg_clipfrac_lower"] == 1.0  # verl's name: the dual-clip fraction
    assert metrics["pg_clipfrac"] == 0.0  # the standard clip is not taken (1.28 < 5)
    # Without clip_c the same token costs 5 and is not reported as dual-clipped.
    loss, grad, metrics = one_token_loss(5.0, -1.0)
    assert loss == pytest.approx(5.0, abs=1e-12)
    assert grad == pytest.approx(5.0, abs=1e-12)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_dual_clip_inactive_below_c_and_for_positive_advantage() -> None:
    # ratio 2 < c = 3, A = -1: loss 2 (unclipped), gradient 2.
    loss, grad, metrics = one_token_loss(2.0, -1.0, clip_c=3.0)
    assert (loss, grad, metrics["pg_clipfrac_lower"]) == pytest.approx((2.0, 2.0, 0.0), abs=1e-12)
    # ratio 5, A = +1: dual clip never applies to A > 0; upper clip gives -1.28.
    loss, _, metrics = one_token_loss(5.0, 1.0, clip_c=3.0)
    assert loss == pytest.approx(-1.28, abs=1e-12)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_all_branches_in_one_batch_with_metrics() -> None:
    # Tokens: ratio (1.1, 1.5, 0.5, 5, masked), A (2, 1, -1, -1, 7), clip_c = 3.
    # Per-token loss: -2.2, -1.28 (upper clip), 0.8 (lower clip), 3 (dual clip), masked.
    # token-mean: (-2.2 - 1.28 + 0.8 + 3) / 4 = 0.32 / 4 = 0.08.
    logprobs = t([[ln(1.1), ln(1.5), ln(0.5), ln(5.0), 10.0]]).requires_grad_()
    advantages = t([[2.0, 1.0, -1.0, -1.0, 7.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    old = torch.zeros(1, 5, dtype=F64)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, clip_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.08, abs=1e-12)
    # Only the unclipped token has a gradient: -A * ratio / num_tokens = -2.2 / 4 = -0.55.
    assert_values(logprobs.grad, [[-0.55, 0.0, 0.0, 0.0, 0.0]], 1e-12)
    # 1 of 4 valid tokens in each clip class; the masked ratio e^10 is ignored.
    assert float(metrics["pg_clipfrac_upper"]) == 0.25
    assert float(metrics["pg_clipfrac_low_side"]) == 0.25
    assert float(metrics["pg_clipfrac_lower"]) == 0.25  # the dual clip
    assert float(metrics["pg_clipfrac"]) == 0.5  # upper + low side
    # ppo_kl = mean(old - new) = -(ln 1.1 + ln 1.5 + ln 0.5 + ln 5) / 4 = -ln(4.125) / 4.
    assert float(metrics["ppo_kl"]) == pytest.approx(-ln(4.125) / 4, abs=1e-12)
    # ratio mean (1.1 + 1.5 + 0.5 + 5) / 4 = 2.025, max 5.
    assert float(metrics["ratio_mean"]) == pytest.approx(2.025, abs=1e-12)
    assert float(metrics["ratio_max"]) == pytest.approx(5.0, abs=1e-12)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_clip_fractions_in_verls_sense_hand_computed() -> None:
    # Two rows, ratio r and advantage A per token, eps_low 0.2, eps_high 0.28, c = 3:
    #   row 0: (1.5, +1) upper clip taken: -A*clip(r) = -1.28 > -A*r = -1.5          loss -1.28
    #          (0.5, -1) lower clip taken: 0.8 > 0.5                                loss  0.8
    #          (5.0, -2) standard clip not taken (2.56 < 10); dual: max(10, 2.56) = 10
    #                    > -A*c = 6, so the dual clip is taken                      loss  6
    #          (2.0, -1) neither: max(2, 1.28) = 2 < 3                              loss  2
    #   row 1: (1.1, +2) inside the clip range                                      loss -2.2
    #          (0.5, +1) not clipped: -0.8 < -0.5 (the pessimistic max keeps -A*r)   loss -0.5
    #          (1.5,  0) A = 0: both terms 0, nothing is "taken", not A < 0          loss  0
    #          masked (r = e^10, A = -1): would be dual-clipped, must not count.
    # 7 valid tokens: pg_clipfrac (verl) = 2/7, pg_clipfrac_lower (verl: dual) = 1/7,
    # pg_clipfrac_upper = 1/7, pg_clipfrac_low_side = 1/7; loss = 4.82 / 7.
    logprobs = t([[ln(1.5), ln(0.5), ln(5.0), ln(2.0)], [ln(1.1), ln(0.5), ln(1.5), 10.0]])
    advantages = t([[1.0, -1.0, -2.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    old = torch.zeros(2, 4, dtype=F64)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, clip_c=3.0)
    got = {k: float(v) for k, v in metrics.items()}
    assert got["pg_clipfrac"] == pytest.approx(2 / 7, abs=1e-7)
    assert got["pg_clipfrac_lower"] == pytest.approx(1 / 7, abs=1e-7)
    assert got["pg_clipfrac_upper"] == pytest.approx(1 / 7, abs=1e-7)
    assert got["pg_clipfrac_low_side"] == pytest.approx(1 / 7, abs=1e-7)
    assert loss.item() == pytest.approx(4.82 / 7, abs=1e-12)
    # ppo_kl = -(sum of the valid log ratios) / 7 = -ln(1.5 * 0.5 * 5 * 2 * 1.1 * 0.5 * 1.5) / 7.
    assert got["ppo_kl"] == pytest.approx(-ln(6.1875) / 7, abs=1e-12)
    # Without clip_c there is no dual clip: the (5.0, -2) token costs 10 and nothing is dual-clipped.
    loss, metrics = policy_loss(logprobs, old, advantages, mask)
    assert float(metrics["pg_clipfrac_lower"]) == 0.0
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 7, abs=1e-7)
    assert loss.item() == pytest.approx(8.82 / 7, abs=1e-12)


def _verl_clip_metrics(old, new, adv, mask, clip_low, clip_high, clip_c):
    """verl's ``compute_policy_loss_vanilla`` metric lines (verl/trainer/ppo/core_algos.py), transcribed:
    the reference our verl-named keys must reproduce."""

    def verl_masked_mean(values, m):  # verl.utils.torch_functional.masked_mean
        return (values * m).sum() / (m.sum() + 1e-8)

    m = mask.to(F64)
    negative_approx_kl = torch.clamp(new - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, m)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), m)
    pg_losses3 = -adv * clip_c
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float(), m)
    return {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}


@pytest.mark.parametrize("clip_low,clip_high,clip_c", [(0.2, 0.28, 3.0), (0.2, 0.2, 1.5), (0.1, 2.5, 10.0)])
def test_verl_named_clip_metrics_match_verls_formulas(clip_low, clip_high, clip_c) -> None:
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(8, 16, generator=gen, dtype=F64) * 3
    new = old + torch.randn(8, 16, generator=gen, dtype=F64) * 1.5  # ratios from ~0.01 to ~100
    adv = torch.randn(8, 1, generator=gen, dtype=F64).expand(8, 16).contiguous()
    adv[0] = 0.0  # a row with no signal
    mask = torch.rand(8, 16, generator=gen) < 0.8
    _, ours = policy_loss(new, old, adv, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)
    verl = _verl_clip_metrics(old, new, adv, mask, clip_low, clip_high, clip_c)
    # Fractions are float32 means (as verl's .float()): 1e-6 is far below one token in ~100 (0.01).
    for key, value in verl.items():
        assert float(value) != 0, key  # the batch exercises every branch
        assert float(ours[key]) == pytest.approx(float(value), abs=1e-6), key
    # verl's either-side fraction is our two sides together.
    sides = float(ours["pg_clipfrac_upper"]) + float(ours["pg_clipfrac_low_side"])
    assert float(ours["pg_clipfrac"]) == pytest.approx(sides, abs=1e-6)


def test_is_weights_multiply_after_clipping() -> None:
    # Token 0: unclipped -2.2, weight 0.5 -> -1.1. Token 1: upper-clipped -1.28, weight 2
    # -> -2.56 (the weight scales the CLIPPED value; it does not enter the ratio).
    # Loss (-1.1 - 2.56) / 2 = -1.83; grad token 0: -2.2 * 0.5 / 2 = -0.55, token 1: 0.
    logprobs = t([[ln(1.1), ln(1.5)]]).requires_grad_()
    weights = t([[0.5, 2.0]]).requires_grad_()  # must be treated as a constant
    loss, _ = policy_loss(
        logprobs, torch.zeros(1, 2, dtype=F64), t([[2.0, 1.0]]), torch.ones(1, 2),
        is_weights=weights,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.83, abs=1e-12)
    assert_values(logprobs.grad, [[-0.55, 0.0]], 1e-12)
    assert weights.grad is None


def test_log_ratio_is_clamped() -> None:
    # log ratio 1000 is clamped to 20: A = -1 unclipped loss = e^20, finite; KL = -20.
    loss, metrics = policy_loss(t([[1000.0]]), t([[0.0]]), t([[-1.0]]), t([[1.0]]))
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-12)
    assert float(metrics["ppo_kl"]) == -20.0


# ----------------------------------------------------------------------------- aggregation

# Per-token values: row 0 [1, 2, 3] all valid; row 1 [4, (100), (100)] one valid token;
# row 2 [(9), (9), (9)] no valid token.
PER_TOKEN = t([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])
AGG_MASK = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("agg", "kwargs", "expected"),
    [
        ("token-mean", {}, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("token-mean", {"num_tokens": 10}, 1.0),  # 10 / 10 (a global count)
        ("seq-mean-token-mean", {}, 3.0),  # (mean(1,2,3) = 2  +  4) / 2 sequences with tokens
        ("seq-mean-token-mean", {"num_seqs": 5}, 1.2),  # 6 / 5
        ("seq-mean-token-sum", {}, 5.0),  # (6 + 4) / 2
        ("seq-mean-token-sum", {"num_seqs": 4}, 2.5),  # 10 / 4
    ],
)
def test_aggregation_modes(agg: str, kwargs: dict, expected: float) -> None:
    assert aggregate_loss(PER_TOKEN, AGG_MASK, agg, **kwargs).item() == pytest.approx(expected)
    # Same numbers through policy_loss: with ratio 1 the per-token loss is -A.
    loss, _ = policy_loss(PER_TOKEN * 0, PER_TOKEN * 0, -PER_TOKEN, AGG_MASK, agg=agg, **kwargs)
    assert loss.item() == pytest.approx(expected)


def test_aggregation_ignores_non_finite_padding_and_empty_batch_is_zero() -> None:
    values = t([[1.0, float("nan"), float("inf")]])
    assert aggregate_loss(values, t([[1.0, 0.0, 0.0]])).item() == 1.0
    empty = torch.zeros(3, 3, dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate_loss(PER_TOKEN, empty, agg).item() == 0.0


def test_masked_mean() -> None:
    assert masked_mean(t([1.0, 2.0, 6.0]), torch.tensor([True, False, True])).item() == 3.5
    assert masked_mean(t([1.0]), torch.tensor([False])).item() == 0.0


# ----------------------------------------------------------------------------- split invariance


def _random_batch(seed: int = 0, rows: int = 6, cols: int = 5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=gen, dtype=F64) * 3
    # ratios roughly in [0.7, 1.45]: some tokens clip, some do not.
    logprobs = old + (torch.rand(rows, cols, generator=gen, dtype=F64) - 0.5) * 0.75
    advantages = (torch.rand(rows, 1, generator=gen, dtype=F64) - 0.5).expand(rows, cols)
    # Uneven lengths, so that local token counts differ between splits.
    lengths = torch.tensor([5, 1, 3, 4, 2, 5]).repeat(rows // 6 + 1)[:rows]
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    return logprobs, old, advantages.contiguous(), mask


# Two "ranks" of 3 rows, each split into two uneven micro-batches.
SPLITS = [slice(0, 1), slice(1, 3), slice(3, 5), slice(5, 6)]


def _split_gradient(agg: str, global_count: bool) -> torch.Tensor:
    logprobs, old, advantages, mask = _random_batch()
    leaf = logprobs.clone().requires_grad_()
    count_kwargs = {}
    if global_count:
        key = "num_tokens" if agg == "token-mean" else "num_seqs"
        count_kwargs[key] = int(mask.sum()) if agg == "token-mean" else int(mask.any(-1).sum())
    for rows in SPLITS:
        loss, _ = policy_loss(
            leaf[rows], old[rows], advantages[rows], mask[rows], agg=agg, **count_kwargs
        )
        loss.backward()  # gradients accumulate in leaf.grad, as across micro-batches and ranks
    return leaf.grad


def _full_gradient(agg: str) -> torch.Tensor:
    logprobs, old, advantages, mask = _random_batch()
    leaf = logprobs.clone().requires_grad_()
    loss, metrics = policy_loss(leaf, old, advantages, mask, agg=agg)
    loss.backward()
    # The batch really exercises clipping, otherwise the test would prove less.
    assert float(metrics["pg_clipfrac"]) > 0
    return leaf.grad


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_split_with_global_count_equals_full_batch(agg: str) -> None:
    torch.testing.assert_close(_split_gradient(agg, global_count=True), _full_gradient(agg))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_split_with_local_count_differs(agg: str) -> None:
    # Local denominators (1, 4, 7, 5 tokens; 1, 2, 2, 1 sequences) re-weight the
    # micro-batches: the summed gradient is no longer the full-batch gradient.
    local, full = _split_gradient(agg, global_count=False), _full_gradient(agg)
    assert not torch.allclose(local, full)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_token_mean_split_invariance_any_partition(sizes: list[int]) -> None:
    logprobs, old, advantages, mask = _random_batch(seed=1, rows=sum(sizes))
    mask = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) < 0.7
    total = int(mask.sum())
    full = logprobs.clone().requires_grad_()
    policy_loss(full, old, advantages, mask, num_tokens=max(total, 1))[0].backward()
    split = logprobs.clone().requires_grad_()
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        policy_loss(
            split[rows], old[rows], advantages[rows], mask[rows], num_tokens=max(total, 1)
        )[0].backward()
        start += size
    torch.testing.assert_close(split.grad, full.grad)


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_normalises_per_group() -> None:
    # Group 7: scores (1, -1, -1, 1): mean 0, unbiased var 4 / 3, std 1.1547005...
    scores = t([1.0, -1.0, -1.0, 1.0])
    advantages = group_advantages(scores, torch.tensor([7, 7, 7, 7]))
    expected = 1.0 / (math.sqrt(4.0 / 3.0) + 1e-6)
    assert advantages.tolist() == pytest.approx([expected, -expected, -expected, expected])


def test_group_advantages_interleaved_arbitrary_ids() -> None:
    # id 5: (1, 3) mean 2, std sqrt(2); id -9: (2, 6) mean 4, std sqrt(8).
    scores = t([1.0, 2.0, 3.0, 6.0])
    ids = torch.tensor([5, -9, 5, -9])
    advantages = group_advantages(scores, ids)
    a, b = 1 / (math.sqrt(2) + 1e-6), 2 / (math.sqrt(8) + 1e-6)
    assert advantages.tolist() == pytest.approx([-a, -b, a, b], abs=1e-12)
    assert group_advantages(scores, ids, scale_by_std=False).tolist() == [-1.0, -2.0, 1.0, 2.0]


def test_group_of_one_uses_mean_zero_std_one() -> None:
    # verl: a singleton group has mean 0, std 1 -> advantage = s / (1 + eps), or s.
    advantages = group_advantages(t([0.7, 1.0, -1.0]), torch.tensor([3, 4, 4]))
    assert advantages[0].item() == pytest.approx(0.7 / (1.0 + 1e-6), abs=1e-15)
    assert group_advantages(t([0.7]), torch.tensor([3]), scale_by_std=False).item() == 0.7


def test_all_equal_group_gets_exactly_zero() -> None:
    # 0.1 + 0.1 + 0.1 rounds; the result must still be exactly 0, not ~1e-11.
    advantages = group_advantages(t([0.1, 0.1, 0.1, -1.0, -1.0]), torch.tensor([1, 1, 1, 2, 2]))
    assert advantages.tolist() == [0.0] * 5
    float32 = group_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert float32.dtype == torch.float32 and float32.tolist() == [0.0, 0.0]


def test_group_advantages_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group_index"):
        group_advantages(t([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="scores"):
        group_advantages(t([[1.0]]), torch.tensor([[0]]))


# ----------------------------------------------------------------------------- importance weights

# One row, ratios pi_prox / pi_behav = 0.4, 0.5, 1.5, 3, and a masked position (ratio 10).
PROX = t([[ln(0.4), ln(0.5), ln(1.5), ln(3.0), ln(10.0)]])
BEHAV = torch.zeros(1, 5, dtype=F64)
IS_MASK = torch.tensor([[True, True, True, True, False]])


def test_token_truncate() -> None:
    # min(w, 2): 0.4, 0.5, 1.5, 2; masked position 0.
    weights = importance_weights(PROX, BEHAV, IS_MASK, cap=2.0)
    assert_values(weights, [[0.4, 0.5, 1.5, 2.0, 0.0]], 1e-12)


def test_token_mask_default_low_is_reciprocal_of_cap() -> None:
    # cap 4 (low 1/4): 0.4, 0.5, 1.5 and 3 all lie inside [0.25, 4].
    inside = importance_weights(PROX, BEHAV, IS_MASK, mode="mask", cap=4.0)
    assert_values(inside, [[0.4, 0.5, 1.5, 3.0, 0.0]], 1e-12)
    # cap 2, low 0.45 (away from exp(ln 0.5), which may round either way): 0.4 and 3 drop.
    dropped = importance_weights(PROX, BEHAV, IS_MASK, mode="mask", cap=2.0, low=0.45)
    assert_values(dropped, [[0.0, 0.5, 1.5, 0.0, 0.0]], 1e-12)
    default_low = importance_weights(
        t([[ln(0.3), 0.0]]), t([[0.0, 0.0]]), IS_MASK[:, :2], mode="mask"
    )
    assert_values(default_low, [[0.0, 1.0]])  # cap 2: 0.3 < low = 1/2


def test_mask_bounds_are_inclusive() -> None:
    # w = exp(0) = 1 exactly, with low = cap = 1: kept.
    weights = importance_weights(t([[0.0]]), t([[0.0]]), t([[1.0]]), mode="mask", cap=1.0, low=1.0)
    assert weights.item() == 1.0


def test_sequence_level_weights() -> None:
    # Row 0: valid ratios 2 and 3 -> w = 6 on both valid tokens (masked ln 100 ignored).
    # Row 1: 0.5 * 0.5 = 0.25.
    prox = t([[ln(2.0), ln(3.0), ln(100.0)], [ln(0.5), ln(0.5), 0.0]])
    behav = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    truncate_10 = importance_weights(prox, behav, mask, level="sequence", cap=10.0)
    assert_values(truncate_10, [[6, 6, 0], [0.25, 0.25, 0]], 1e-12)
    truncate_2 = importance_weights(prox, behav, mask, level="sequence", cap=2.0)
    assert_values(truncate_2, [[2, 2, 0], [0.25, 0.25, 0]], 1e-12)
    # mask mode, cap 10 (low 0.1): both rows kept; cap 5 (low 0.2): row 0 (6 > 5) dropped.
    mask_10 = importance_weights(prox, behav, mask, level="sequence", mode="mask", cap=10.0)
    assert_values(mask_10, [[6, 6, 0], [0.25, 0.25, 0]], 1e-12)
    mask_5 = importance_weights(prox, behav, mask, level="sequence", mode="mask", cap=5.0)
    assert_values(mask_5, [[0, 0, 0], [0.25, 0.25, 0]], 1e-12)
    # cap 2 (low 0.5): row 1 (0.25 < 0.5) dropped too.
    mask_2 = importance_weights(prox, behav, mask, level="sequence", mode="mask", cap=2.0)
    assert mask_2.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_importance_weights_are_detached_and_finite() -> None:
    # 100 tokens of log ratio +50 sum to 5000: clamped to 20 before exp, no overflow.
    prox = torch.full((1, 100), 50.0, requires_grad=True)
    weights = importance_weights(
        prox, torch.zeros(1, 100), torch.ones(1, 100), level="sequence", cap=1e9
    )
    assert not weights.requires_grad
    assert torch.isfinite(weights).all()
    assert weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_decoupled_objective_combines_proximal_clip_and_behaviour_weight() -> None:
    # Stale token: behaviour logprob ln 0.5, proximal ln 0.6, current ln 0.66.
    # ratio vs proximal 1.1 (unclipped), weight 0.6 / 0.5 = 1.2, A = 1:
    # loss = -1.1 * 1.2 = -1.32; naive off-policy (old = behaviour): ratio 1.32 > 1.28 -> -1.28.
    behaviour, proximal = t([[ln(0.5)]]), t([[ln(0.6)]])
    current, mask, adv = t([[ln(0.66)]]), t([[1.0]]), t([[1.0]])
    weights = importance_weights(proximal, behaviour, mask)
    decoupled, _ = policy_loss(current, proximal, adv, mask, is_weights=weights)
    naive, _ = policy_loss(current, behaviour, adv, mask)
    assert decoupled.item() == pytest.approx(-1.32, abs=1e-12)
    assert naive.item() == pytest.approx(-1.28, abs=1e-12)


# ----------------------------------------------------------------------------- entropy, token prob


def test_entropy_of_uniform_is_log_vocab() -> None:
    targets = torch.zeros(2, 3, dtype=torch.long)
    entropy, prob = entropy_and_token_prob(torch.zeros(2, 3, 7), targets)
    assert_values(entropy, [[math.log(7)] * 3] * 2, 1e-6)
    assert_values(prob, [[1 / 7] * 3] * 2, 1e-7)


def test_entropy_two_token_example() -> None:
    # logits (0, ln 3) -> p = (1/4, 3/4); H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3.
    logits = torch.tensor([[[0.0, ln(3.0)]]])
    entropy, prob = entropy_and_token_prob(logits, torch.tensor([[1]]))
    assert entropy.item() == pytest.approx(ln(4.0) - 0.75 * ln(3.0), abs=1e-6)
    assert prob.item() == pytest.approx(0.75, abs=1e-6)


def test_entropy_chunked_equals_unchunked_and_respects_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    mask = torch.rand(3, 5, generator=gen) < 0.6
    whole = entropy_and_token_prob(logits, targets, mask, chunk_size=10_000)
    for chunk in (1, 2, 4, 7):
        chunked = entropy_and_token_prob(logits, targets, mask, chunk_size=chunk)
        for got, want in zip(chunked, whole):
            torch.testing.assert_close(got, want)
    # Reference without chunking, straight from the definition.
    log_p = torch.log_softmax(logits, -1)
    reference = -(log_p.exp() * log_p).sum(-1) * mask
    torch.testing.assert_close(whole[0], reference)
    assert (whole[1][~mask] == 0).all()


def test_entropy_handles_minus_inf_logits_and_bf16() -> None:
    # A banned token (-inf) contributes 0 to the entropy, not NaN: H = ln 2.
    logits = torch.tensor([[[0.0, 0.0, -float("inf")]]], dtype=torch.bfloat16)
    entropy, prob = entropy_and_token_prob(logits, torch.tensor([[0]]))
    assert entropy.dtype == torch.float32
    assert entropy.item() == pytest.approx(ln(2.0), abs=1e-6)
    assert prob.item() == pytest.approx(0.5, abs=1e-6)


# ----------------------------------------------------------------------------- filters
# (dynamic sampling's group rule is the queue's: tests/unit/test_replay.py, replay.keeps_group)


def test_apply_overlong_filter_zeros_truncated_rows() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    filtered = apply_overlong_filter(mask, [False, True, False])
    assert filtered.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert mask[1].tolist() == [1.0, 1.0, 1.0]  # input untouched
    bool_mask = apply_overlong_filter(mask.bool(), torch.tensor([True, False, False]))
    assert bool_mask.dtype == torch.bool and bool_mask.sum().item() == 4
    with pytest.raises(ValueError, match="truncated"):
        apply_overlong_filter(mask, [True])


# ----------------------------------------------------------------------------- validation


def test_policy_loss_rejects_bad_arguments() -> None:
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(x, x, x, m, agg="seq-mean")
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(x, x, x, m, clip_c=1.0)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(x, torch.zeros(2, 4), x, m)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2), m)
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(x, x, x, m, is_weights=torch.ones(3, 3))
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(x, x, x, m, num_tokens=0)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, x, m, clip_low=1.0)


def test_importance_weights_and_entropy_reject_bad_arguments() -> None:
    x, m = torch.zeros(1, 2), torch.ones(1, 2)
    for kwargs, name in [
        ({"level": "seq"}, "level"),
        ({"mode": "clip"}, "mode"),
        ({"cap": 0.0}, "cap"),
        ({"cap": 2.0, "low": 3.0}, "low"),
    ]:
        with pytest.raises(ValueError, match=name):
            importance_weights(x, x, m, **kwargs)
    with pytest.raises(ValueError, match="mask"):
        importance_weights(x, x, torch.ones(1, 3))
    with pytest.raises(ValueError, match="target_ids"):
        entropy_and_token_prob(torch.zeros(1, 2, 4), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_and_token_prob(
            torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), chunk_size=0
        )


# ----------------------------------------------------------------------------- token log-probs
# float32 here (the learner's dtype for log-probs): "exact" means rounding, ~1e-7 relative.

F32 = torch.float32


def naive_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The old learner path: full-vocabulary fp32 log_softmax(logits / T), then gather."""
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)


def values_and_grad(fn, base: torch.Tensor, weights: torch.Tensor):
    """(fn(), d sum(weights * fn()) / d base); non-uniform weights check the gradient's scaling."""
    out = fn()
    (grad,) = torch.autograd.grad((out * weights).sum(), base)
    return out.detach(), grad


# Position 0: logits (0, ln 2, ln 5) -> p = (1, 2, 5) / 8. Position 1: uniform over 3.
# Position 2: (0, 0, -inf), a banned token -> p = (1/2, 1/2, 0).
HAND_LOGITS = [[[0.0, ln(2.0), ln(5.0)], [ln(3.0)] * 3, [0.0, 0.0, -math.inf]]]
HAND_TARGETS = [[2, 0, 0]]


def test_token_logprobs_hand_example_at_t1() -> None:
    # log p_y; gradient of sum(log p_y) w.r.t. the logits = onehot(y) - p.
    logits = t(HAND_LOGITS, F32).requires_grad_()
    logprobs = token_logprobs(logits, torch.tensor(HAND_TARGETS), chunk_tokens=2)
    assert logprobs.dtype == F32
    assert_values(logprobs, [[ln(5 / 8), ln(1 / 3), ln(1 / 2)]], 1e-6)
    logprobs.sum().backward()
    expected_grad = [[[-1 / 8, -2 / 8, 3 / 8], [2 / 3, -1 / 3, -1 / 3], [1 / 2, -1 / 2, 0.0]]]
    assert_values(logits.grad, expected_grad, 1e-6)


def test_token_logprobs_hand_example_at_half_temperature() -> None:
    # T = 1/2 squares the odds: (1, 2, 5) -> (1, 4, 25) / 30; uniform stays uniform; (1, 1, 0) too.
    # Gradient = (onehot - p) / T = 2 * (onehot - p): position 0 -> 2 * (-1, -4, 5) / 30.
    logits = t(HAND_LOGITS, F32).requires_grad_()
    logprobs = token_logprobs(logits, torch.tensor(HAND_TARGETS), temperature=0.5)
    assert_values(logprobs, [[ln(25 / 30), ln(1 / 3), ln(1 / 2)]], 1e-6)
    logprobs.sum().backward()
    expected_grad = [[[-1 / 15, -4 / 15, 1 / 3], [4 / 3, -2 / 3, -2 / 3], [1.0, -1.0, 0.0]]]
    assert_values(logits.grad, expected_grad, 1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 24, 1000])  # N = 3 * 8 = 24: 7 does not divide it
def test_token_logprobs_equals_naive_values_and_gradients(
    temperature: float, chunk_tokens: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, 50, generator=gen).requires_grad_()
    targets = torch.randint(0, 50, (3, 8), generator=gen)
    weights = torch.randn(3, 8, generator=gen)
    got = values_and_grad(
        lambda: token_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk_tokens),
        logits, weights,
    )
    want = values_and_grad(lambda: naive_logprobs(logits, targets, temperature), logits, weights)
    for actual, expected in zip(got, want):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0.0)


def test_token_logprobs_bf16_logits() -> None:
    # The learner's dtype on GPU. Both paths upcast the same bf16 values, so the log-probs agree to
    # fp32 rounding; the gradient is bf16 (the logits' dtype) in both, so allow one bf16 step.
    gen = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(2, 9, 40, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, 40, (2, 9), generator=gen)
    weights = torch.randn(2, 9, generator=gen)
    values, grad = values_and_grad(
        lambda: token_logprobs(logits, targets, temperature=0.7, chunk_tokens=5), logits, weights
    )
    naive_values, naive_grad = values_and_grad(
        lambda: naive_logprobs(logits, targets, 0.7), logits, weights
    )
    assert values.dtype == F32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(values, naive_values, atol=1e-5, rtol=0.0)
    torch.testing.assert_close(grad.float(), naive_grad.float(), atol=1e-2, rtol=0.0)


@pytest.mark.parametrize("layout", ["drop_last_position", "transposed"])
def test_token_logprobs_non_contiguous_logits(layout: str) -> None:
    # The learner passes out.logits[:, :-1], a view that cannot be flattened without a copy; chunks
    # of 4 positions straddle its rows of 5. The gradient lands in the right places of the base.
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 6, 11, generator=gen).requires_grad_()

    def view() -> torch.Tensor:
        return base[:, :-1] if layout == "drop_last_position" else base.transpose(0, 1)

    targets = torch.randint(0, 11, view().shape[:2], generator=gen)
    weights = torch.randn(view().shape[:2], generator=gen)
    got = values_and_grad(
        lambda: token_logprobs(view(), targets, temperature=0.7, chunk_tokens=4), base, weights
    )
    want = values_and_grad(lambda: naive_logprobs(view(), targets, 0.7), base, weights)
    for actual, expected in zip(got, want):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0.0)
    if layout == "drop_last_position":
        assert (got[1][:, -1] == 0).all()  # the dropped position gets no gradient


def test_token_logprobs_without_grad_and_int32_targets() -> None:
    # The proximal pass runs under no_grad; token ids may arrive as int32.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=gen)
    targets = torch.randint(0, 6, (2, 3), generator=gen)
    with torch.no_grad():
        got = token_logprobs(logits, targets.int(), temperature=0.7, chunk_tokens=4)
    assert got.grad_fn is None
    torch.testing.assert_close(got, naive_logprobs(logits, targets, 0.7), atol=1e-6, rtol=0.0)


def test_token_logprobs_rejects_bad_arguments() -> None:
    logits, targets = torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="logits must be"):
        token_logprobs(torch.zeros(2, 4), targets)
    with pytest.raises(ValueError, match="logits must be a floating"):
        token_logprobs(torch.zeros(1, 2, 4, dtype=torch.long), targets)
    with pytest.raises(ValueError, match="targets has shape"):
        token_logprobs(logits, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must hold integer"):
        token_logprobs(logits, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs(logits, targets, chunk_tokens=0)
    for bad in (0.0, -0.7, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            token_logprobs(logits, targets, temperature=bad)


def test_entropy_with_temperature() -> None:
    # logits (0, ln 3) at T = 1/2 -> (0, 2 ln 3): p = (1/10, 9/10), H = -(0.1 ln 0.1 + 0.9 ln 0.9).
    logits = torch.tensor([[[0.0, ln(3.0)]]])
    entropy, prob = entropy_and_token_prob(logits, torch.tensor([[1]]), temperature=0.5)
    assert entropy.item() == pytest.approx(-(0.1 * ln(0.1) + 0.9 * ln(0.9)), abs=1e-6)
    assert prob.item() == pytest.approx(0.9, abs=1e-6)


def test_entropy_temperature_on_raw_view_equals_prescaled_and_token_logprobs() -> None:
    # What the learner will pass (a bf16 view of raw logits and T) versus the old pre-scaled fp32
    # tensor; the target probability is exp of token_logprobs at the same temperature.
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2, 7, 13, generator=gen).bfloat16()
    raw = base[:, :-1]
    targets = torch.randint(0, 13, (2, 6), generator=gen)
    mask = torch.rand(2, 6, generator=gen) < 0.7
    entropy, prob = entropy_and_token_prob(raw, targets, mask, chunk_size=4, temperature=0.7)
    want_entropy, want_prob = entropy_and_token_prob(raw.float() / 0.7, targets, mask)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-6, rtol=0.0)
    torch.testing.assert_close(prob, want_prob, atol=1e-6, rtol=0.0)
    logprobs = token_logprobs(raw, targets, temperature=0.7)
    torch.testing.assert_close(prob, logprobs.exp() * mask, atol=1e-6, rtol=0.0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_and_token_prob(raw, targets, temperature=0.0)
