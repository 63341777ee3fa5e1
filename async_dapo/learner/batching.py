"""Learner work plan: rollout groups -> per-sample tensors -> mini-batches -> ranks -> micro-batches.

Pure torch/numpy, no Ray, no torch.distributed, no model. One training step of the learner is

    groups --samples_from_groups--> TrainSample list (GRPO advantages from the shaped rewards)
           --mini_batches--> whole groups per optimizer update
           --split_for_ranks--> token-balanced share of each data-parallel rank
           --pack_micro_batches--> micro-batches whose PADDED size fits a token budget
           --collate--> padded tensors (MicroBatch)

``plan_step`` chains these for one rank. Every function is deterministic, so all ranks computing
the plan from the same groups agree on the split and on the GLOBAL denominators (``num_tokens`` /
``num_seqs`` of the whole mini-batch, ``valid_token_count`` / ``valid_seq_count``) without any
communication; passing those to ``loss.policy_loss`` makes the summed gradient independent of the
split (see the aggregation contract in ``async_dapo.learner.loss``).

Alignment convention (``collate``): a row is ``input_ids = prompt (P) ++ response (L) ++ pad``. The
learner computes ``logprobs = log_softmax(logits[:, :-1] / temperature).gather(-1, targets)`` with
``targets = input_ids[:, 1:]``, i.e. column t of every ``[n, T-1]`` tensor is about the token at
input position t + 1. Response token k (0-based) is predicted at column ``P - 1 + k``, so the
response occupies columns ``P-1 .. P+L-2``; ``loss_mask``, ``advantages``, ``behav_logprobs`` and
``versions`` are set exactly there (``versions`` is -1 and the others 0/False elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from async_dapo.learner.loss import apply_overlong_filter, group_advantages
from async_dapo.stream.wire import Group

__all__ = [
    "MicroBatch",
    "PlannedMiniBatch",
    "TrainSample",
    "collate",
    "mini_batches",
    "pack_micro_batches",
    "padding_micro_batch",
    "plan_step",
    "samples_from_groups",
    "split_for_ranks",
    "valid_seq_count",
    "valid_token_count",
]


# ------------------------------------------------------------------------------------ samples
# eq=False: fields are tensors (dataclass __eq__ would compare them elementwise and fail); two
# samples are the same only if they are the same object.
@dataclass(frozen=True, eq=False)
class TrainSample:
    """One response with its prompt, ready for the learner (CPU tensors)."""

    input_ids: Tensor  # int64 [P + L]: prompt then response
    prompt_len: int
    response_len: int
    advantage: float
    behav_logprobs: Tensor  # float32 [L]: behaviour-policy logprob of each response token
    versions: Tensor  # int64 [L]: policy version that generated each response token
    truncated: bool
    group: int  # index of its group in the batch
    reward: float  # shaped reward the advantage was computed from
    acc: bool

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len

    def contributes(self, *, overlong_filtering: bool) -> bool:
        """True if the sample has at least one loss-bearing token."""
        return self.response_len > 0 and not (overlong_filtering and self.truncated)


def samples_from_groups(
    groups: Sequence[Group], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[TrainSample]:
    """Flatten ``groups`` into TrainSamples, group by group and sample by sample.

    Advantages come from ONE ``group_advantages`` call over the whole batch (group ids = position
    in ``groups``) on the samples' shaped ``reward``. A sample with an empty response is kept (it
    still counts for its group's mean/std) but contributes no token.
    """
    rewards = [s.reward for g in groups for s in g.samples]
    group_ids = [i for i, g in enumerate(groups) for _ in g.samples]
    if not rewards:
        return []
    advantages = group_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(group_ids, dtype=torch.int64),
        eps=eps,
        scale_by_std=scale_by_std,
    ).tolist()

    out: list[TrainSample] = []
    for index, group in enumerate(groups):
        prompt = np.asarray(group.prompt_ids, dtype=np.int64)
        for sample in group.samples:
            response = np.asarray(sample.response_ids, dtype=np.int64)
            out.append(
                TrainSample(
                    # concatenate/astype copy: wire arrays may be read-only views of message bytes.
                    input_ids=torch.from_numpy(np.concatenate([prompt, response])),
                    prompt_len=int(prompt.shape[0]),
                    response_len=int(response.shape[0]),
                    advantage=float(advantages[len(out)]),
                    behav_logprobs=torch.from_numpy(sample.logprobs.astype(np.float32, copy=True)),
                    versions=torch.from_numpy(sample.versions.astype(np.int64, copy=True)),
                    truncated=bool(sample.truncated),
                    group=index,
                    reward=float(sample.reward),
                    acc=bool(sample.acc),
                )
            )
    return out


# ------------------------------------------------------------------------------------ splitting
def mini_batches(
    samples: Sequence[TrainSample], groups_per_mini_batch: int
) -> list[list[TrainSample]]:
    """Consecutive chunks of whole groups: the k-th distinct group (by ascending ``group``; for
    ``samples_from_groups`` output that is group k) goes to mini-batch k // groups_per_mini_batch.
    Samples keep their input order within a mini-batch.
    """
    if groups_per_mini_batch < 1:
        raise ValueError(f"groups_per_mini_batch must be >= 1, got {groups_per_mini_batch}")
    group_ids = sorted({s.group for s in samples})
    if len(group_ids) % groups_per_mini_batch:
        raise ValueError(
            f"groups_per_mini_batch={groups_per_mini_batch} does not divide the number of "
            f"groups ({len(group_ids)})"
        )
    slot = {g: k // groups_per_mini_batch for k, g in enumerate(group_ids)}
    out: list[list[TrainSample]] = [[] for _ in range(len(group_ids) // groups_per_mini_batch)]
    for sample in samples:
        out[slot[sample.group]].append(sample)
    return out


def split_for_ranks(samples: Sequence[TrainSample], world_size: int) -> list[list[TrainSample]]:
    """Token-balanced, deterministic split of one mini-batch across ``world_size`` ranks.

    Greedy longest-processing-time on ``length``: samples in descending length (ties: input order)
    each go to the least-loaded rank (ties: lowest rank). Within a rank the input order is kept.
    Guarantee: max rank load - min rank load <= the longest sample's length.

    A rank may get NO samples (fewer samples than ranks). It must still take part in every
    collective of the step (FSDP all-gathers / reduce-scatters, loss all-reduces): run padding
    micro-batches (``padding_micro_batch``; ``plan_step`` does this) instead of skipping.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].length, i))
    loads = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += samples[i].length
        assigned[rank].append(i)
    return [[samples[i] for i in sorted(idx)] for idx in assigned]


