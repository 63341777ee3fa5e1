"""Scoring off the engine's event loop: the reward function runs in worker processes, each call bounded.

Why processes (pebble's ProcessPool) and not threads: a rollout actor's engine loop serves every request of
its engine, so a ``compute_score`` that hangs (a sandbox that never answers, a regex that backtracks for
hours) must not run on it. A thread would not help: it cannot be stopped, and pure-Python or ``re`` work
holds the GIL, stalling the loop anyway. A worker process still busy after ``reward.timeout_s`` is killed
and replaced by the pool, so a hanging scorer costs one group, not the engine.

The score function is sent to each worker once, at its start (``initializer``), not with every call; it
must therefore be picklable (``reward.load_score_fn`` returns one that is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import random
from typing import Any

from pebble import ProcessExpired, ProcessPool

from async_dapo.config import RewardConfig
from async_dapo.data.reward import RewardResult, ScoreFn, load_score_fn

__all__ = ["Scorer", "ScoringFailed"]

# (data_source, response text, ground truth, extra_info): what verl's compute_score is called with
Item = tuple[str, str, str, dict[str, Any]]

_worker_fn: ScoreFn | None = None  # set in each worker process by _init


def _init(fn: ScoreFn, seed: int) -> None:
    global _worker_fn
    _worker_fn = fn
    random.seed(seed)  # a reward function that draws (a sampled check, a fault injection) is reproducible


def _score_all(items: list[Item]) -> list[RewardResult]:
    assert _worker_fn is not None, "worker started without a score function"
    return [_worker_fn(*item) for item in items]


class ScoringFailed(RuntimeError):
    """A batch could not be scored; ``reason`` is ``score_timeout`` or ``score_error`` (the abandon reason)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Scorer:
    """``reward.workers`` worker processes running the configured reward function."""

    def __init__(self, reward: RewardConfig, seed: int = 0) -> None:
        self.timeout_s, self._workers = reward.timeout_s, reward.workers
        self._pending = 0  # calls scheduled and not finished (only touched on the caller's event loop)
        # spawn, not fork: the rollout actor has threads (the engine loop, zmq, Ray), and a forked child
        # of a threaded process can inherit a held lock
        self._pool = ProcessPool(max_workers=reward.workers, initializer=_init, initargs=(load_score_fn(reward), seed),
                                 context=multiprocessing.get_context("spawn"))

    async def score(self, items: list[Item]) -> list[RewardResult]:
        """Score ``items`` in one worker call; ScoringFailed after ``reward.timeout_s`` (the worker is killed),
        when the function raised, or when the worker died."""
        # The pool's own timeout (from the call's start in a worker) kills the worker; this outer bound only
        # guards against the pool itself never answering. Calls queued ahead each take at most timeout_s.
        backstop = self.timeout_s * (1 + self._pending // self._workers) + 30
        future = self._pool.schedule(_score_all, args=(list(items),), timeout=self.timeout_s)
        self._pending += 1
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), backstop)
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            future.cancel()  # the backstop's expiry: stop (kill) the call the pool did not end itself
            raise ScoringFailed("score_timeout", f"reward function did not return in {self.timeout_s:g} s "
                                "(reward.timeout_s); its worker was killed") from None
        except ProcessExpired as exc:
            raise ScoringFailed("score_error", f"reward worker died (exit code {exc.exitcode})") from None
        except asyncio.CancelledError:
            future.cancel()  # a cancelled caller must not leave its call running in a worker
            raise
        except Exception as exc:
            raise ScoringFailed("score_error", f"reward function raised {exc!r}") from exc
        finally:
            self._pending -= 1

    def close(self) -> None:
        """Stop the workers (a busy one is killed): bounded, never waits on a hung scorer."""
        self._pool.stop()
        self._pool.join(timeout=10)
