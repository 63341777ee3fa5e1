"""The learner end of the weight-update process group (learner rank 0 + every engine rank).

SGLang's ``init_weights_update_group`` builds its side of the group with a TCP rendezvous, a
``PrefixStore(group_name, store)`` and torch's process-group helper; :func:`open_update_group` builds the
matching rank-0 side the same way without importing sglang. Parameters then go out in buckets, one flat
broadcast per bucket, in exactly the order of the bucket metadata (names, dtypes, shapes) the engines were
given first over the control plane (Ray).
"""

from __future__ import annotations

import datetime
import math
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


@dataclass(frozen=True)
class Bucket:
    """One broadcast's worth of parameters: what an engine needs to allocate and split the flat buffer
    (SGLang's ``load_format="flattened_bucket"``: the tensors' bytes concatenated in this order)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names without the "torch." prefix, e.g. "float32"
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * getattr(torch, d).itemsize for d, s in zip(self.dtypes, self.shapes))


def plan_buckets(meta: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Group (name, dtype, shape) into buckets of at most ``bucket_bytes`` (a larger tensor gets its own),
    in order, one dtype per bucket so every tensor's byte offset stays aligned to its itemsize."""
    buckets: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    size = 0
    for name, dtype, shape in meta:
        nbytes = math.prod(shape) * dtype.itemsize
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][-1][1] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, dtype, tuple(shape)))
        size += nbytes
    return [
        Bucket(tuple(n for n, _, _ in b), tuple(str(d).removeprefix("torch.") for _, d, _ in b),
               tuple(s for _, _, s in b))
        for b in buckets
    ]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` back to back (uint8), the layout SGLang's flattened bucket expects."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_update_group(
    master_addr: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float,
    rank: int = 0,
):
    """Rank 0 (the learner) of the weight-update group; blocks until every engine rank has joined (each
    engine calls ``init_weights_update_group(..., rank_offset=1)`` concurrently), at most ``timeout_s``.
    Tests open a receiving rank the same way (``rank`` > 0)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{master_addr}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=timeout,
    )
    # Registered like SGLang's side, so dist.broadcast(group=pg) accepts it.
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def broadcast_bucket(pg, tensors: list[torch.Tensor]) -> int:
    """Send one bucket from rank 0 as a single flat broadcast; returns the bytes sent when the send has
    completed (the source tensors may then change again)."""
    flat = flatten(tensors)
    dist.broadcast(flat, src=0, group=pg)
    return flat.numel()


def close_update_group(pg) -> None:
    dist.destroy_process_group(pg)
