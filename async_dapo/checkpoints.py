"""A run directory on disk: where each file of a run lives, which checkpoints are complete, what ``--resume``
continues from, pruning, and the branch a resume abandons. Both the CLI and the orchestrator use it; no
other module builds a path under ``logging.run_dir``, except the metrics writer's own files (metrics.jsonl,
tb/: async_dapo.metrics).

Layout::

    <run_dir>/config.yaml          the resolved config of the run
    <run_dir>/train.log            every log line and, on a failure, the traceback
    <run_dir>/prompts.jsonl        the (epoch, prompt index) pairs each step trained on
    <run_dir>/actors.json          process ids of the run's actors, rewritten when the engines change
    <run_dir>/fleet.jsonl          the rollout fleet's events: engines failed, replaced, added, removed
    <run_dir>/scale.json           ``async-dapo scale``: the number of engines asked for (read by the run)
    <run_dir>/batches/step_N.bin   logging.record_batches: each step's groups (wire encoding)
    <run_dir>/hf/                  checkpoint.export_hf: the final policy in HF format
    <run_dir>/checkpoints/step_N/  DCP shards, extra_rank<r>.json (async_dapo.rank_state), replay.json, meta.json
    <run_dir>/checkpoints/latest.json

A checkpoint is **complete** when its ``meta.json`` (written last, atomically) names a step and its
``replay.json`` exists; an incomplete one is never resumed from, pointed at, or counted by pruning.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from async_dapo.metrics import rewind_jsonl, write_atomic


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (see the module docstring)."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def prompts(self) -> Path:
        return self.path / "prompts.jsonl"

    @property
    def actors(self) -> Path:
        return self.path / "actors.json"

    @property
    def fleet(self) -> Path:
        return self.path / "fleet.jsonl"

    @property
    def scale(self) -> Path:
        return self.path / "scale.json"

    def drop_scale_request(self) -> None:
        """A scale request is for the run that was running when it was made; a new or resumed run starts
        with placement.num_engines."""
        self.scale.unlink(missing_ok=True)

    @property
    def hf(self) -> Path:
        return self.path / "hf"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def batch(self, step: int, root: Path | None = None) -> Path:
        """Step ``step``'s recorded batch, under this run (or under ``root``: data.replay_batches)."""
        return (root or self.path / "batches") / f"step_{step}.bin"

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"


def owning_run(path: Path) -> Path:
    """The run directory of a ``--resume`` argument: RUN_DIR itself, or the run owning
    RUN_DIR/checkpoints/step_N (one rule, used by the CLI for run_dir and by :func:`resume_target`)."""
    return path.parent.parent if _is_checkpoint_dir(path) else path


def resume_target(path: Path) -> Path:
    """The checkpoint ``--resume path`` continues from: ``path`` itself if it is a checkpoint directory (it
    must be complete), else the run's newest complete checkpoint. FileNotFoundError naming the path."""
    if _is_checkpoint_dir(path):
        if not complete(path):
            raise FileNotFoundError(f"--resume {path}: incomplete checkpoint (no valid meta.json/replay.json)")
        return path
    latest = latest_complete(RunDir(path).checkpoints)
    if latest is None:
        raise FileNotFoundError(f"--resume {path}: no complete checkpoint under {RunDir(path).checkpoints}")
    return latest


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / "meta.json").exists() or path.parent.name == "checkpoints"


def read_meta(ckpt: Path) -> tuple[int, int]:
    """(step, version) of a complete checkpoint."""
    meta = json.loads((ckpt / "meta.json").read_text())
    return int(meta["step"]), int(meta["version"])


def read_replay_state(ckpt: Path) -> dict:
    """The replay queue's state saved with ``ckpt`` (plain JSON: cursor, quarantine, counters)."""
    return json.loads((ckpt / "replay.json").read_text())


def begin(ckpt: Path) -> None:
    """Mark ``ckpt`` incomplete before (re)writing it: re-saving a step must not leave old metadata over
    new shards."""
    (ckpt / "meta.json").unlink(missing_ok=True)


def commit(run: RunDir, ckpt: Path, step: int, version: int, replay_state: dict, keep_last: int) -> None:
    """Finish a checkpoint whose shards are written: the replay queue's state, then the metadata (last,
    atomically: from here on it is complete), ``latest.json``, and pruning to the newest ``keep_last``."""
    write_atomic(ckpt / "replay.json", json.dumps(replay_state))
    meta = json.dumps({"step": step, "version": version})
    write_atomic(ckpt / "meta.json", meta)
    write_atomic(run.checkpoints / "latest.json", meta)
    prune(run.checkpoints, keep_last)


def rewind_to(run: RunDir, step: int) -> list[Path]:
    """Resuming from ``step``: the killed run's rows after it leave prompts.jsonl and metrics.jsonl (they are
    written again), and its later checkpoints are set aside (:func:`discard_later`). Returns those."""
    for path in (run.path / "metrics.jsonl", run.prompts):
        rewind_jsonl(path, step)
    return discard_later(run.checkpoints, step)


def last_checkpoint(run_dir: Path) -> str:
    """The stop line's "last checkpoint" part: the newest complete checkpoint and how to continue, or none."""
    latest = latest_complete(RunDir(run_dir).checkpoints)
    return f"{latest} (continue with --resume {run_dir})" if latest else "none"


def archive_previous_run(run_dir: Path) -> Path | None:
    """A fresh (not resumed) run must not append to an earlier run's metrics or mix checkpoints with it,
    and must not delete it either: the earlier run is renamed to ``<run_dir>.<n>`` (first free n).
    Returns the new name, or None when ``run_dir`` holds no run."""
    if not ((run_dir / "metrics.jsonl").exists() or RunDir(run_dir).checkpoints.exists()):
        return None
    n = 1
    while (moved := run_dir.with_name(f"{run_dir.name}.{n}")).exists():
        n += 1
    run_dir.rename(moved)
    return moved


def complete(ckpt: Path) -> bool:
    """A checkpoint counts only with its metadata (written last, atomically) and its replay state."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        return int(meta["step"]) >= 0 and (ckpt / "replay.json").exists()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_<N>`` checkpoint directory under ``root``, oldest first."""
    return sorted((int(p.name[5:]), p) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def latest_complete(root: Path) -> Path | None:
    done = [p for _, p in step_dirs(root) if complete(p)]
    return done[-1] if done else None


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (incomplete ones never count toward them)."""
    done = [p for _, p in step_dirs(root) if complete(p)]
    for old in done[:-keep]:
        shutil.rmtree(old)


def discard_later(root: Path, step: int) -> list[Path]:
    """Resuming from ``step`` abandons the branch after it: its checkpoints are renamed
    ``step_N.discarded-<time>`` so that neither ``--resume RUN_DIR`` nor the stop message ever points at them."""
    later = [p for n, p in step_dirs(root) if n > step]
    for p in later:
        p.rename(p.with_name(f"{p.name}.discarded-{time.strftime('%Y%m%d-%H%M%S')}"))
    return later
