"""Bounded waits on Ray actors and the errors a run stops with: what every part that calls an actor uses
(the weight path, placement, supervision, the orchestrator). Every wait here has a bound and, on expiry,
names what it waited for; a run that cannot go on raises :class:`RunFailed`, whose message is the one line
the CLI prints."""
from __future__ import annotations

import time
from typing import Any


class RunFailed(RuntimeError):
    """The run cannot go on; the message is the one line the CLI prints."""


class ActorDied(RunFailed):
    """An actor's process is gone (killed, crashed, its node lost)."""


class WaitExpired(RunFailed):
    """A bounded wait ran out; the message names what it waited for."""


class RestartsExhausted(RunFailed):
    """An engine failed with placement.max_engine_restarts used up."""


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


def fan_out(refs: dict, *, timeout_s: float) -> tuple[dict, dict, list]:
    """Wait for many actors' answers together, at most ``timeout_s`` for all of them (never one bound per
    actor): (answers by key, {key: why} for the calls that failed or whose actor died, [keys] of the ones
    that did not answer in time). Never raises for one actor: the caller decides what a missing answer
    means (a hung engine is taken out, a missing counter is skipped)."""
    import ray

    keys = list(refs)
    ready = set(ray.wait([refs[k] for k in keys], num_returns=len(keys), timeout=timeout_s)[0]) if keys else set()
    answers, failed = {}, {}
    for k in keys:
        if refs[k] not in ready:
            continue
        try:
            answers[k] = ray.get(refs[k])  # ready: returns at once
        except ray.exceptions.RayActorError as exc:
            failed[k] = f"process died ({cause_of(exc)})"
        except Exception as exc:
            failed[k] = f"failed: {cause_of(exc)}"
    return answers, failed, [k for k in keys if refs[k] not in ready]


class EnginesFailed(RunFailed):
    """Some engines failed one step of a fleet operation: ``failed`` = {rank: why}. The supervisor takes
    exactly these out; the others go on."""

    def __init__(self, what: str, failed: dict[int, str]) -> None:
        self.failed = dict(failed)
        super().__init__(f"{what}: " + "; ".join(f"rollout actor {r} {why}" for r, why in sorted(failed.items())))


def engines_failed(what: str, failed: dict, late: list, timeout_s: float) -> None:
    """Raise EnginesFailed naming the engines of a fan-out that failed or did not answer in ``timeout_s``."""
    if failed or late:
        raise EnginesFailed(what, {**failed, **{r: f"did not answer in {timeout_s:.0f} s (hung)" for r in late}})


def cause_of(exc: BaseException) -> str:
    """The last line of a Ray error's cause: the part a person needs."""
    lines = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    last = lines[-1] if lines else type(exc).__name__
    return last.split(". ")[0][:200]  # Ray's explanations run on for several sentences
