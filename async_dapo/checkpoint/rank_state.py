"""A learner rank's resume state beside its DCP shards (LR schedule, counters, RNG states) as plain JSON.

It used to be a ``torch.save`` pickle read back with ``weights_only=False``: resuming from a checkpoint
directory someone else wrote ran whatever code their pickle named. ``json.loads`` builds only dicts,
lists, strings, numbers, booleans and None, and every value is checked against the shape it must have
before any state is set, so a hostile file can at worst be refused, or restore a wrong schedule, counter or
RNG state.

``extra_rank{rank}.json``::

    {"format": 1, "version": int, "skipped_updates": int,
     "scheduler": LambdaLR.state_dict() (lists, numbers, booleans; its lambda is stored as None),
     "torch_rng": torch.get_rng_state() as a list of byte values,
     "python_rng": random.getstate() as [version, [625 ints], gauss_next or None]}

numpy's global RNG is seeded at start-up (device.seed_everything) but nothing in the learner draws from it,
so it is not part of the state; nor is the CUDA RNG (it was not before either): the learner draws nothing
from it (the models here have no dropout). Python floats go through ``repr``, so JSON round-trips them exactly and the
restored schedule is bit-identical.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

from async_dapo.checkpoint.run_dir import read_small

STATE_MAX_BYTES = 16 << 20  # a rank's schedule and RNG states are a few KiB

FORMAT = 1
_KEYS = {"format", "version", "skipped_updates", "scheduler", "torch_rng", "python_rng"}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message starts with the file's path."""


def state_path(ckpt: str | Path, rank: int) -> Path:
    return Path(ckpt) / f"extra_rank{rank}.json"


def capture(scheduler_state: dict[str, Any], version: int, skipped_updates: int) -> dict[str, Any]:
    """This process's torch (CPU) and python RNG states with the given schedule and counters, as JSON values."""
    py_version, internal, gauss = random.getstate()
    return {"format": FORMAT, "version": version, "skipped_updates": skipped_updates, "scheduler": scheduler_state,
            "torch_rng": torch.get_rng_state().tolist(), "python_rng": [py_version, list(internal), gauss]}


def write(path: Path, state: dict[str, Any]) -> None:
    """Atomically (a torn file would fail the resume's checks, but never half-apply)."""
    text = json.dumps(state, allow_nan=False)  # a value JSON cannot hold fails here, at save, not at resume
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any]:
    """The checked state in ``path``. Never unpickles: the pickle an older version wrote is refused."""
    if not path.exists():
        legacy = path.with_suffix(".pt")
        if legacy.exists():
            raise CheckpointError(f"{path}: missing; {legacy.name} beside it is the pickle an older version wrote, "
                                  "and it is not loaded because unpickling a file runs any code it names")
        raise CheckpointError(f"{path}: missing (not a learner checkpoint of this version)")
    try:
        state = json.loads(read_small(path, STATE_MAX_BYTES))
    except OSError as exc:  # not a regular file, too big: it names the path
        raise CheckpointError(str(exc)) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a JSON rank state ({exc})") from None
    _check(path, state)
    return state


def restore(path: Path, state: dict[str, Any], scheduler) -> tuple[int, int]:
    """Set the schedule and this process's RNG states from ``state`` (read from ``path``); returns
    (version, skipped_updates)."""
    unknown = set(state["scheduler"]) - set(scheduler.state_dict())
    if unknown or "lr_lambdas" not in state["scheduler"]:  # load_state_dict sets every key as an attribute
        raise CheckpointError(f"{path}: scheduler state must have lr_lambdas and no keys beyond "
                              f"{sorted(scheduler.state_dict())}, got {sorted(state['scheduler'])}")
    try:
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        py_version, internal, gauss = state["python_rng"]
        random.setstate((py_version, tuple(internal), gauss))
    except (TypeError, ValueError, RuntimeError) as exc:  # a state that passed _check but the RNG refuses
        raise CheckpointError(f"{path}: rank state not restorable ({exc})") from None
    return state["version"], state["skipped_updates"]


def _check(path: Path, state: Any) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    if not isinstance(state, dict) or set(state) != _KEYS:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise bad(f"expected the keys {sorted(_KEYS)}, got {got}")
    if state["format"] != FORMAT:
        raise bad(f"format {state['format']!r}, this version reads format {FORMAT}")
    for key in ("version", "skipped_updates"):
        if not _is_int(state[key]) or state[key] < 0:
            raise bad(f"{key} must be an integer >= 0, got {state[key]!r}")
    if not isinstance(state["scheduler"], dict):
        raise bad("scheduler must be an object")
    rng, size = state["torch_rng"], torch.get_rng_state().numel()
    if not isinstance(rng, list) or len(rng) != size or not all(_is_int(b) and 0 <= b < 256 for b in rng):
        raise bad(f"torch_rng must be {size} byte values")
    py = state["python_rng"]
    if not (isinstance(py, list) and len(py) == 3 and _is_int(py[0]) and isinstance(py[1], list)
            and all(_is_int(x) for x in py[1]) and (py[2] is None or isinstance(py[2], float))):
        raise bad("python_rng must be [version, [ints], gauss_next or null] (random.getstate())")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
