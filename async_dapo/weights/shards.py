"""Per-rank shards of an FSDP2 model: build it without ever holding the whole model on one rank, and move
its weights in row shards (the learner's start-up and weight push).

FSDP2 shards every parameter along dim 0 the way ``torch.chunk(world)`` does: rank r holds rows
``[r * ceil(n / world), ...)``, the last ranks fewer (or none). :func:`shard_rows` is that rule; the
weight push's gather (weight_sync.WeightSender) pads every rank's rows to ``ceil(n / world)`` so that one
``all_gather`` per bucket moves them, and :func:`unpad` cuts the result back to the parameter.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of dim 0 that ``rank`` holds under FSDP2's ``torch.chunk`` sharding."""
    per = math.ceil(n / world) if n else 0
    start = min(rank * per, n)
    return start, min(per, n - start)


def padded_rows(n: int, world: int) -> int:
    return math.ceil(n / world) if n else 0


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Construct modules with their parameters on the meta device and their buffers real. Buffers such as
    rotary ``inv_freq`` are computed in ``__init__`` and are not in the checkpoint, so they must be built
    for real; parameters are what the checkpoint fills in (each rank only its own rows)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # a meta one is a tie: keep the same object
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate the (sharded, meta) parameters on ``device``, keeping the buffers' values (to_empty would
    leave them uninitialised)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def checkpoint_index(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF checkpoint directory (sharded or single-file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def load_local_shards(named: list[tuple[str, torch.Tensor]], path: Path, world: int, rank: int) -> int:
    """Fill every parameter's local shard from the checkpoint at ``path``, reading only this rank's rows
    (safetensors slices are read from the file, not loaded whole). ``named``: (checkpoint name, parameter)
    pairs; a parameter is an FSDP2 DTensor sharded on dim 0 or, with one rank, a plain tensor. Returns the
    bytes read. KeyError names a parameter the checkpoint lacks."""
    from safetensors import safe_open

    index = checkpoint_index(path)
    missing = [n for n, _ in named if n not in index]
    if missing:
        raise KeyError(f"{path}: checkpoint has no tensor for {missing[:5]} ({len(missing)} missing)")
    read = 0
    for name, param in named:
        local = param.to_local() if hasattr(param, "to_local") else param
        start, rows = shard_rows(param.shape[0], world if hasattr(param, "to_local") else 1, rank)
        if local.shape[0] != rows:  # not FSDP2's chunk rule: refuse rather than load the wrong rows
            raise ValueError(f"{name}: local shard has {local.shape[0]} rows, expected {rows}")
        if not rows:
            continue
        # Opened per tensor: safetensors maps the file, and the pages a slice touches count in this
        # process's memory until the mapping closes; one at a time, that is at most one tensor's slice.
        with safe_open(str(index[name]), framework="pt") as f:
            part = f.get_slice(name)[start:start + rows]
            with torch.no_grad():
                local.copy_(part)
        read += part.numel() * part.element_size()
        del part
    return read


def snapshot(local: torch.Tensor, full_rows: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows, cast to ``dtype`` and padded to ``ceil(full_rows / world)`` rows (a copy: the
    optimizer may change the parameter while the copy is being sent)."""
    out = torch.zeros((padded_rows(full_rows, world), *local.shape[1:]), dtype=dtype, device=local.device)
    out[: local.shape[0]].copy_(local.detach())
    return out


def unpad(gathered: torch.Tensor, world: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Split ``gathered`` ([world, S]: every rank's padded snapshots of one bucket, flattened and
    concatenated) into the full tensors of ``shapes``."""
    out, offset = [], 0
    for shape in shapes:
        rows = padded_rows(shape[0], world)
        width = rows * math.prod(shape[1:])
        part = gathered[:, offset:offset + width].reshape(world * rows, *shape[1:])
        out.append(part[: shape[0]])
        offset += width
    return out
