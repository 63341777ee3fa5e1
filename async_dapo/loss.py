"""DAPO learner math: group advantages, the clipped (and importance-corrected) policy loss,
its aggregation, entropy / token-probability monitoring, and the sample filters.

Pure torch functions with no state; the learner calls them per micro-batch. Shapes: ``[B, T]``
tensors hold one row per response (response tokens only); ``mask`` marks the tokens that count
(bool or 0/1 float).

Aggregation contract (all modes): the loss of one call is a SUM over its rows divided by a
denominator the caller may pass in. When the learner passes the GLOBAL denominator of the
whole mini-batch (valid tokens across every micro-batch and rank for "token-mean", valid
sequences for the "seq-mean-*" modes), the sum over micro-batches and ranks of the per-call
losses, and hence of their gradients, equals the loss of the whole mini-batch computed in one
call, however the batch is split. With data-parallel gradient AVERAGING (FSDP/DDP default) the
learner multiplies each call's loss by the world size to keep that sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "apply_overlong_filter",
    "entropy_and_token_prob",
    "group_advantages",
    "importance_weights",
    "keep_group",
    "masked_mean",
    "policy_loss",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
# exp(20) ~ 4.9e8: large enough to never bind in a sane run, small enough to never overflow.
LOG_RATIO_BOUND = 20.0


# --------------------------------------------------------------------------- validation


def _check_same_shape(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
                f"(the shape of {reference_name})"
            )


def _check_2d(name: str, tensor: Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(tensor.shape)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_positive_count(name: str, value: int | float | Tensor | None) -> None:
    # Tensors are not inspected: reading them would force a device sync per micro-batch.
    if value is not None and not isinstance(value, Tensor) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


# --------------------------------------------------------------------------- advantages


def group_advantages(
    scores: Tensor, group_index: Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """GRPO outcome advantage per sample, as verl's ``compute_grpo_outcome_advantage``.

    ``scores[N]`` are the (shaped) rewards, ``group_index[N]`` arbitrary integer group ids.
    Advantage = (s - group mean) / (unbiased group std + eps), or s - group mean when
    ``scale_by_std`` is False. A group of ONE sample gets mean 0 and std 1 (verl), so its
    advantage is s / (1 + eps) (or s). A group whose scores are all equal gets 0.
    Returned detached, float32 (float64 in, float64 out).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(
            f"group_index has shape {tuple(group_index.shape)}, expected {tuple(scores.shape)}"
        )
    out_dtype = scores.dtype if scores.dtype == torch.float64 else torch.float32
    values = scores.detach().to(torch.float64)
    _, group_of, counts = torch.unique(group_index, return_inverse=True, return_counts=True)

    sums = torch.zeros(counts.numel(), dtype=torch.float64, device=values.device)
    mean = sums.index_add(0, group_of, values) / counts
    squared = torch.zeros_like(mean).index_add(0, group_of, (values - mean[group_of]) ** 2)
    std = (squared / (counts - 1).clamp(min=1)).sqrt()

    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)

    advantages = values - mean[group_of]
    if scale_by_std:
        advantages = advantages / (std[group_of] + eps)
    # Rounding in the mean (e.g. three 0.1s) would leave ~1e-11 instead of 0 in a group with
    # no signal; make "all equal -> exactly 0" hold. Groups of one keep their raw score.
    no_signal = (_group_spread(values, group_of, counts.numel()) == 0) & ~single
    advantages = torch.where(no_signal[group_of], torch.zeros_like(advantages), advantages)
    return advantages.to(out_dtype)


def _group_spread(values: Tensor, group_of: Tensor, num_groups: int) -> Tensor:
    """max - min of ``values`` within each group."""
    empty = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    high = empty.scatter_reduce(0, group_of, values, reduce="amax", include_self=False)
    low = empty.scatter_reduce(0, group_of, values, reduce="amin", include_self=False)
    return high - low