def pack_micro_batches(
    samples: Sequence[TrainSample], token_budget: int
) -> list[list[TrainSample]]:
    """Pack one rank's share into micro-batches with padded cost ``len(mb) * max length`` <= budget.

    Samples are sorted by length descending (ties: input order) so each micro-batch pads only to
    its own longest sample, which is its first. A sample longer than the budget sits alone. With
    descending order, filling micro-batches one after another is the same as first-fit: a later
    micro-batch never has room that an earlier one lacked for the next sample.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    ordered = sorted(range(len(samples)), key=lambda i: (-samples[i].length, i))
    out: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    for i in ordered:
        sample = samples[i]
        if current and (len(current) + 1) * current[0].length > token_budget:
            out.append(current)
            current = []
        current.append(sample)
    if current:
        out.append(current)
    return out


# ------------------------------------------------------------------------------------ counts
def valid_token_count(samples: Sequence[TrainSample], *, overlong_filtering: bool) -> int:
    """Loss-bearing response tokens of ``samples``: pass the count over the WHOLE mini-batch (all
    ranks) as ``policy_loss(num_tokens=...)``. Truncated samples count 0 under overlong filtering.
    May be 0 (everything filtered): the loss is then 0 and the learner passes max(count, 1).
    """
    return sum(s.response_len for s in samples if s.contributes(overlong_filtering=overlong_filtering))


def valid_seq_count(samples: Sequence[TrainSample], *, overlong_filtering: bool) -> int:
    """Sequences with at least one loss-bearing token (``policy_loss(num_seqs=...)``, seq-mean modes)."""
    return sum(1 for s in samples if s.contributes(overlong_filtering=overlong_filtering))


# ------------------------------------------------------------------------------------ collation
@dataclass
class MicroBatch:
    """Padded tensors of one forward/backward; ``[n, T-1]`` tensors follow the module's alignment."""

    input_ids: Tensor  # int64 [n, T], right-padded with pad_id
    attention_mask: Tensor  # int64 [n, T]
    targets: Tensor  # int64 [n, T-1] = input_ids[:, 1:]
    loss_mask: Tensor  # bool [n, T-1]
    advantages: Tensor  # float32 [n, T-1]
    behav_logprobs: Tensor  # float32 [n, T-1]
    versions: Tensor  # int64 [n, T-1], -1 off the response
    num_tokens: int  # loss-bearing tokens here (loss_mask.sum())
    num_seqs: int = 0  # rows with at least one loss-bearing token
    is_padding: bool = False  # a stand-in that keeps collectives in step; contributes nothing

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> MicroBatch:
        """A copy with every tensor on ``device``."""
        move = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in _TENSOR_FIELDS
        }
        return MicroBatch(
            **move, num_tokens=self.num_tokens, num_seqs=self.num_seqs, is_padding=self.is_padding
        )


_TENSOR_FIELDS = (
    "input_ids", "attention_mask", "targets", "loss_mask", "advantages", "behav_logprobs", "versions",
)


