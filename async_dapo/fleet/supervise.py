"""Supervision of the rollout fleet: bounded waits on actors, heartbeats to every serving engine, the
replacement of a dead or hung rollout actor, and engines added or removed while the run goes on
(``async-dapo scale RUN_DIR --engines N``).

Ray's own ``max_restarts`` would restart an actor's process, but its state (the SGLang engine, its place in
the weight-update group, its in-flight prompts) would be gone and nobody would re-wire it; so the
orchestrator does the restart itself, the way slime's fault tolerance does (heartbeat every 10 s, kill a
silent engine, restart it with current weights) — but without stopping training: the orchestrator calls
:meth:`EngineSupervisor.poll` between its polls of the replay queue. A poll never starts an engine and never
waits on one engine: what it asks of several engines it asks of all at once, under one bound, at most
``placement.health_check_timeout_s`` (the engines that do not answer in it are named and taken out).

1. heartbeat, in the background: every ``placement.health_check_interval_s`` each serving engine is sent a
   1-token request; one that has not finished it after ``placement.health_check_timeout_s`` (+10 s for Ray)
   is hung, a dead process fails at once. A heartbeat cannot judge an engine that is loading weights (it
   produces nothing meanwhile), so a push is watched too: once it has run past :meth:`push_bound`, an
   engine that has not loaded it while another engine has is hung inside it;
2. a failed engine leaves the fleet at once: killed by handle (which ends a push stuck on it: the others
   keep the weights), its in-flight prompts released by the replay queue (slots freed, prompts back to the
   cursor: nothing lost, nothing trained twice), and the weight group rebuilt with the survivors, who then
   load the current weights; they go on generating and the learner goes on training on their groups;
3. its replacement starts in the background in the same placement group (an added engine: in a new one);
   once its engine is up and has answered a first heartbeat, the group is formed again with it on a thread
   of the driver while training goes on (a regroup: see ``_rebuild``) and the current weights are pushed;
   it admits prompts only once that push has landed, and one that dies then is replaced again;
4. an engine removed by a scale request stops admitting and its in-flight prompts are released, then the
   removed engines are shut down together and their placement groups removed: resources go back to Ray;
5. after ``placement.max_engine_restarts`` replacements the run stops with :class:`RunFailed`.

Each of these is an event in ``run_dir/fleet.jsonl`` (one JSON object with its time per line).
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from async_dapo.checkpoint.run_dir import ScaleRefused, ScaleWatch
from async_dapo.waits import ActorDied, EnginesFailed, RestartsExhausted, RunFailed, cause_of, fan_out

log = logging.getLogger("async_dapo")


class Background:
    """``fn()`` on a daemon thread of the driver (Ray's API is thread-safe); :meth:`done` never waits, then
    ``error`` is what it raised (None: it returned). Its every wait has its own bound, so the thread ends."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long fn ran, once done
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name="async-dapo-regroup", daemon=True).start()

    def _run(self, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as exc:  # handed to the loop's thread, which raises or acts on it
            self.error = exc
        finally:
            self.seconds = time.monotonic() - t0
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()


@dataclass
class _Starting:
    """An engine on its way in: waiting for its placement group, then for its engine, then for the group."""

    rank: int
    why: str  # "replacement" or "added"
    since: float  # time.monotonic() when it was asked for
    actor: Any = None
    up: Any = None  # its get_stats ref: answers once the engine is up
    beat: Any = None  # then its first heartbeat's ref: a generation through its scheduler, before it may join
    beat_t0: float = 0.0
    ready: bool = False
    reported: float = 0.0


class EngineSupervisor:
    """Heartbeats the serving rollout actors of a :class:`~async_dapo.fleet.placement.Placed`, replaces failed
    ones and applies scale requests, in the background (see the module docstring). ``push(version)`` starts
    a push of the current weights to every engine of the group (returns once the learner snapshotted them);
    ``wait_push(meanwhile=f)`` waits for the push in flight, calling ``f`` about once a second, and raises
    RunFailed if it failed; ``push_status()`` is True once no push is in flight (never waits); ``form(fn)``
    starts a group formation beside the loop and returns a job with ``done()``, ``error`` and ``seconds``
    (default :class:`Background`)."""

    def __init__(self, placed, last_checkpoint, push: Callable[[int], None], wait_push: Callable[..., Any],
                 push_status: Callable[[], bool], on_change=None, clock=None, run_dir=None,
                 form: Callable[[Callable[[], None]], Any] | None = None) -> None:
        self.placed, self.cfg = placed, placed.cfg
        self.last_checkpoint = last_checkpoint  # () -> str, for the stop message
        self.push, self.wait_push, self.push_status = push, wait_push, push_status
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
        self.form = form or Background  # runs the group formation beside the loop (tests: inline)
        self._forming: dict[str, Any] | None = None  # the group formation under way (its job and timings)
        self._group_durations: list[float] = []  # the last formations' durations (their bound: group_bound)
        self._pushing: dict[str, Any] | None = None  # the regroup's push in flight (its version and timings)
        self._push_failures = 0  # regroup pushes failed in a row with no engine to blame
        self._push_checked: tuple | None = None  # the push in flight every engine was seen to load
        self._push_asked = 0.0  # when the engines were last asked about the push in flight
        self._scale_watch = ScaleWatch(run_dir.scale) if run_dir is not None else None  # requests handed out

    # ------------------------------------------------------------------ the loop's calls
    def poll(self, version: int) -> None:
        """One bounded round: heartbeat results, failures, a new scale request, engines coming up, and a
        group rebuild (with a push) if the serving engines changed."""
        with self.clock.phase("supervision") if self.clock else contextlib.nullcontext():
            self.detect(version)
            if self._forming is None:  # a request may remove a member of the group being formed: after it
                self._apply_scale_request(version)
            self._advance(version)
            if self._forming is not None:
                self._check_formed(version)
            if self._pushing is not None:
                self._check_push(version)
            if self._regroup and self._forming is None and self._pushing is None and self._push_settled():
                self._rebuild(version)

    def detect(self, version: int) -> None:
        """Heartbeats only (no group rebuild): safe while a push is in flight. A failed engine is killed
        here, which fails a push stuck on it at once."""
        failed = self._heartbeat_results() + self._hung_in_push()
        if failed:
            self.replace(failed, version)

    def check(self, version: int) -> bool:
        """After a failed push: heartbeat every serving engine now, waiting for the answers; take the failed
        ones out and, if the fleet changed (now or since the push began), rebuild the group with the
        engines that serve (which pushes the current weights). True if it did."""
        failed = self.failed_engines()
        if failed:
            self.replace(failed, version)
        if self._regroup and self._forming is None:
            self._rebuild(version)  # forms the group in the background, then pushes the current weights
        return self._regroup or self._forming is not None

    def failed_engines(self) -> list[tuple[int, str]]:
        """Heartbeat every serving engine and wait for the answers: [(rank, reason)] of the failed ones."""
        import ray

        timeout = self.cfg.placement.health_check_timeout_s
        refs = {rank: e.health.remote(timeout) for rank, e in self.placed.engines.items()}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout + 10)
        return [(rank, why) for rank, ref in refs.items() if (why := _verdict(ref, ref in ready, timeout))]

    @property
    def serving(self) -> int:
        return len(self.placed.engines)

    @property
    def regroup_pending(self) -> bool:
        """An engine left or came up and the weight group has not followed yet."""
        return self._regroup

    @property
    def busy(self) -> bool:
        """A regroup is pending or under way (its next stage is due at the next poll: poll often)."""
        return self._regroup or self._forming is not None or self._pushing is not None

    @property
    def forming(self) -> bool:
        """A new weight group is being formed: no push can go out until it is (the regroup pushes the
        weights current when it is formed)."""
        return self._forming is not None

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

    def push_bound(self) -> float:
        """How long a push may run before the engines that have not loaded it are looked at (see
        :func:`watch_bound`, from the recent pushes' durations)."""
        return watch_bound(self.cfg.placement.health_check_timeout_s, self.placed.push_durations)

    def group_bound(self) -> float:
        """Each step of a group formation (leave, dtype, rendezvous) is bounded by this (see
        :func:`watch_bound`, from the recent formations' durations): while it forms no push goes out, so an
        engine hung in it costs the learner this at most, not a whole health_check_timeout_s."""
        return watch_bound(self.cfg.placement.health_check_timeout_s, self._group_durations)

    def _hung_in_push(self) -> list[tuple[int, str]]:
        """A push past :meth:`push_bound`: the engines still loading it while another engine of the push has
        it loaded, or whose actor does not answer, are hung inside it. Taken out at once (which ends the push
        for the others, who keep the weights); a heartbeat could not tell, since an engine loading weights
        legitimately produces nothing. Asks at most once a second, and not again once every engine loaded."""
        flight, now = self.placed.push_in_flight, time.monotonic()
        if flight is None or flight is self._push_checked or now < self._push_asked + 1.0:
            return []
        version, t0, engines = flight
        bound = self.push_bound()
        if now - t0 < bound:
            return []
        self._push_asked = now
        live = {r: e for r, e in engines.items() if self.placed.engines.get(r) is e}
        asked = min(5.0, self.cfg.placement.health_check_timeout_s)
        status, _, late = fan_out({r: e.push_status.remote() for r, e in live.items()}, timeout_s=asked)
        loaded = sorted(r for r, st in status.items() if st["version"] == version)
        if len(loaded) == len(live):
            self._push_checked = flight
            return []
        stuck = []
        for r, st in sorted(status.items()):
            if st["version"] == version:
                continue
            if st.get("stopped"):  # with no other engine to compare with (one engine, or all of them stuck)
                stuck.append((r, f"hung inside the push of weight version {version}: its processes "
                                 f"{st['stopped']} are stopped (push bound {bound:.0f} s)"))
            elif loaded and (st["loading_s"] or 0.0) > bound:
                stuck.append((r, f"hung inside the push of weight version {version}: still loading after "
                                 f"{st['loading_s']:.0f} s while rollout actor(s) {loaded} have it (push bound "
                                 f"{bound:.0f} s)"))
        return stuck + [(r, f"did not answer in {asked:.0f} s during the push of version {version} (hung)")
                        for r in late]

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

    def _remove(self, rank: int, reason: str, graceful: bool):
        """Engine ``rank`` leaves the fleet: its admissions stop and its in-flight prompts go back to the
        cursor (counted as replay/abandoned/<reason>). A failed one is killed first; a ``graceful`` one is
        returned for the caller to shut down (all at once) and kill. The group follows at the next rebuild."""
        import ray

        handle = self.placed.engines.pop(rank)
        self._joining.pop(rank, None)
        self.placed.joining.discard(rank)
        self._regroup = True  # at once: whatever fails below, the group must not keep naming it
        if not graceful:  # a dead or hung engine: kill first (that also fails a push stuck on it)
            ray.kill(handle, no_restart=True)
        released = self.placed.get(self.placed.replay.release_engine.remote(rank, reason), "release prompts")
        self._event("removed", rank=rank, reason=reason, released_prompts=released)
        log.info("rollout actor %d left the fleet (%s); %d in-flight prompts returned to the cursor", rank, reason,
                 released)
        return handle

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
            elif s.beat is not None:
                self._first_beat(s)
            elif s.actor is not None and ray.wait([s.up], timeout=0)[0]:
                self._came_up(s)
            if not s.ready and self.starting.get(s.rank) is s and age > self.cfg.placement.start_timeout_s:
                self._start_failed(s, f"not up in {self.cfg.placement.start_timeout_s:.0f} s "
                                      "(placement.start_timeout_s)")

    def _came_up(self, s: _Starting) -> None:
        """Its engine is up: send it a heartbeat, which it must answer before it joins the weight group (a
        rendezvous blocks every member until all arrived: an engine hung already must not hold the others)."""
        import ray

        try:
            stats = ray.get(s.up)  # ready: returns at once (raises if the engine did not start)
        except Exception as exc:
            self._start_failed(s, f"engine start failed: {cause_of(exc)}")
            return
        self._event("up", rank=s.rank, why=s.why, seconds=time.monotonic() - s.since, pid=stats.get("pid"))
        s.beat, s.beat_t0 = s.actor.health.remote(self.cfg.placement.health_check_timeout_s), time.monotonic()

    def _first_beat(self, s: _Starting) -> None:
        """Its first heartbeat answered: ready to join; not in health_check_timeout_s (+10 s): hung, retried."""
        import ray

        timeout = self.cfg.placement.health_check_timeout_s
        answered = bool(ray.wait([s.beat], timeout=0)[0])
        if not answered and time.monotonic() - s.beat_t0 <= timeout + 10:
            return
        if why := _verdict(s.beat, answered, timeout):
            self._start_failed(s, f"its first heartbeat: {why}")
            return
        s.ready, self._regroup = True, True

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
    # A regroup is a stage of this state machine, never one long call: (1) settle the push in flight (the
    # heartbeats run while it waits, so an engine hung under it is killed, which ends the wait), (2) form the
    # new group on a thread of its own (every engine asked at once, each step bounded by group_bound; learner
    # rank 0 opens its side beside training), collected by a later poll,
    # (3) start the push of the current weights and return. The learner trains on the survivors' groups all
    # along; only once the push landed (collected by a later poll, or by the loop before its next push) do
    # the joiners admit prompts.
    def _push_settled(self) -> bool:
        """No push is in flight, or the one in flight has finished (never waits: a regroup starts later)."""
        return self.placed.push_in_flight is None or self.push_status()

    def _rebuild(self, version: int) -> None:
        """Stage 1 and the start of stage 2 (see above); :meth:`_check_formed` goes on from there."""
        t0 = time.monotonic()
        self._settle_push(version)
        for s in [s for s in self.starting.values() if s.ready]:
            self.placed.engines[s.rank] = self.placed.starting.pop(s.rank)
            self._joining[s.rank] = self.starting.pop(s.rank)
        self.placed.engines = dict(sorted(self.placed.engines.items()))
        self.placed.joining = set(self._joining)  # in the group, not serving: no prompts, no validation
        self._regroup = False
        engines, bound = dict(self.placed.engines), self.group_bound()
        self._forming = {"t0": t0, "wait_push_s": time.monotonic() - t0,
                         "job": self.form(lambda: self.placed.rebuild_weight_group(engines, bound))}
        self._check_formed(version)  # an inline former (tests) is done already

    def _check_formed(self, version: int) -> None:
        """Stage 2's end, once the group is formed (never waits for it): push the current weights to it, or,
        if forming it failed, take out the engines that explain it and try again at the next poll."""
        job = self._forming["job"]
        if not job.done():
            return
        forming, self._forming = self._forming, None
        if job.error is not None:
            if not isinstance(job.error, RunFailed):
                raise job.error
            self._regroup_failed(job.error, version)
            return
        if self._regroup:  # the fleet changed while the group formed: form it again before any push
            return
        now = time.monotonic()
        self._group_durations = [*self._group_durations[-19:], job.seconds]
        self._pushing = {"version": version, "t0": forming["t0"], "wait_push_s": forming["wait_push_s"],
                         "group_s": job.seconds, "t_push": now}
        if self.placed.engines:
            self.push(version)  # returns once the learner's shards are snapshotted
        else:  # nothing serves (the only engine failed): its replacement is pushed to when it comes up
            self._landed(version)

    def _regroup_failed(self, exc: RunFailed, version: int) -> None:
        """Take out the engines a failed regroup names (or, if it names none, the ones a heartbeat finds
        failed); RunFailed when nothing explains it."""
        failed = list(exc.failed.items()) if isinstance(exc, EnginesFailed) else self.failed_engines()
        if isinstance(exc, RestartsExhausted) or not failed:
            raise exc  # no engine explains it (learner rank 0?)
        log.warning("weight group rebuild failed (%s); taking out %s and rebuilding again", exc, failed)
        self.replace(failed, version)

    @property
    def pushing(self) -> bool:
        """A regroup's push is in flight (its joiners admit once it landed)."""
        return self._pushing is not None

    def _check_push(self, version: int) -> None:
        """Collect the regroup's push if the learner reports it finished; never waits for it."""
        if self.push_status():
            self.finish_push(version)

    def finish_push(self, version: int) -> None:
        """Wait for the regroup's push (the heartbeats run meanwhile) and act on it: the joiners start
        admitting, or, if it failed, the engines that explain it are taken out and the group follows again.
        The loop calls this before its own next push."""
        try:
            self.wait_push(meanwhile=lambda: self.detect(version))
        except (ActorDied, RestartsExhausted):
            raise
        except RunFailed as exc:
            self._pushing = None
            self._push_failures += 1
            failed = self.failed_engines()
            if not failed and self._push_failures > 1:  # a second failure in a row that no engine explains
                raise RunFailed(f"weight push after a regroup failed twice: {exc}") from None
            log.warning("the regroup's push failed (%s); %s", exc, f"taking out {failed}" if failed else "again")
            if failed:
                self.replace(failed, version)
            self._regroup = True
            return
        self._push_failures = 0
        self._landed(version)

    def _landed(self, version: int) -> None:
        """The regroup's push landed: its joiners start admitting (one that fails to is replaced)."""
        done, self._pushing = self._pushing or {}, None
        version = done.get("version", version)
        joined = [self._joining[r] for r in sorted(self._joining) if r in self.placed.engines]
        self._joining.clear()
        self.placed.joining = set()
        failed = self.placed.start_rollouts([s.rank for s in joined]) if joined else {}
        now = time.monotonic()
        self._event("regrouped", engines=sorted(self.placed.engines), joined=[s.rank for s in joined],
                    version=version, seconds=now - done.get("t0", now), wait_push_s=done.get("wait_push_s", 0.0),
                    group_s=done.get("group_s", 0.0), push_s=now - done.get("t_push", now))
        for s in joined:
            if s.rank not in failed:
                self._joined(s, version)
        if failed:  # a replacement that died right after it joined: replaced again (a restart counted)
            self.replace(sorted(failed.items()), version)
        if self.on_change is not None:
            self.on_change()

    def _settle_push(self, version: int) -> None:
        """Wait for the push in flight, heartbeating meanwhile; its failure is expected when an engine of
        the group left under it."""
        if self._pushing is not None:
            self.finish_push(version)
            return
        try:
            self.wait_push(meanwhile=lambda: self.detect(version))
        except (ActorDied, RestartsExhausted):
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
        """A new ``scale.json`` (``async-dapo scale``): start or remove engines to reach its count. New means
        other bytes than the request handed out last (checkpoints.ScaleWatch: the request's number makes each
        one differ; an mtime can repeat). One that cannot be read (not a regular file, unreadable, too big)
        or asks for a count out of range is logged and recorded as ``scale_refused``, and the run goes on.
        Every answer carries the request's ``seq``: ``async-dapo scale --wait-s`` waits for it."""
        if self._scale_watch is None:
            return
        try:
            request = self._scale_watch.poll()
        except ScaleRefused as exc:  # every OSError of the read: refused, never raised out of poll()
            log.error("scale request refused: %s", exc)
            self._event("scale_refused", seq=None, reason=str(exc))
            return
        if request is None:
            return
        try:
            target = scale_target(self.cfg, request.text)
        except ValueError as exc:
            log.error("scale request #%s (%s) refused: %s", request.seq, self.dir.scale, exc)
            self._event("scale_refused", seq=request.seq, reason=str(exc))
            return
        ranks = sorted(set(self.placed.engines) | set(self.starting))
        if target > len(ranks):
            self._scale_up(target, ranks, request.seq)
        elif target < len(ranks):
            self._scale_down(target, ranks, version, request.seq)
        else:  # nothing to change, answered all the same
            log.info("scale request #%s: the fleet has %d engine(s) already", request.seq, target)
            self._event("scale", seq=request.seq, engines=target, adding=[], removing=[])

    def _scale_up(self, target: int, ranks: list[int], seq: int | None = None) -> None:
        try:
            self.placed.check_room(target)
        except RunFailed as exc:
            log.error("scale to %d engines refused: %s", target, exc)
            self._event("scale_refused", seq=seq, engines=target, reason=str(exc))
            return
        free = [r for r in range(target + len(ranks)) if r not in ranks][:target - len(ranks)]
        log.warning("scaling to %d engines: adding rollout actor(s) %s in the background", target, free)
        self._event("scale", seq=seq, engines=target, adding=free)
        for rank in free:
            self._start(rank, "added")

    def _scale_down(self, target: int, ranks: list[int], version: int, seq: int | None = None) -> None:
        """Engines still starting go first (newest first), then the serving ones with the highest ranks."""
        order = sorted(self.starting, reverse=True) + sorted(self.placed.engines, reverse=True)
        gone = order[:len(ranks) - target]
        log.warning("scaling to %d engines: removing rollout actor(s) %s", target, gone)
        self._event("scale", seq=seq, engines=target, removing=gone)
        self._settle_push(version)  # not under a push to an engine about to be shut down
        handles = []
        for rank in gone:
            if rank in self.starting:
                self._drop_starting(rank)
                self._event("removed", rank=rank, reason="scaled_down", released_prompts=0)
            else:
                handles.append(self._remove(rank, "scaled_down", graceful=True))
            self.failed_at.pop(rank, None)
        self._shut_down(handles)
        for rank in gone:  # after the shutdown: Ray ends the actors of a removed placement group at once
            self.placed.remove_engine_group(rank)

    def _shut_down(self, handles: list) -> None:
        """Shut removed engines down all at once, bounded by placement.health_check_timeout_s, then end
        them by handle (a hung one too)."""
        import ray

        bound = self.cfg.placement.health_check_timeout_s
        _, failed, late = fan_out({i: h.shutdown.remote() for i, h in enumerate(handles)}, timeout_s=bound)
        if failed or late:
            log.warning("shutdown of removed engines: %d failed, %d did not answer in %.0f s; ending them by handle",
                        len(failed), len(late), bound)
        for handle in handles:
            ray.kill(handle, no_restart=True)

    # ------------------------------------------------------------------ record
    def _event(self, event: str, **fields: Any) -> None:
        if self.dir is None:
            return
        try:  # a record the run cannot write (fleet.jsonl replaced by a directory, a full disk) is logged, not fatal
            with self.dir.fleet.open("a") as f:
                f.write(json.dumps({"time": time.time(), "event": event, **fields}) + "\n")
        except OSError as exc:
            log.error("fleet event %s not recorded in %s: %s", event, self.dir.fleet, exc)


def watch_bound(hc: float, durations: list[float]) -> float:
    """Five times the median of ``durations`` (the same operation's recent runs), at least a third of ``hc``
    (placement.health_check_timeout_s: a slow but healthy run is never judged), at most all of it."""
    took = sorted(durations)
    return min(hc, max(hc / 3, 5 * took[len(took) // 2])) if took else hc / 3


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
