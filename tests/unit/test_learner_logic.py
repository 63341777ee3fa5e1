"""The learner's pure pieces: the warm-up in training steps, the padding count, and FSDP2's row sharding
rule that the sharded start-up and the push's gather rely on."""

import torch

from async_dapo.learner.batching import MicroBatch, PlannedMiniBatch
from async_dapo.learner.rank import pad_counts, warmup_factor
from async_dapo.weights.shards import padded_rows, shard_rows, snapshot, unpad


def test_warmup_counts_training_steps_from_zero_like_verl():
    # verl's constant-with-warmup schedule, stepped once per training step: lr * step / warmup.
    assert [warmup_factor(s, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def _mb(mask_rows: list[list[int]], *, is_padding: bool = False) -> MicroBatch:
    mask = torch.tensor(mask_rows)
    n, t = mask.shape
    z = torch.zeros(n, t - 1)
    return MicroBatch(input_ids=torch.zeros(n, t, dtype=torch.long), attention_mask=mask,
                      targets=torch.zeros(n, t - 1, dtype=torch.long), loss_mask=z.bool(), advantages=z,
                      behav_logprobs=z, versions=z.long(), num_tokens=0, is_padding=is_padding)


def test_pad_counts_counts_masked_positions_and_whole_stand_in_batches():
    plan = [PlannedMiniBatch(micro_batches=[_mb([[1, 1, 1, 0], [1, 1, 0, 0]])], num_tokens=1, num_seqs=1),
            PlannedMiniBatch(micro_batches=[_mb([[1, 1]], is_padding=True)], num_tokens=1, num_seqs=1)]
    # 8 + 2 positions; 3 masked in the first, the stand-in's 2 all count as padding.
    assert pad_counts(plan) == {"pad_tokens": 5.0, "slot_tokens": 10.0}


def test_shard_rows_is_torch_chunk():
    for n in (0, 1, 5, 7, 8, 152064):
        for world in (1, 2, 3, 4, 64):
            chunks = torch.arange(n).chunk(world) if n else ()
            got = [shard_rows(n, world, r) for r in range(world)]
            want = [(int(c[0]), len(c)) for c in chunks] + [(n, 0)] * (world - len(chunks))
            assert got == want, (n, world)


def test_padded_snapshots_gather_back_to_the_full_tensors():
    world = 3
    full = [torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2), torch.arange(2, dtype=torch.float32)]
    per_rank = []
    for r in range(world):
        parts = []
        for t in full:
            start, rows = shard_rows(t.shape[0], world, r)
            parts.append(snapshot(t[start:start + rows], t.shape[0], world, torch.bfloat16).reshape(-1))
        per_rank.append(torch.cat(parts))
    assert padded_rows(7, 3) == 3 and per_rank[2][:6].tolist() == [12, 13, 0, 0, 0, 0]  # rank 2: 1 row + pad
    out = unpad(torch.stack(per_rank), world, [tuple(t.shape) for t in full])
    assert [o.dtype for o in out] == [torch.bfloat16] * 2
    assert all(torch.equal(o.float(), t) for o, t in zip(out, full))
