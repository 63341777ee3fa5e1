"""Supervision of the rollout fleet: bounded waits on actors, heartbeats to every serving engine, the
replacement of a dead or hung rollout actor, and engines added or removed while the run goes on
(``async-dapo scale RUN_DIR --engines N``).

Ray's own ``max_restarts`` would restart an actor's process, but its state (the SGLang engine, its place in
the weight-update group, its in-flight prompts) would be gone and nobody would re-wire it; so the
orchestrator does the restart itself, the way slime's fault tolerance does (heartbeat every 10 s, kill a
silent engine, restart it with current weights) — but without stopping training: the orchestrator calls
:meth:`EngineSupervisor.poll` between its polls of the replay queue, and each call does a bounded bit of
work, never an engine start.

1. heartbeat, in the background: every ``placement.health_check_interval_s`` each serving engine is sent a
   1-token request; one that has not finished it after ``placement.health_check_timeout_s`` (+10 s for Ray)
   is hung, a dead process fails at once;
2. a failed engine leaves the fleet at once: killed by handle, its in-flight prompts released by the replay
   queue (slots freed, prompts back to the cursor: nothing lost, nothing trained twice), and the weight
   group rebuilt with the survivors, who then load the current weights. For them that is one group rebuild
   and one push; they go on generating and the learner goes on training on their groups;
3. its replacement starts in the background in the same placement group (an added engine: in a new one);
   once its engine is up the group is rebuilt with it and the current weights are pushed and loaded
   *before* it admits a prompt;
4. an engine removed by a scale request stops admitting and its in-flight prompts are released, then it is
   shut down and its placement group removed: its resources go back to Ray;
5. after ``placement.max_engine_restarts`` replacements the run stops with :class:`RunFailed`.

Each of these is an event in ``run_dir/fleet.jsonl`` (one JSON object with its time per line).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("async_dapo")


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


def cause_of(exc: BaseException) -> str:
    """The last line of a Ray error's cause: the part a person needs."""
    lines = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    last = lines[-1] if lines else type(exc).__name__
    return last.split(". ")[0][:200]  # Ray's explanations run on for several sentences


@dataclass
class _Starting:
    """An engine on its way in: waiting for its placement group, then for its engine, then for the group."""

    rank: int
    why: str  # "replacement" or "added"
    since: float  # time.monotonic() when it was asked for
    actor: Any = None
    up: Any = None  # its get_stats ref: answers once the engine is up
    ready: bool = False
    reported: float = 0.0