# --------------------------------------------------------------------------- aggregation


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is set; 0 when nothing is set."""
    keep = _as_bool(mask)
    total = torch.where(keep, values, torch.zeros_like(values)).sum()
    return total / keep.sum().clamp(min=1)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar; masked-out positions never count.

    - "token-mean": sum over valid tokens / ``num_tokens`` (DAPO's token-level loss).
      Default ``num_tokens`` = local valid-token count.
    - "seq-mean-token-mean": sum over sequences of (that sequence's mean over its valid
      tokens) / ``num_seqs`` (naive GRPO).
    - "seq-mean-token-sum": sum over sequences of (that sequence's SUM over its valid
      tokens) / ``num_seqs`` (verl's semantics: a mean of per-sequence sums).
    Default ``num_seqs`` = local number of sequences with at least one valid token.

    Contract: pass the GLOBAL ``num_tokens`` / ``num_seqs`` of the whole mini-batch and the
    per-call losses of any split into micro-batches and ranks sum to the full-batch loss (the
    seq-mean modes are per-row sums, so they split cleanly too). A zero default count (nothing
    valid) gives a loss of 0, not NaN.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    _check_2d("per_token", per_token)
    _check_same_shape("per_token", per_token, mask=mask)
    _check_positive_count("num_tokens", num_tokens)
    _check_positive_count("num_seqs", num_seqs)

    keep = _as_bool(mask)
    # where(), not multiplication: a non-finite value at a padded position must not leak.
    summed_rows = torch.where(keep, per_token, torch.zeros_like(per_token)).sum(dim=-1)
    tokens_per_row = keep.sum(dim=-1)

    if agg == "token-mean":
        denominator = tokens_per_row.sum().clamp(min=1) if num_tokens is None else num_tokens
        return summed_rows.sum() / denominator

    if agg == "seq-mean-token-mean":
        summed_rows = summed_rows / tokens_per_row.clamp(min=1)
    denominator = (tokens_per_row > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    return summed_rows.sum() / denominator


# --------------------------------------------------------------------------- policy loss


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    is_weights: Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Higher PPO policy loss (to minimise), optionally dual-clipped and IS-weighted.

    Per token, with ratio = exp(clamp(logprobs - old_logprobs, -20, 20)) and A the advantage:
        loss_t = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    With ``clip_c`` (> 1), tokens with A < 0 take min(loss_t, -A * clip_c) (dual clip: bounds
    the loss of a negative-advantage token whose ratio exploded). ``is_weights`` (detached, e.g.
    from ``importance_weights``) multiply loss_t after clipping. Decoupled PPO for stale samples:
    old_logprobs = proximal (learner's logprobs at the start of the step), is_weights =
    importance_weights(proximal, behaviour); the naive off-policy loss is old_logprobs =
    behaviour and is_weights = None.

    Aggregation: see ``aggregate_loss`` -- pass the GLOBAL ``num_tokens`` ("token-mean") or
    ``num_seqs`` ("seq-mean-*") so that splitting the batch into micro-batches and ranks leaves
    the summed gradient unchanged.

    Metrics (0-d detached tensors, means over this call's valid tokens; call ``float()`` to log):
    pg_clipfrac_upper (A > 0 and ratio > 1 + clip_high), pg_clipfrac_lower (A < 0 and
    ratio < 1 - clip_low), dual_clipfrac (only with clip_c: A < 0 and ratio > clip_c, where the
    dual bound is active), ppo_kl (mean of old_logprobs - logprobs, log ratio clamped as
    above), ratio_mean, ratio_max.
    """
    for name, tensor in (("logprobs", logprobs), ("mask", mask)):
        _check_2d(name, tensor)
    _check_same_shape(
        "logprobs", logprobs,
        old_logprobs=old_logprobs, advantages=advantages, mask=mask, is_weights=is_weights,
    )
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1 (or None to disable dual clip), got {clip_c}")

    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if clip_c is not None:
        dual = torch.minimum(per_token, -advantages * clip_c)
        per_token = torch.where(advantages < 0, dual, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()

    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = _policy_metrics(log_ratio, advantages, mask, clip_low, clip_high, clip_c)
    return loss, metrics


@torch.no_grad()
def _policy_metrics(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> dict[str, Tensor]:
    keep = _as_bool(mask)
    ratio = log_ratio.exp()
    positive, negative = advantages > 0, advantages < 0
    ratio_valid = torch.where(keep, ratio, torch.zeros_like(ratio))  # ratios are > 0
    metrics = {
        "pg_clipfrac_upper": masked_mean((positive & (ratio > 1.0 + clip_high)).float(), keep),
        "pg_clipfrac_lower": masked_mean((negative & (ratio < 1.0 - clip_low)).float(), keep),
        "ppo_kl": masked_mean(-log_ratio, keep),
        "ratio_mean": masked_mean(ratio, keep),
        "ratio_max": ratio_valid.max() if ratio_valid.numel() else ratio_valid.sum(),
    }
    if clip_c is not None:
        metrics["dual_clipfrac"] = masked_mean((negative & (ratio > clip_c)).float(), keep)
    return {name: value.detach() for name, value in metrics.items()}


# --------------------------------------------------------------------------- off-policy weights


@torch.no_grad()
def importance_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    low: float | None = None,
) -> Tensor:
    """Detached behaviour-correction weights w = pi_prox / pi_behav, ``[B, T]``.

    level "token": w_t = exp(prox_t - behav_t). level "sequence": w = exp(sum over the
    sequence's valid tokens of (prox_t - behav_t)), broadcast to every token of the row.
    The log ratio is clamped to [-20, 20] before exp (no overflow).
    mode "truncate" (TIS): min(w, cap). mode "mask" (masked IS / IcePop): w where
    low <= w <= cap, else 0; ``low`` defaults to 1 / cap (verl's convention).
    Masked-out positions are 0. Note: a token zeroed by "mask" still counts in the caller's
    num_tokens (verl instead drops it from the loss mask, and so from the denominator).
    """
    for name, tensor in (("proximal_logprobs", proximal_logprobs), ("mask", mask)):
        _check_2d(name, tensor)
    _check_same_shape(
        "proximal_logprobs", proximal_logprobs, behavior_logprobs=behavior_logprobs, mask=mask
    )
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    lower = 1.0 / cap if low is None else low
    if not 0.0 <= lower <= cap:
        raise ValueError(f"low must be in [0, cap={cap}], got {low}")

    keep = _as_bool(mask)
    log_ratio = torch.where(
        keep, proximal_logprobs - behavior_logprobs, torch.zeros_like(proximal_logprobs)
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(proximal_logprobs)
    weights = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()

    if mode == "truncate":
        weights = weights.clamp(max=cap)
    else:
        inside = (weights >= lower) & (weights <= cap)
        weights = torch.where(inside, weights, torch.zeros_like(weights))
    return torch.where(keep, weights, torch.zeros_like(weights))


# --------------------------------------------------------------------------- monitoring


@torch.no_grad()
def entropy_and_token_prob(
    logits: Tensor, target_ids: Tensor, mask: Tensor | None = None, *, chunk_size: int = 256
) -> tuple[Tensor, Tensor]:
    """Per-token entropy of softmax(logits) and probability of the target token, ``[B, T]``.

    For monitoring (DAPO watches entropy and mean token probability); detached. Works on
    ``chunk_size`` token positions at a time in float32, so a 150k vocabulary never
    materialises a full ``[B, T, V]`` float32 softmax. Masked-out positions are 0; reduce
    with ``masked_mean``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if target_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"target_ids has shape {tuple(target_ids.shape)}, expected {tuple(logits.shape[:2])}"
        )
    _check_same_shape("target_ids", target_ids, mask=mask)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")

    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = target_ids.reshape(-1)
    entropy = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
    token_prob = torch.empty_like(entropy)
    for start in range(0, flat_targets.numel(), chunk_size):
        rows = slice(start, start + chunk_size)
        log_p = torch.log_softmax(flat_logits[rows].float(), dim=-1)
        # xlogy-style: p * log p is 0 where p underflows to 0 (log p = -inf would give NaN).
        p_log_p = torch.where(log_p.isfinite(), log_p.exp() * log_p, torch.zeros_like(log_p))
        entropy[rows] = -p_log_p.sum(dim=-1)
        token_prob[rows] = log_p.gather(-1, flat_targets[rows, None]).squeeze(-1).exp()

    entropy, token_prob = entropy.view(target_ids.shape), token_prob.view(target_ids.shape)
    if mask is not None:
        keep = _as_bool(mask)
        entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
        token_prob = torch.where(keep, token_prob, torch.zeros_like(token_prob))
    return entropy, token_prob


# --------------------------------------------------------------------------- sample filters


def keep_group(accuracies: Iterable[bool | int | float] | Tensor) -> bool:
    """Dynamic-sampling filter: keep a prompt's group only if 0 < #correct < group size.

    Filter on ACCURACY (bool or 0/1), never on the shaped reward: a +1/-1 score or an
    overlong-penalised reward is rejected with ValueError rather than silently misread.
    An empty group and a group of one are not kept (verl keeps singletons; with n = 1
    dynamic sampling must be off).
    """
    flags = accuracies.tolist() if isinstance(accuracies, Tensor) else list(accuracies)
    for value in flags:
        if value not in (0, 1):  # True/False compare equal to 1/0
            raise ValueError(
                f"accuracies must be booleans or 0/1, got {value!r}: "
                "filter on accuracy, not on the shaped reward"
            )
    correct = sum(1 for value in flags if value)
    return 0 < correct < len(flags)


def apply_overlong_filter(mask: Tensor, truncated: Tensor | Sequence[bool]) -> Tensor:
    """Overlong filtering: a copy of the ``[B, T]`` loss mask with the rows of truncated
    responses zeroed, so they contribute no loss (the caller applies it only when the flag is
    on). Apply it BEFORE counting the global num_tokens / num_seqs.
    """
    _check_2d("mask", mask)
    truncated = torch.as_tensor(truncated, device=mask.device)
    if truncated.shape != mask.shape[:1]:
        raise ValueError(
            f"truncated has shape {tuple(truncated.shape)}, expected ({mask.shape[0]},)"
        )
    keep_row = ~_as_bool(truncated)[:, None]
    return torch.where(keep_row, mask, torch.zeros_like(mask))
