"""Memory probes for tests (Linux /proc): peak resident memory since a reset, here or in a child.

``ru_maxrss`` is a lifetime high-water mark: once an earlier test in the same process pushed it
up, a later test's growth below that mark never shows. Writing "5" to ``/proc/<pid>/clear_refs``
resets the mark (VmHWM := VmRSS), so ``PeakGrowth`` measures the peak of one block of code.

``ReceiverProcess`` runs a ``GroupReceiver`` in a fresh spawned process, so what the test's own
process allocates (senders' queues, test data) is not counted: its peak is the receiver's alone.
Every call to the child is bounded by a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

KIB = 1024
MIB = 1024 * KIB


def status_kib(field: str, pid: int | str = "self") -> int:
    """A ``VmXxx`` line of /proc/<pid>/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/{pid}/status")


def reset_peak(pid: int | str = "self") -> int:
    """Reset VmHWM to the current VmRSS; return that (bytes)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_kib("VmRSS", pid) * KIB


class PeakGrowth:
    """``with PeakGrowth() as m: ...`` then ``m.bytes``: the peak RSS inside the block minus RSS at its start."""

    def __enter__(self) -> PeakGrowth:
        self.start = reset_peak()
        self.bytes = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = status_kib("VmHWM") * KIB - self.start


# ------------------------------------------------------------------------ receiver in a child process
def _status(rx: Any, _: Any) -> dict[str, Any]:
    return {"counters": rx.counters, "open": rx.open_connections, "rss": status_kib("VmRSS") * KIB,
            "hwm": status_kib("VmHWM") * KIB}


def _reset_peak(rx: Any, _: Any) -> int:
    return reset_peak()


def _drain(rx: Any, arg: tuple[int, float]) -> dict[str, Any]:
    """Receive until ``want`` valid groups arrived or ``seconds`` passed; their ids in arrival order."""
    from .rx import recv

    want, seconds = arg
    ids: list[str] = []
    deadline = time.monotonic() + seconds
    while len(ids) < want and time.monotonic() < deadline:
        group = recv(rx, timeout_ms=200)
        ids += [group.group_id] if group is not None else []
    return {"ids": ids, **_status(rx, None)}


_COMMANDS = {"status": _status, "reset_peak": _reset_peak, "drain": _drain}


def _serve(conn: Any, kwargs: dict[str, Any]) -> None:
    from async_dapo.stream.transport import GroupReceiver

    with GroupReceiver(**kwargs) as rx:
        conn.send({"address": rx.address, "rcvhwm": rx.rcvhwm, "hard_cap_bytes": rx.hard_cap_bytes,
                   "worst_case_bytes": rx.worst_case_bytes})
        while conn.poll(120):  # a parent silent for 2 minutes is gone: end instead of lingering
            cmd, arg = conn.recv()
            if cmd == "close":
                return
            conn.send(_COMMANDS[cmd](rx, arg))


class ReceiverProcess:
    """A GroupReceiver(**kwargs) in a spawned child; ``call`` runs one command there (bounded)."""

    def __init__(self, start_s: float = 60.0, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")  # fresh interpreter: nothing inherited, no fork of zmq threads
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._reply(start_s, "start")

    def _reply(self, timeout_s: float, what: str) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"receiver process: no answer to {what} within {timeout_s} s")
        return self._conn.recv()

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 30.0) -> Any:
        self.request(cmd, arg)
        return self.reply(timeout_s)

    def request(self, cmd: str, arg: Any = None) -> None:
        """Start a command without waiting (e.g. "drain" while this process sends); then ``reply``."""
        self._pending = cmd
        self._conn.send((cmd, arg))

    def reply(self, timeout_s: float = 30.0) -> Any:
        return self._reply(timeout_s, self._pending)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()  # our own child, by its handle
            self.proc.join(5)
        self._conn.close()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
