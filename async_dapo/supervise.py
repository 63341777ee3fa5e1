"""Supervision: bounded waits on actors, heartbeats to every rollout engine, and replacement of a dead or
hung rollout actor with current weights.

Ray's own ``max_restarts`` would restart an actor's process, but its state (the SGLang engine, its place in
the weight-update group, its in-flight prompts) would be gone and nobody would re-wire it; so the
orchestrator does the restart itself, the way slime's fault tolerance does (heartbeat every 10 s, kill a
silent engine, restart it with current weights):

1. heartbeat: every ``placement.health_check_interval_s`` each engine must finish a 1-token request within
   ``placement.health_check_timeout_s`` (a dead process fails at once; a hung one times out);
2. a failed engine is killed by handle, and the replay queue releases its in-flight prompts (slots freed,
   prompts back to the cursor: nothing lost, nothing trained twice);
3. a replacement starts in the same placement bundle; the weight-update group is rebuilt with every
   engine; the current weights are pushed and loaded *before* the replacement admits a prompt;
4. after ``placement.max_engine_restarts`` replacements the run stops with :class:`RunFailed`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

log = logging.getLogger("async_dapo")


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the one line the CLI prints."""


class ActorDied(RunFailed):
    """An actor's process is gone (killed, crashed, its node lost)."""


class WaitExpired(RunFailed):
    """A bounded wait ran out; the message names what it waited for."""


def wait_all(refs: list, names: list[str], *, what: str, timeout_s: float) -> list[Any]:
    """Results of ``refs`` in order. Fails fast, naming the actor, when one of them errors or its actor died
    (the others may be blocked in a collective with it); raises WaitExpired naming the actors still
    pending after ``timeout_s``."""
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(names[index[r]] for r in pending)
            raise WaitExpired(f"{what}: no answer from {late} in {timeout_s:.0f} s")
        try:
            ray.get(ready[0])  # ready: returns at once (raises if that call failed)
        except ray.exceptions.RayActorError as exc:
            raise ActorDied(f"{what}: {names[index[ready[0]]]} died ({cause_of(exc)})") from None
        except ray.exceptions.RayTaskError as exc:
            raise RunFailed(f"{what}: {names[index[ready[0]]]} failed: {cause_of(exc)}") from None
    return ray.get(list(refs))  # all ready by now: no wait


def cause_of(exc: BaseException) -> str:
    """The last line of a Ray error's cause: the part a person needs."""
    lines = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    last = lines[-1] if lines else type(exc).__name__
    return last.split(". ")[0][:200]  # Ray's explanations run on for several sentences


class EngineSupervisor:
    """Heartbeats the rollout actors of a :class:`~async_dapo.placement.Placed` and replaces failed ones."""

    def __init__(self, placed, last_checkpoint, on_replace=None, clock=None) -> None:
        self.placed, self.cfg = placed, placed.cfg
        self.last_checkpoint = last_checkpoint  # () -> str, for the stop message
        self.on_replace = on_replace  # () -> None, after each replacement (the orchestrator rewrites actors.json)
        self.clock = clock  # metrics.PhaseClock: heartbeats and replacements are their own phase
        self.restarts = 0
        self.replaced: list[dict[str, Any]] = []  # one record per replacement, for docs and tests
        self._next_check = time.monotonic() + self.cfg.placement.health_check_interval_s

    def due(self) -> bool:
        return time.monotonic() >= self._next_check

    def check(self, version: int, push) -> int:
        """Heartbeat every engine; replace all that failed. ``push(version)`` pushes the current weights
        to every engine and waits for the load. Returns the number replaced."""
        with self.clock.phase("supervision") if self.clock else contextlib.nullcontext():
            failed = self.failed_engines()
            if failed:
                self.replace(failed, version, push)
        self._next_check = time.monotonic() + self.cfg.placement.health_check_interval_s
        return len(failed)

    def failed_engines(self) -> list[tuple[int, str]]:
        import ray

        timeout = self.cfg.placement.health_check_timeout_s
        refs = [e.health.remote(timeout) for e in self.placed.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout + 10)
        failed = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                failed.append((i, f"no heartbeat in {timeout:.0f} s (hung)"))
                continue
            try:
                ray.get(ref)  # in `ready`: returns at once (raises if the heartbeat failed)
            except ray.exceptions.RayActorError as exc:
                failed.append((i, f"process died ({cause_of(exc)})"))
            except Exception as exc:
                failed.append((i, f"unhealthy: {cause_of(exc)}"))
        return failed

    def replace(self, failed: list[tuple[int, str]], version: int, push) -> None:
        """Replace every failed engine at once: kill and release each, start the replacements, then rebuild
        the weight group ONCE with all engines (a group naming a still-dead engine would wait for it),
        push the current weights, and only then let the replacements admit prompts."""
        import ray

        t0 = time.monotonic()
        limit = self.cfg.placement.max_engine_restarts
        names = ", ".join(f"rollout actor {i} failed: {reason}" for i, reason in failed)
        if self.restarts + len(failed) > limit:
            raise RunFailed(f"{names}; placement.max_engine_restarts ({limit}) exhausted")
        self.restarts += len(failed)
        log.warning("%s; replacing (restarts used: %d of %d)", names, self.restarts, limit)
        released = 0
        for index, _ in failed:
            ray.kill(self.placed.engines[index], no_restart=True)
            released += self.placed.get(self.placed.replay.release_engine.remote(index, "actor_failed"),
                                        "release prompts")
        for index, _ in failed:
            self.placed.engines[index] = self.placed.new_engine(index, version)
        self.placed.rebuild_weight_group()
        push(version)  # the replacements load the current weights before they generate
        self.placed.start_rollouts([index for index, _ in failed])
        record = {"engines": [i for i, _ in failed], "reasons": [r for _, r in failed], "released_prompts": released,
                  "version": version, "recovery_s": time.monotonic() - t0}
        self.replaced.append(record)
        log.warning("rollout actor(s) %s replaced in %.1f s at version %d; %d in-flight prompts returned to the "
                    "cursor", record["engines"], record["recovery_s"], version, released)
        if self.on_replace is not None:
            self.on_replace()