class EngineSupervisor:
    """Heartbeats the serving rollout actors of a :class:`~async_dapo.placement.Placed`, replaces failed
    ones and applies scale requests, in the background (see the module docstring). ``push_now(version)``
    pushes the current weights to every serving engine and waits for the load; ``wait_push()`` waits for
    the push in flight."""

    def __init__(self, placed, last_checkpoint, push_now: Callable[[int], None], wait_push: Callable[[], Any],
                 on_change=None, clock=None, run_dir=None) -> None:
        self.placed, self.cfg = placed, placed.cfg
        self.last_checkpoint = last_checkpoint  # () -> str, for the stop message
        self.push_now, self.wait_push = push_now, wait_push
        self.on_change = on_change  # () -> None, after the serving engines changed (actors.json)
        self.clock = clock  # metrics.PhaseClock: supervision is its own phase
        self.dir = run_dir  # checkpoints.RunDir: fleet.jsonl, scale.json (None: neither)
        self.restarts = 0
        self.replaced: list[dict[str, Any]] = []  # one record per replacement that joined, for docs and tests
        self.starting: dict[int, _Starting] = {}
        self.failed_at: dict[int, float] = {}  # rank -> when it failed (its replacement's recovery time)
        self._beats: dict[int, tuple[Any, Any]] | None = None  # heartbeat in flight: rank -> (ref, handle)
        self._beat_t0 = 0.0
        self._next_check = time.monotonic() + self.cfg.placement.health_check_interval_s
        self._regroup = False  # the serving engines changed: the weight group must follow
        self._joining: dict[int, _Starting] = {}  # up and in the group's next rebuild, not admitting yet
        self._scale_seen: int | None = None  # mtime of the scale request applied last

    # ------------------------------------------------------------------ the loop's calls
    def poll(self, version: int) -> None:
        """One bounded round: heartbeat results, failures, a new scale request, engines coming up, and a
        group rebuild (with a push) if the serving engines changed."""
        with self.clock.phase("supervision") if self.clock else contextlib.nullcontext():
            self.detect(version)
            self._apply_scale_request(version)
            self._advance(version)
            if self._regroup:
                self._rebuild(version)

    def detect(self, version: int) -> None:
        """Heartbeats only (no group rebuild): safe while a push is in flight. A failed engine is killed
        here, which fails a push stuck on it at once."""
        failed = self._heartbeat_results()
        if failed:
            self.replace(failed, version)

    def check(self, version: int) -> bool:
        """After a failed push: heartbeat every serving engine now, waiting for the answers; take the failed
        ones out and, if the fleet changed (now or since the push began), rebuild the group with the
        engines that serve (which pushes the current weights). True if it did."""
        failed = self.failed_engines()
        if failed:
            self.replace(failed, version)
        if self._regroup:
            self._rebuild(version)
            return True
        return False

    def failed_engines(self) -> list[tuple[int, str]]:
        """Heartbeat every serving engine and wait for the answers: [(rank, reason)] of the failed ones."""
        import ray

        timeout = self.cfg.placement.health_check_timeout_s
        refs = {rank: e.health.remote(timeout) for rank, e in self.placed.engines.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + 10)
        return [(rank, why) for rank, ref in refs.items() if (why := _verdict(ref, ref in ready, timeout))]

    @property
    def serving(self) -> int:
        return len(self.placed.engines)

    @property
    def regroup_pending(self) -> bool:
        """An engine left or came up and the weight group has not followed yet."""
        return self._regroup

    # ------------------------------------------------------------------ failures
    def _heartbeat_results(self) -> list[tuple[int, str]]:
        """Send a heartbeat to every serving engine when one is due; collect the answers that came, and
        count one unanswered past its bound as hung. Never waits."""
        import ray

        now, timeout = time.monotonic(), self.cfg.placement.health_check_timeout_s
        if self._beats is None:
            if now < self._next_check or not self.placed.engines:
                return []
            self._beats = {rank: (e.health.remote(timeout), e) for rank, e in self.placed.engines.items()}
            self._beat_t0 = now
        refs = [ref for ref, _ in self._beats.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        late = now - self._beat_t0 > timeout + 10
        failed = []
        for rank, (ref, handle) in list(self._beats.items()):
            if self.placed.engines.get(rank) is not handle:  # it left the fleet meanwhile
                del self._beats[rank]
            elif ref in ready or late:
                del self._beats[rank]
                if why := _verdict(ref, ref in ready, timeout):
                    failed.append((rank, why))
        if not self._beats:
            self._beats, self._next_check = None, now + self.cfg.placement.health_check_interval_s
        return failed

    def replace(self, failed: list[tuple[int, str]], version: int) -> None:
        """Take every failed engine out of the fleet (killed, prompts released) and start its replacement in
        the background; RunFailed naming them all when that would exceed placement.max_engine_restarts."""
        limit = self.cfg.placement.max_engine_restarts
        names = ", ".join(f"rollout actor {i} failed: {reason}" for i, reason in failed)
        if self.restarts + len(failed) > limit:
            raise RestartsExhausted(f"{names}; placement.max_engine_restarts ({limit}) exhausted")
        self.restarts += len(failed)
        log.warning("%s; replacing in the background (restarts used: %d of %d)", names, self.restarts, limit)
        for rank, reason in failed:
            self.failed_at[rank] = time.monotonic()
            self._event("failed", rank=rank, reason=reason)
            self._remove(rank, "actor_failed", graceful=False)
            self._start(rank, "replacement")

    def _remove(self, rank: int, reason: str, graceful: bool) -> None:
        """Engine ``rank`` leaves the fleet: its admissions stop and its in-flight prompts go back to the
        cursor (counted as replay/abandoned/<reason>); it is ended by handle (after a bounded shutdown when
        ``graceful``). The group follows at the next rebuild."""
        import ray

        handle = self.placed.engines.pop(rank)
        self._regroup = True  # at once: whatever fails below, the group must not keep naming it
        if not graceful:  # a dead or hung engine: kill first (that also fails a push stuck on it)
            ray.kill(handle, no_restart=True)
        released = self.placed.get(self.placed.replay.release_engine.remote(rank, reason), "release prompts")
        if graceful:
            try:
                ray.get(handle.shutdown.remote(), timeout=60)
            except Exception as exc:  # it is killed below anyway
                log.warning("rollout actor %d: shutdown failed: %r", rank, exc)
            ray.kill(handle, no_restart=True)
        self._event("removed", rank=rank, reason=reason, released_prompts=released)
        log.info("rollout actor %d left the fleet (%s); %d in-flight prompts returned to the cursor", rank, reason,
                 released)

    # ------------------------------------------------------------------ engines coming in
    def _start(self, rank: int, why: str) -> None:
        self.placed.engine_group(rank)  # a replacement reuses its rank's; an added engine gets a new one
        self.starting[rank] = _Starting(rank, why, time.monotonic())
        self._event("starting", rank=rank, why=why)

    def _advance(self, version: int) -> None:
        """Move every starting engine on without waiting: placed -> actor created -> engine up."""
        import ray

        for s in list(self.starting.values()):
            age = time.monotonic() - s.since
            if s.ready:
                continue
            if s.actor is None and self.placed.engine_group_ready(s.rank):
                try:  # an added engine's group may land on a node beyond placement.nnodes
                    self.placed.check_span()
                except RunFailed as exc:
                    self._start_failed(s, str(exc))
                    continue
                s.actor = self.placed.starting[s.rank] = self.placed.spawn_engine(s.rank, version)
                s.up = s.actor.get_stats.remote()
            elif s.actor is None and time.monotonic() - max(s.reported, s.since) >= 60:
                s.reported = time.monotonic()
                log.warning("rollout actor %d (%s) waits for resources for %.0f s: %s", s.rank, s.why, age,
                            self.placed.waiting_for(s.rank))
            elif s.actor is not None and ray.wait([s.up], timeout=0)[0]:
                self._came_up(s)
            if not s.ready and self.starting.get(s.rank) is s and age > self.cfg.placement.start_timeout_s:
                self._start_failed(s, f"not up in {self.cfg.placement.start_timeout_s:.0f} s "
                                      "(placement.start_timeout_s)")

    def _came_up(self, s: _Starting) -> None:
        import ray

        try:
            ray.get(s.up)  # ready: returns at once (raises if the engine did not start)
        except Exception as exc:
            self._start_failed(s, f"engine start failed: {cause_of(exc)}")
            return
        s.ready, self._regroup = True, True
        self._event("up", rank=s.rank, why=s.why, seconds=time.monotonic() - s.since)

    def _start_failed(self, s: _Starting, why: str) -> None:
        """A replacement that cannot start is retried (a restart more); an added engine is given up."""
        self._drop_starting(s.rank)
        log.warning("rollout actor %d (%s): %s", s.rank, s.why, why)
        self._event("start_failed", rank=s.rank, why=s.why, reason=why)
        if s.why == "replacement":
            self._retry_start(s.rank, why)
        else:
            self.placed.remove_engine_group(s.rank)

    def _retry_start(self, rank: int, why: str) -> None:
        limit = self.cfg.placement.max_engine_restarts
        if self.restarts + 1 > limit:
            raise RestartsExhausted(f"rollout actor {rank}: its replacement failed: {why}; "
                                    f"placement.max_engine_restarts ({limit}) exhausted")
        self.restarts += 1
        self._start(rank, "replacement")

    def _drop_starting(self, rank: int) -> None:
        import ray

        self.starting.pop(rank, None)
        actor = self.placed.starting.pop(rank, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------ the weight group follows
    def _rebuild(self, version: int) -> None:
        """The serving engines changed: wait for the push in flight (it fails if it went to an engine that
        left), let the engines that came up join, rebuild the group with every serving engine and push the
        current weights; only then do the new ones admit prompts. An engine that fails meanwhile is taken out
        and the rebuild is tried again at the next poll."""
        t0 = time.monotonic()
        self._settle_push()
        for s in [s for s in self.starting.values() if s.ready]:
            self.placed.engines[s.rank] = self.placed.starting.pop(s.rank)
            self._joining[s.rank] = self.starting.pop(s.rank)
        self.placed.engines = dict(sorted(self.placed.engines.items()))
        self._regroup = False
        t1 = time.monotonic()
        try:
            self.placed.rebuild_weight_group()
            t2 = time.monotonic()
            if self.placed.engines:
                self.push_now(version)  # every serving engine runs the current weights; new ones before admitting
        except RunFailed as exc:
            if isinstance(exc, RestartsExhausted) or not (failed := self.failed_engines()):
                raise  # no engine explains it (learner rank 0?)
            log.warning("weight group rebuild failed (%s); taking out %s and rebuilding again", exc, failed)
            for rank, _ in failed:
                self._joining.pop(rank, None)
            self.replace(failed, version)
            return
        joined = [self._joining.pop(r) for r in sorted(self._joining) if r in self.placed.engines]
        self._joining.clear()
        if joined:
            self.placed.start_rollouts([s.rank for s in joined])
        t3 = time.monotonic()
        self._event("regrouped", engines=sorted(self.placed.engines), joined=[s.rank for s in joined],
                    version=version, seconds=t3 - t0, wait_push_s=t1 - t0, group_s=t2 - t1, push_s=t3 - t2)
        for s in joined:
            self._joined(s, version)
        if self.on_change is not None:
            self.on_change()

    def _settle_push(self) -> None:
        """Wait for the push in flight; its failure is expected when an engine of the group left under it."""
        try:
            self.wait_push()
        except ActorDied:
            raise
        except RunFailed as exc:
            log.info("the push in flight ended with the fleet's change: %s", exc)

    def _joined(self, s: _Starting, version: int) -> None:
        failed_at = self.failed_at.pop(s.rank, None)
        since = failed_at if failed_at is not None else s.since
        record = {"engines": [s.rank], "why": s.why, "version": version, "recovery_s": time.monotonic() - since,
                  "start_s": time.monotonic() - s.since}
        if s.why == "replacement":
            self.replaced.append(record)
        self._event("joined", rank=s.rank, why=s.why, version=version, seconds=record["recovery_s"])
        log.warning("rollout actor %d (%s) serving at version %d, %.1f s after it was asked for", s.rank, s.why,
                    version, record["recovery_s"])

    # ------------------------------------------------------------------ scaling
    def _apply_scale_request(self, version: int) -> None:
        """A new ``scale.json`` (``async-dapo scale``): start or remove engines to reach its count."""
        if self.dir is None or not self.dir.scale.exists():
            return
        mtime = self.dir.scale.stat().st_mtime_ns
        if mtime == self._scale_seen:
            return
        self._scale_seen = mtime
        try:
            target = scale_target(self.cfg, self.dir.scale.read_text())
        except ValueError as exc:
            log.error("scale request %s ignored: %s", self.dir.scale, exc)
            self._event("scale_refused", reason=str(exc))
            return
        ranks = sorted(set(self.placed.engines) | set(self.starting))
        if target > len(ranks):
            self._scale_up(target, ranks)
        elif target < len(ranks):
            self._scale_down(target, ranks)

    def _scale_up(self, target: int, ranks: list[int]) -> None:
        try:
            self.placed.check_room(target)
        except RunFailed as exc:
            log.error("scale to %d engines refused: %s", target, exc)
            self._event("scale_refused", engines=target, reason=str(exc))
            return
        free = [r for r in range(target + len(ranks)) if r not in ranks][:target - len(ranks)]
        log.warning("scaling to %d engines: adding rollout actor(s) %s in the background", target, free)
        self._event("scale", engines=target, adding=free)
        for rank in free:
            self._start(rank, "added")

    def _scale_down(self, target: int, ranks: list[int]) -> None:
        """Engines still starting go first (newest first), then the serving ones with the highest ranks."""
        order = sorted(self.starting, reverse=True) + sorted(self.placed.engines, reverse=True)
        gone = order[:len(ranks) - target]
        log.warning("scaling to %d engines: removing rollout actor(s) %s", target, gone)
        self._event("scale", engines=target, removing=gone)
        self._settle_push()  # not under a push to an engine about to be shut down
        for rank in gone:
            if rank in self.starting:
                self._drop_starting(rank)
                self._event("removed", rank=rank, reason="scaled_down", released_prompts=0)
            else:
                self._remove(rank, "scaled_down", graceful=True)
            self.failed_at.pop(rank, None)
            self.placed.remove_engine_group(rank)

    # ------------------------------------------------------------------ record
    def _event(self, event: str, **fields: Any) -> None:
        if self.dir is None:
            return
        with self.dir.fleet.open("a") as f:
            f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")


def scale_target(cfg, text: str) -> int:
    """The engine count a scale request (``{"engines": N}``) asks for; ValueError naming what is wrong."""
    try:
        target = json.loads(text)["engines"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f'not a JSON object with "engines": {exc!r}') from None
    ceiling = cfg.placement.max_engines or cfg.placement.num_engines
    if not isinstance(target, int) or isinstance(target, bool) or not 1 <= target <= ceiling:
        raise ValueError(f"engines must be a whole number from 1 to placement.max_engines ({ceiling}), got {target!r}")
    return target


def _verdict(ref, answered: bool, timeout: float) -> str | None:
    """Why a heartbeat says its engine failed (None: healthy)."""
    import ray

    if not answered:
        return f"no heartbeat in {timeout:.0f} s (hung)"
    try:
        ray.get(ref)  # answered: returns at once (raises if the heartbeat failed)
    except ray.exceptions.RayActorError as exc:
        return f"process died ({cause_of(exc)})"
    except Exception as exc:
        return f"unhealthy: {cause_of(exc)}"
    return None
