"""DAPO learner math: group advantages, the clipped (and importance-corrected) policy loss,
its aggregation, entropy / token-probability monitoring, and the overlong sample filter (the
dynamic-sampling group filter is the replay queue's: ``replay.keeps_group``).

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

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "apply_overlong_filter",
    "entropy_and_token_prob",
    "group_advantages",
    "importance_weights",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
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

    Metrics (0-d detached tensors, means over this call's valid tokens; call ``float()`` to log;
    the keys named as verl's are computed as verl's ``compute_policy_loss_vanilla`` does):
    pg_clipfrac (verl's: the clipped term is taken, -A * clamp(ratio) > -A * ratio, either side),
    pg_clipfrac_upper (A > 0 and ratio > 1 + clip_high: Clip-Higher's side),
    pg_clipfrac_low_side (A < 0 and ratio < 1 - clip_low; pg_clipfrac = upper + low_side),
    pg_clipfrac_lower (verl's: the DUAL clip is taken, A < 0 and
    max(-A * ratio, -A * clamp(ratio)) > -A * clip_c, i.e. ratio > clip_c; 0 when clip_c is None,
    where verl, which always dual-clips at clip_ratio_c = 3, would count those tokens),
    ppo_kl (mean of old_logprobs - logprobs, log ratio clamped as above), ratio_mean, ratio_max.
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
    # verl's comparisons, on the same terms as policy_loss (pg_losses1, pg_losses2, clip_pg_losses1).
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    if clip_c is None:  # no dual clip: it never engages
        dual = torch.zeros_like(keep)
    else:
        dual = negative & (torch.maximum(unclipped, clipped) > -advantages * clip_c)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), keep),
        "pg_clipfrac_upper": masked_mean((positive & (ratio > 1.0 + clip_high)).float(), keep),
        "pg_clipfrac_low_side": masked_mean((negative & (ratio < 1.0 - clip_low)).float(), keep),
        "pg_clipfrac_lower": masked_mean(dual.float(), keep),
        "ppo_kl": masked_mean(-log_ratio, keep),
        "ratio_mean": masked_mean(ratio, keep),
        "ratio_max": ratio_valid.max() if ratio_valid.numel() else ratio_valid.sum(),
    }
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


# --------------------------------------------------------------------------- log-probs


def _check_logits(logits: Tensor, targets_name: str, targets: Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if targets.shape != logits.shape[:2]:
        raise ValueError(
            f"{targets_name} has shape {tuple(targets.shape)}, expected {tuple(logits.shape[:2])}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"{targets_name} must hold integer token ids, got {targets.dtype}")


def _check_chunk_and_temperature(chunk_name: str, chunk: int, temperature: float) -> None:
    if chunk <= 0:
        raise ValueError(f"{chunk_name} must be > 0, got {chunk}")
    if not temperature > 0:  # also refuses NaN
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _token_chunks(logits: Tensor, chunk: int) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, stop, rows): the ``[stop - start, V]`` logits of flattened token positions
    start..stop. A view when ``logits`` flattens without a copy; otherwise (the learner's
    ``out.logits[:, :-1]``) a copy of only those rows, since flattening the whole view would
    copy all of it.
    """
    batch, seq, vocab = logits.shape
    n = batch * seq
    try:
        flat = logits.view(n, vocab)
    except RuntimeError:
        flat = None
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        if flat is not None:
            yield start, stop, flat[start:stop]
            continue
        pieces = [
            logits[b, max(start - b * seq, 0) : stop - b * seq]
            for b in range(start // seq, (stop - 1) // seq + 1)
        ]
        yield start, stop, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _scaled(rows: Tensor, temperature: float) -> Tensor:
    """fp32 logits / T. At T == 1 an fp32 input is returned as is (no chunk-sized copy)."""
    rows = rows.float()
    return rows if temperature == 1.0 else rows / temperature


class _TokenLogprobs(torch.autograd.Function):
    """Chunked log_softmax(logits / T)[target]; see ``token_logprobs``."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int) -> Tensor:
        flat_targets = targets.reshape(-1)
        logsumexp = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
        logprobs = torch.empty_like(logsumexp)
        for start, stop, rows in _token_chunks(logits, chunk):
            scaled = _scaled(rows, temperature)
            # (z_y - max) - log sum exp(z - max): log_softmax's own order of operations, so the
            # result matches it to rounding rather than to rounding of |logsumexp|.
            top = scaled.amax(dim=-1, keepdim=True)
            log_sum = (scaled - top).exp_().sum(dim=-1).log_()
            target = scaled.gather(-1, flat_targets[start:stop, None])
            logprobs[start:stop] = (target - top).squeeze(-1) - log_sum
            logsumexp[start:stop] = top.squeeze(-1) + log_sum
        # Saving the input logits keeps a reference, not a copy; the fp32 softmax is recomputed.
        ctx.save_for_backward(logits, flat_targets, logsumexp)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logprobs.view(targets.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, flat_targets, logsumexp = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        temperature = ctx.temperature
        # d/dz of (z_y / T - logsumexp(z / T)) = (onehot(y) - softmax(z / T)) / T.
        scale = grad_out.reshape(-1).float() / temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        for start, stop, rows in _token_chunks(logits, ctx.chunk):
            g = scale[start:stop, None]
            chunk_grad = (_scaled(rows, temperature) - logsumexp[start:stop, None]).exp_()
            chunk_grad.mul_(-g).scatter_add_(-1, flat_targets[start:stop, None], g)
            flat_grad[start:stop] = chunk_grad
        return grad, None, None, None


def token_logprobs(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0, chunk_tokens: int = 1024
) -> Tensor:
    """Log-probability of each target token, float32 ``[B, T]``, differentiable w.r.t. logits.

    Equals ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None])
    .squeeze(-1)``: exactly the log-prob the behaviour policy reports (SGLang samples from and
    reports ``log_softmax(logits / T)``), so pass the RAW logits ``[B, T, V]`` (any float
    dtype, views such as ``out.logits[:, :-1]`` welcome) and the sampling ``temperature``.

    Memory contract: ``chunk_tokens`` flattened token positions are upcast to float32 at a
    time. Forward keeps only the logits (a reference, not a copy) and a float32 logsumexp per
    token; backward recomputes the softmax chunk by chunk and writes one gradient of the
    logits' dtype and shape. Beyond the logits and that gradient, peak extra memory is
    O(chunk_tokens x V) float32: never a full-vocabulary float32 ``[B * T, V]`` (~20 GB for
    32k tokens at V = 152k). Target ids are not range-checked (that would sync the device).
    """
    _check_logits(logits, "targets", targets)
    _check_chunk_and_temperature("chunk_tokens", chunk_tokens, temperature)
    return _TokenLogprobs.apply(logits, targets.long(), float(temperature), int(chunk_tokens))


# --------------------------------------------------------------------------- monitoring


@torch.no_grad()
def entropy_and_token_prob(
    logits: Tensor,
    target_ids: Tensor,
    mask: Tensor | None = None,
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Per-token entropy of softmax(logits / temperature) and probability of the target token,
    ``[B, T]``.

    For monitoring (DAPO watches entropy and mean token probability); detached. Works on
    ``chunk_size`` token positions at a time in float32, so a 150k vocabulary never
    materialises a full ``[B, T, V]`` float32 softmax; pass the raw logits (any float dtype,
    views such as ``out.logits[:, :-1]`` are not copied whole) and the sampling temperature.
    Masked-out positions are 0; reduce with ``masked_mean``.
    """
    _check_logits(logits, "target_ids", target_ids)
    _check_same_shape("target_ids", target_ids, mask=mask)
    _check_chunk_and_temperature("chunk_size", chunk_size, temperature)

    flat_targets = target_ids.reshape(-1).long()
    entropy = torch.empty(flat_targets.shape, dtype=torch.float32, device=logits.device)
    token_prob = torch.empty_like(entropy)
    for start, stop, rows in _token_chunks(logits, chunk_size):
        log_p = torch.log_softmax(_scaled(rows, temperature), dim=-1)
        # xlogy-style: p * log p is 0 where p underflows to 0 (log p = -inf would give NaN).
        p_log_p = torch.where(log_p.isfinite(), log_p.exp() * log_p, torch.zeros_like(log_p))
        entropy[start:stop] = -p_log_p.sum(dim=-1)
        token_prob[start:stop] = log_p.gather(-1, flat_targets[start:stop, None]).squeeze(-1).exp()

    entropy, token_prob = entropy.view(target_ids.shape), token_prob.view(target_ids.shape)
    if mask is not None:
        keep = _as_bool(mask)
        entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
        token_prob = torch.where(keep, token_prob, torch.zeros_like(token_prob))
    return entropy, token_prob


# --------------------------------------------------------------------------- sample filter


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
