"""The learner end of the weight-update process group (learner rank 0 + every engine rank).

SGLang's ``init_weights_update_group`` builds its side of the group with a TCP rendezvous, a
``PrefixStore(group_name, store)`` and torch's process-group helper; :func:`open_update_group` builds the
matching rank-0 side the same way without importing sglang. Tensors then go out with one broadcast each,
in exactly the order of the names/dtypes/shapes the engines were told over the control plane (Ray).
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous


@dataclass(frozen=True)
class TensorMeta:
    """What an engine needs to allocate a received tensor: name, dtype name (e.g. 'float32'), shape."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> "TensorMeta":
        return cls(
            names=[n for n, _ in named],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
            shapes=[list(t.shape) for _, t in named],
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_update_group(
    master_addr: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float
):
    """Rank 0 of the weight-update group. Blocks until every engine rank has joined (each engine calls
    ``init_weights_update_group(..., rank_offset=1)`` concurrently)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{master_addr}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=timeout,
    )
    # Registered like SGLang's side, so dist.broadcast(group=pg) accepts it.
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def broadcast_tensors(pg, tensors: list[torch.Tensor]) -> None:
    """Send each tensor from rank 0, in order; returns when all sends completed (the buffers may then
    be changed again)."""
    handles = [dist.broadcast(t.contiguous(), src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def close_update_group(pg) -> None:
    dist.destroy_process_group(pg)
