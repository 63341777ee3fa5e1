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
    <run_dir>/scale.json           ``async-dapo scale``: the number of engines asked for, numbered (read by the run)
    <run_dir>/.scale.lock          taken by each ``async-dapo scale`` while it numbers and writes its request
    <run_dir>/stop.json            ``async-dapo stop``: end the run after its current step (read by the run)
    <run_dir>/batches/step_N.bin   logging.record_batches: each step's groups (wire encoding)
    <run_dir>/hf/                  checkpoint.export_hf: the final policy in HF format
    <run_dir>/checkpoints/step_N/  DCP shards, extra_rank<r>.json (async_dapo.checkpoint.rank_state), replay.json
                                   (the queue's cursor), partials.bin (the work generated and not trained yet), meta.json
    <run_dir>/checkpoints/latest.json

A checkpoint is **complete** when its ``meta.json`` (written last, atomically) names a step and its
``replay.json`` exists; an incomplete one is never resumed from, pointed at, or counted by pruning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from async_dapo.metrics import rewind_jsonl, write_atomic
from async_dapo.stream.wire import Partial, WireError, decode_message


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

    @property
    def scale_lock(self) -> Path:
        return self.path / ".scale.lock"

    def drop_scale_request(self) -> None:
        """A scale request is for the run that was running when it was made; a new or resumed run starts
        with placement.num_engines."""
        self.scale.unlink(missing_ok=True)

    @property
    def stop(self) -> Path:
        return self.path / "stop.json"

    def drop_stop_request(self) -> None:
        """A stop request ends the run that was running when it was made, not the run that resumes it."""
        self.stop.unlink(missing_ok=True)

    def stop_requested(self) -> bool:
        return self.stop.exists()

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


# Bounds on the JSON files of a checkpoint directory (which may come from someone else): far above what
# the run writes (meta.json: two numbers; replay.json: the cursor, a few bytes per training prompt).
META_MAX_BYTES, REPLAY_MAX_BYTES = 4096, 256 << 20


def read_small(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, which must be a regular file (not a symbolic link, FIFO, device or directory:
    opened without following links and without blocking, then checked) of at most ``max_bytes``.
    FileNotFoundError when it is missing; OSError naming the path and what is wrong otherwise."""
    try:
        opened = _open_regular(path)
        if opened is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        fd, size = opened
        try:
            # the size can change after fstat: read one byte past the limit to see it
            data = b"" if size > max_bytes else _read_upto(fd, max_bytes + 1)
        finally:
            os.close(fd)
        if max(size, len(data)) > max_bytes:
            raise ValueError(f"more than {max_bytes} bytes")
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise OSError(f"{path}: {_problem(exc, 'a checkpoint file')}") from None
    return data


def read_meta(ckpt: Path) -> tuple[int, int]:
    """(step, version) of a complete checkpoint."""
    meta = json.loads(read_small(ckpt / "meta.json", META_MAX_BYTES))
    return int(meta["step"]), int(meta["version"])


def read_replay_state(ckpt: Path, max_message_bytes: int, max_partials: int) -> dict:
    """The replay queue's state saved with ``ckpt``: plain JSON (cursor, version) and, in ``partials.bin``,
    the work generated and not trained yet (at most ``max_partials`` reports, each decoded and checked like a
    message off the wire within ``max_message_bytes``: no pickle; a checkpoint written before reports were
    saved has none)."""
    state = json.loads(read_small(ckpt / "replay.json", REPLAY_MAX_BYTES))
    state["partials"] = read_partials(ckpt / "partials.bin", max_message_bytes, max_partials)
    return state


def read_partials(path: Path, max_message_bytes: int, max_partials: int) -> list[Partial]:
    """The reports :func:`write_replay_state` saved (a msgpack array of wire-encoded reports); OSError naming
    the file and the entry at fault."""
    try:
        data = read_small(path, max_partials * (max_message_bytes + 8) + 8)
    except FileNotFoundError:
        return []
    try:
        entries = msgpack.unpackb(data, max_bin_len=max_message_bytes, max_array_len=max_partials, max_map_len=0,
                                  max_str_len=0, max_ext_len=0)
    except (ValueError, msgpack.UnpackException) as exc:
        raise OSError(f"{path}: not an array of at most {max_partials} reports: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, bytes) for e in entries):
        raise OSError(f"{path}: not an array of encoded reports")
    partials = []
    for i, entry in enumerate(entries):
        try:
            partial = decode_message(entry, max_message_bytes)
        except WireError as exc:
            raise OSError(f"{path}: report {i}: {exc}") from None
        if not isinstance(partial, Partial):
            raise OSError(f"{path}: report {i}: a group, not a report")
        partials.append(partial)
    return partials


def write_replay_state(ckpt: Path, replay_state: dict) -> None:
    """The queue's state (:meth:`ReplayQueue.state_dict`): its encoded reports to ``partials.bin``, then the
    rest to ``replay.json``. Each file is replaced whole; a crash between the two leaves reports for prompts
    that either cursor issues again (every prompt not trained at that step is given back in both)."""
    state = dict(replay_state)
    write_atomic(ckpt / "partials.bin", msgpack.packb(state.pop("partials", [])))
    write_atomic(ckpt / "replay.json", json.dumps(state))


def begin(ckpt: Path) -> None:
    """Mark ``ckpt`` incomplete before (re)writing it: re-saving a step must not leave old metadata over
    new shards."""
    (ckpt / "meta.json").unlink(missing_ok=True)


def commit(run: RunDir, ckpt: Path, step: int, version: int, replay_state: dict, keep_last: int) -> None:
    """Finish a checkpoint whose shards are written: the replay queue's state, then the metadata (last,
    atomically: from here on it is complete), ``latest.json``, and pruning to the newest ``keep_last``."""
    write_replay_state(ckpt, replay_state)
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
        meta = json.loads(read_small(ckpt / "meta.json", META_MAX_BYTES))
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


# ---------------------------------------------------------------------- scale requests
SCALE_MAX_BYTES = 4096  # a request is a few dozen bytes; anything bigger is not one


class ScaleRefused(ValueError):
    """scale.json cannot be taken as a request: not a regular file (a directory, a FIFO, a device, a
    symbolic link), unreadable, larger than SCALE_MAX_BYTES or not UTF-8. The message names the path and
    what is wrong."""


@dataclass(frozen=True)
class ScaleRequest:
    text: str  # the file's content; its "engines" is checked by supervise.scale_target
    seq: int | None  # the number ``async-dapo scale`` gave it (None: a hand-written request without one)


def read_scale_request(path: Path) -> ScaleRequest | None:
    """The request in ``path`` (RunDir.scale), None when there is none. It never blocks and never raises
    anything but :class:`ScaleRefused`: the run reads it between its polls, where a FIFO that blocks, or an
    error that escapes, would stop training."""
    try:
        opened = _open_regular(path)
        if opened is None:
            return None
        fd, size = opened
        try:
            if size > SCALE_MAX_BYTES:
                raise ValueError(f"{size} bytes, more than a request's {SCALE_MAX_BYTES}")
            data = _read_upto(fd, SCALE_MAX_BYTES + 1)  # the size can change after fstat: read past the limit
            if len(data) > SCALE_MAX_BYTES:
                raise ValueError(f"more than a request's {SCALE_MAX_BYTES} bytes")
            text = data.decode()
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ScaleRefused(f"{path}: {_problem(exc)}") from None
    return ScaleRequest(text, _seq_of(text))


def write_scale_request(run: RunDir, request: dict, lock_timeout_s: float = 5.0) -> ScaleRequest:
    """Number ``request`` (``seq``: one more than any request written to this run directory before) and
    write it to scale.json atomically. Numbering and writing happen under an exclusive lock on
    RunDir.scale_lock, which also keeps the last number (scale.json may be gone or unreadable), so two
    writers at once never take the same number and the later one supersedes the earlier. The lock is tried
    for ``lock_timeout_s`` (TimeoutError naming it); any other failure is an OSError naming the path."""
    fd = _take_lock(run.scale_lock, lock_timeout_s)
    try:
        try:
            current = read_scale_request(run.scale)
        except ScaleRefused:  # replaced below; its number, if any, is in the lock file too
            current = None
        seq = max(_seq_of(os.pread(fd, 64, 0).decode(errors="replace")) or 0,
                  (current.seq or 0) if current else 0) + 1
        text = json.dumps({"seq": seq, **request})
        try:
            write_atomic(run.scale, text)
        except OSError as exc:
            raise OSError(f"{run.scale}: cannot be replaced: {_problem(exc)}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"seq": seq}).encode(), 0)
        return ScaleRequest(text, seq)
    finally:
        os.close(fd)  # releases the lock


class ScaleWatch:
    """What a run has taken from scale.json: :meth:`poll` hands out each request once. A request is new when
    its bytes differ from the last one handed out or refused, not when its mtime changed: two requests can
    share an mtime (coarse timestamps, NFS), and the ``seq`` of ``async-dapo scale`` makes each write differ."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[str, str] | None = None

    def poll(self) -> ScaleRequest | None:
        """The request in the file if not handed out before, else None (also when there is none).
        ScaleRefused when it cannot be read, once per distinct problem (a FIFO left there is refused once,
        not at every poll)."""
        try:
            request = read_scale_request(self.path)
        except ScaleRefused as exc:
            if self._seen == ("refused", str(exc)):
                return None
            self._seen = ("refused", str(exc))
            raise
        if request is None or self._seen == ("request", request.text):
            return None
        self._seen = ("request", request.text)
        return request


def fleet_end(run: RunDir) -> int:
    """Where fleet.jsonl ends now: the events :func:`fleet_events` reads from here on came after."""
    try:
        st = os.stat(run.fleet, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def fleet_events(run: RunDir, offset: int, limit: int = 1 << 20) -> tuple[list[dict], int]:
    """The complete event lines of fleet.jsonl after ``offset`` (at most ``limit`` bytes of them) and the
    offset after them; never blocks. ValueError naming the path when it cannot be read."""
    try:
        opened = _open_regular(run.fleet)
        if opened is None:
            return [], offset
        fd, _ = opened
        try:
            data = os.pread(fd, limit, offset)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(f"{run.fleet}: {_problem(exc)}") from None
    whole = data[:data.rfind(b"\n") + 1]  # a line still being appended is read next time
    events = []
    for line in whole.decode(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + len(whole)


def _open_regular(path: Path) -> tuple[int, int] | None:
    """(descriptor, size) of ``path`` opened for reading, None when it does not exist; OSError or ValueError
    when it is not a regular file. O_NONBLOCK: a FIFO opens at once (and is then refused); O_NOFOLLOW: a
    symbolic link is refused (ELOOP), whatever it points at (a FIFO, /dev/zero)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file but {file_kind(st.st_mode)}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_upto(fd: int, n: int, chunk_bytes: int = 1 << 20) -> bytes:
    """At most ``n`` bytes, read a chunk at a time: ``n`` is a bound, not a size (os.read allocates what it
    is asked for, and a bound of gigabytes fails before reading a byte)."""
    chunks, got = [], 0
    while got < n and (chunk := os.read(fd, min(n - got, chunk_bytes))):
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _take_lock(path: Path, timeout_s: float) -> int:
    """An open descriptor of ``path`` holding an exclusive flock on it (closing it releases the lock). Tried
    without blocking until ``timeout_s`` passes, then TimeoutError naming the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path}: still locked after {timeout_s:g} s by another "
                                       "`async-dapo scale` (or a process that hangs holding it)") from None
                time.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise


def _seq_of(text: str) -> int | None:
    try:
        seq = json.loads(text).get("seq")
    except (ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0 else None


_FILE_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int, unknown: str | None = None) -> str:
    """What a file that is not a regular one is, in words ("a FIFO"), from its st_mode; ``unknown`` (default:
    its file type in octal) for a kind not named here. Shared with the checkpoint reader (safe_dcp)."""
    return next((name for test, name in _FILE_KINDS if test(mode)), unknown or f"file type {stat.S_IFMT(mode):o}")


def _problem(exc: BaseException, what: str = "a request") -> str:
    """What is wrong, in words: ELOOP from O_NOFOLLOW means the path is a symbolic link."""
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        if what != "a request":
            return f"a symbolic link ({what} must be a regular file)"
        return "a symbolic link (a request must be a regular file, as `async-dapo scale` writes it)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else exc.strerror
    return str(exc)