def collate(samples: Sequence[TrainSample], *, pad_id: int, overlong_filtering: bool) -> MicroBatch:
    """Right-pad ``samples`` to their own longest length and align per-token data to the targets."""
    if not samples:
        raise ValueError("collate needs at least one sample (use padding_micro_batch for an empty rank)")
    n, width = len(samples), max(s.length for s in samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((n, width), dtype=torch.int64)
    span = torch.zeros((n, width - 1), dtype=torch.bool)
    advantages = torch.zeros((n, width - 1), dtype=torch.float32)
    behav_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    versions = torch.full((n, width - 1), -1, dtype=torch.int64)
    for row, s in enumerate(samples):
        input_ids[row, : s.length] = s.input_ids
        attention_mask[row, : s.length] = 1
        # Column t predicts input position t + 1, so response token k sits at column P - 1 + k.
        cols = slice(s.prompt_len - 1, s.prompt_len - 1 + s.response_len)
        span[row, cols] = True
        advantages[row, cols] = s.advantage
        behav_logprobs[row, cols] = s.behav_logprobs
        versions[row, cols] = s.versions

    loss_mask = span
    if overlong_filtering:
        loss_mask = apply_overlong_filter(span, [s.truncated for s in samples])
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        advantages=advantages,
        behav_logprobs=behav_logprobs,
        versions=versions,
        num_tokens=valid_token_count(samples, overlong_filtering=overlong_filtering),
        num_seqs=valid_seq_count(samples, overlong_filtering=overlong_filtering),
    )


def padding_micro_batch(template: TrainSample, *, pad_id: int) -> MicroBatch:
    """A one-row micro-batch that contributes nothing: the first (up to) two tokens of ``template``
    (real tokens, attention on, so the forward is numerically ordinary) with the loss mask all
    False. A rank with fewer micro-batches than another runs these so that every rank performs
    the same number of forward/backward passes (FSDP collectives must match across ranks).
    """
    stub = TrainSample(
        input_ids=template.input_ids[: min(template.length, 2)].clone(),
        prompt_len=min(template.length, 2),
        response_len=0,
        advantage=0.0,
        behav_logprobs=torch.zeros(0, dtype=torch.float32),
        versions=torch.zeros(0, dtype=torch.int64),
        truncated=False,
        group=template.group,
        reward=0.0,
        acc=False,
    )
    batch = collate([stub], pad_id=pad_id, overlong_filtering=False)
    batch.is_padding = True
    return batch


# ------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class PlannedMiniBatch:
    """One optimizer update as seen by one rank."""

    micro_batches: list[MicroBatch]  # this rank's, collated; padded to the max count over ranks
    num_tokens: int  # GLOBAL valid tokens of the mini-batch (all ranks): policy_loss(num_tokens=)
    num_seqs: int  # GLOBAL valid sequences of the mini-batch: policy_loss(num_seqs=)
    samples: list[TrainSample] = field(default_factory=list)  # this rank's share (metrics)
    num_samples: int = 0  # GLOBAL samples in the mini-batch


def plan_step(
    groups: Sequence[Group],
    *,
    world_size: int,
    rank: int,
    groups_per_mini_batch: int,
    token_budget: int,
    pad_id: int,
    overlong_filtering: bool,
    scale_by_std: bool = True,
    equalize_micro_batches: bool = True,
) -> list[PlannedMiniBatch]:
    """This rank's plan for one pass over ``groups`` (the learner repeats it for each of the mu
    epochs). Deterministic: every rank calling it with the same inputs gets the same split and the
    same global counts, no communication needed.

    With ``equalize_micro_batches`` (default), each rank's micro-batch list of a mini-batch is
    extended with ``padding_micro_batch`` entries to the largest count over all ranks, so every
    rank runs the same number of forward/backward passes (a rank without samples runs only
    padding). The global counts may be 0 when every sample is filtered.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    samples = samples_from_groups(groups, scale_by_std=scale_by_std)
    plan: list[PlannedMiniBatch] = []
    for batch in mini_batches(samples, groups_per_mini_batch):
        shares = split_for_ranks(batch, world_size)
        packed = [pack_micro_batches(share, token_budget) for share in shares]
        micro = [
            collate(mb, pad_id=pad_id, overlong_filtering=overlong_filtering) for mb in packed[rank]
        ]
        if equalize_micro_batches:
            # The shortest sample of the mini-batch: the same cheap stand-in on every rank.
            template = min(batch, key=lambda s: s.length)
            target = max(len(p) for p in packed)
            micro += [padding_micro_batch(template, pad_id=pad_id) for _ in range(target - len(micro))]
        plan.append(
            PlannedMiniBatch(
                micro_batches=micro,
                num_tokens=valid_token_count(batch, overlong_filtering=overlong_filtering),
                num_seqs=valid_seq_count(batch, overlong_filtering=overlong_filtering),
                samples=shares[rank],
                num_samples=len(batch),
            )
        )
    return plan
