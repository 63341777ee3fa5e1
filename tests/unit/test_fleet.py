"""The rollout fleet's logic without Ray or an engine: the supervisor's background state machine (a failure
takes the engine out and rebuilds the group with the survivors at once; the replacement joins only when its
engine is up, after the current weights were pushed to it; a hung heartbeat is judged by its age, never
waited for), scale requests (added engines, removal order, refusals), and the placement's fit check that
stops an impossible run at once with one line. Ray's calls are replaced by a scripted double; the real
paths are tests/integration/test_fleet_e2e.py."""

import json

import pytest
import ray

from async_dapo import waits
from async_dapo.fleet import supervise
from async_dapo.checkpoint.run_dir import RunDir
from async_dapo.config import load_config
from async_dapo.fleet.placement import check_fits
from async_dapo.fleet.supervise import EngineSupervisor, scale_target
from async_dapo.waits import RunFailed


class Ref:
    """A Ray object ref: ``done`` with ``value`` (or ``error`` raised by ray.get), or still pending."""

    def __init__(self, value=None, error=None, done=True):
        self.value, self.error, self.done = value, error, done


class _Method:
    def __init__(self, fn):
        self.remote = fn


class Engine:
    def __init__(self, name, health=None, up=None):
        self.name, self.calls = name, []
        self.health_ref = health or Ref({"pid": 1})
        self.up_ref = up or Ref({"pid": 2})
        self.health = _Method(lambda timeout: self._call("health", self.health_ref))
        self.get_stats = _Method(lambda: self._call("get_stats", self.up_ref))
        self.shutdown = _Method(lambda: self._call("shutdown", Ref(None)))
        self.status_ref = Ref({"version": 0, "loading_s": None})
        self.push_status = _Method(lambda: self._call("push_status", self.status_ref))

    def _call(self, what, ref):
        self.calls.append(what)
        return ref

    def __repr__(self):
        return self.name


class Placed:
    """What the supervisor uses of async_dapo.fleet.placement.Placed, recording what it was asked to do."""

    def __init__(self, cfg, engines):
        self.cfg, self.engines, self.starting, self.engine_pgs = cfg, dict(engines), {}, {}
        self.log, self.placed_groups, self.room = [], set(), None
        self.joining: set[int] = set()
        self.bounds: list = []  # each group formation's bound
        self.push_in_flight, self.push_durations = None, []
        self.start_fails: dict[int, str] = {}  # rank -> why its start_rollouts fails
        self.replay = type("Q", (), {"release_engine": _Method(lambda rank, why: self._did("release", rank, why))})()
        self.spawned: dict[int, Engine] = {}
        self.calls_before_removal: dict[int, list | None] = {}  # rank -> its actor's calls when its group went

    def _did(self, *what):
        self.log.append(what)
        return Ref(3)

    def get(self, ref, what, timeout_s=None):
        return ref.value

    def engine_group(self, rank):
        self.engine_pgs.setdefault(rank, f"pg{rank}")

    def engine_group_ready(self, rank):
        return rank in self.placed_groups

    def check_span(self):
        pass

    def waiting_for(self, rank):
        return "1 bundle(s)"

    def spawn_engine(self, rank, version):
        self.log.append(("spawn", rank, version))
        self.spawned[rank] = Engine(f"new{rank}", up=Ref({"pid": 2}, done=False))
        return self.spawned[rank]

    def rebuild_weight_group(self, engines=None, bound=None):
        self.bounds.append(bound)
        self.log.append(("group", sorted(self.engines if engines is None else engines)))

    def start_rollouts(self, which):
        self.log.append(("start", which))
        return {r: self.start_fails[r] for r in which if r in self.start_fails}

    def check_room(self, engines):
        if self.room is not None and engines > self.room:
            raise RunFailed(f"the placement cannot be held with {engines} engines")

    def remove_engine_group(self, rank):
        self.engine_pgs.pop(rank, None)
        self.log.append(("pg_removed", rank))
        self.calls_before_removal[rank] = list(self.spawned[rank].calls) if rank in self.spawned else None


class Killed(list):
    """The names of the actors ray.kill ended; ``waits``: (timeout, refs pending) of every ray.wait."""

    waits: list


@pytest.fixture
def fake_ray(monkeypatch):
    killed = Killed()
    killed.waits = []

    def wait(refs, num_returns=1, timeout=None):
        pending = [r for r in refs if not r.done]
        # A real ray.wait with timeout=None on a ref that never comes blocks the training loop forever.
        assert timeout is not None or len(refs) - len(pending) >= num_returns, "unbounded ray.wait on a pending ref"
        killed.waits.append((timeout, len(pending)))
        return [r for r in refs if r.done], pending

    monkeypatch.setattr(ray, "wait", wait)

    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor.name))
    return killed


class Clock:
    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(supervise.time, "monotonic", lambda: self.now)


class Learner:
    """The learner's push as the supervisor sees it: ``pushes`` records (version, engines) per push started
    and "waited" per wait; ``landed`` says whether the push in flight is done; ``error``, if set, is what
    the next wait raises."""

    def __init__(self, placed):
        self.placed, self.pushes, self.landed, self.error = placed, [], True, None

    def push(self, version):
        self.pushes.append((version, sorted(self.placed.engines)))

    def wait(self, meanwhile=None):
        self.pushes.append("waited")
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class Formation:
    """A group formation the test runs by hand: ``finish()`` runs it (and records what it raised)."""

    def __init__(self, fn, seconds=0.5):
        self.fn, self.error, self.ran, self.seconds = fn, None, False, seconds

    def finish(self):
        try:
            self.fn()
        except BaseException as exc:
            self.error = exc
        self.ran = True

    def done(self):
        return self.ran


def _inline(fn):
    """The group forms at once (the supervisor's Background runs it on a thread)."""
    job = Formation(fn)
    job.finish()
    return job


def _supervisor(cfg, engines, tmp_path=None, learner=False, form=_inline):
    placed = Placed(cfg, engines)
    lrn = Learner(placed)
    sup = EngineSupervisor(placed, lambda: "ckpt", push=lrn.push, wait_push=lrn.wait, push_status=lambda: lrn.landed,
                           run_dir=RunDir(tmp_path) if tmp_path else None, form=form)
    return sup, placed, (lrn if learner else lrn.pushes)


def _dead():
    return Ref(error=ray.exceptions.RayActorError(actor_id=None, error_msg="The actor died unexpectedly"))


CFG = ["placement.num_engines=2", "placement.health_check_interval_s=10", "placement.health_check_timeout_s=30"]


def test_a_dead_engine_leaves_at_once_and_its_replacement_joins_only_when_up(fake_ray, monkeypatch, tmp_path):
    clock = Clock(monkeypatch)
    cfg = load_config(None, CFG)
    sup, placed, pushes = _supervisor(cfg, {0: Engine("e0"), 1: Engine("e1", health=_dead())}, tmp_path)
    sup.poll(7)  # before the first heartbeat is due: nothing is sent
    assert placed.log == [] and placed.engines[1].calls == []
    clock.now += 10
    sup.poll(7)
    # Engine 1 is out (killed, prompts released) and the group rebuilt with engine 0, which got version 7.
    assert fake_ray == ["e1"] and list(placed.engines) == [0] and sup.restarts == 1
    assert placed.log == [("release", 1, "actor_failed"), ("group", [0])]
    assert pushes == ["waited", (7, [0])] and set(sup.starting) == {1} and sup.starting[1].why == "replacement"
    clock.now += 5
    sup.poll(8)  # its placement group is not placed yet: no actor, nothing else
    assert placed.log[-1] == ("group", [0]) and placed.starting == {}
    placed.placed_groups.add(1)
    sup.poll(9)  # placed: the actor is created at the current version; its engine is still starting
    assert placed.log[-1] == ("spawn", 1, 9) and list(placed.engines) == [0] and not sup.regroup_pending
    placed.spawned[1].up_ref.done = True
    placed.spawned[1].health_ref = Ref(done=False)  # its first heartbeat is slow
    clock.now += 30
    sup.poll(11)  # up: its first heartbeat is sent; it must answer before the group takes it
    assert placed.spawned[1].calls == ["get_stats", "health"] and placed.log[-1] == ("spawn", 1, 9)
    sup.poll(11)
    assert placed.log[-1] == ("spawn", 1, 9) and not sup.regroup_pending
    placed.spawned[1].health_ref.done, placed.spawned[1].health_ref.value = True, {"pid": 2}
    sup.poll(12)  # answered: the group takes it and the current weights are pushed; it admits nothing yet
    assert placed.log[-1] == ("group", [0, 1]) and placed.joining == {1} and sup.pushing
    assert pushes[-1] == (12, [0, 1]) and list(placed.engines) == [0, 1] and sup.starting == {}
    sup.poll(13)  # the push landed: only now does it start admitting
    assert placed.log[-1] == ("start", [1]) and placed.joining == set() and not sup.pushing
    assert sup.replaced == [{"engines": [1], "why": "replacement", "version": 12, "recovery_s": 35.0, "start_s": 35.0}]
    events = list(map(json.loads, (tmp_path / "fleet.jsonl").read_text().splitlines()))
    assert [e["event"] for e in events] == ["failed", "removed", "starting", "regrouped", "up", "regrouped", "joined"]
    assert events[4]["pid"] == 2  # the replacement's process, for whoever watches fleet.jsonl


def test_a_hung_heartbeat_is_judged_by_its_age_and_never_waited_for(fake_ray, monkeypatch):
    clock = Clock(monkeypatch)
    sup, placed, _ = _supervisor(load_config(None, CFG), {0: Engine("e0"), 1: Engine("e1", health=Ref(done=False))})
    clock.now += 10
    sup.poll(3)  # engine 0 answered, engine 1 has not: it is still within its bound
    assert list(placed.engines) == [0, 1] and placed.engines[1].calls == ["health"]
    clock.now += 39
    sup.poll(3)  # 39 s < 30 + 10: the same heartbeat is still awaited, no second one sent
    assert list(placed.engines) == [0, 1] and placed.engines[1].calls == ["health"]
    clock.now += 2
    sup.poll(3)
    assert list(placed.engines) == [0] and fake_ray == ["e1"] and placed.log[0] == ("release", 1, "actor_failed")
    assert {t for t, pending in fake_ray.waits if pending} == {0}  # looked at, never waited for


def _replacement_spawned(monkeypatch, restarts: int):
    """Engine 1 of two failed, and its replacement's actor was created (its engine starting)."""
    clock = Clock(monkeypatch)
    cfg = load_config(None, CFG + [f"placement.max_engine_restarts={restarts}", "placement.start_timeout_s=100"])
    sup, placed, _ = _supervisor(cfg, {0: Engine("e0"), 1: Engine("e1", health=_dead())})
    clock.now += 10
    sup.poll(1)
    placed.placed_groups.add(1)
    sup.poll(1)
    return clock, sup, placed


def _crash_at_start(sup, placed) -> None:
    placed.spawned[1].up_ref = Ref(error=RuntimeError("engine crashed at start"))
    sup.starting[1].up = placed.spawned[1].up_ref


def test_a_replacement_that_cannot_start_is_retried_until_restarts_run_out(fake_ray, monkeypatch):
    _, sup, placed = _replacement_spawned(monkeypatch, restarts=2)
    _crash_at_start(sup, placed)
    sup.poll(1)  # its start failed: killed, and a second replacement (restart 2 of 2) begins
    assert sup.restarts == 2 and "new1" in fake_ray and 1 in sup.starting and sup.starting[1].actor is None
    sup.poll(1)
    _crash_at_start(sup, placed)
    with pytest.raises(RunFailed, match=r"rollout actor 1: its replacement failed: engine start failed: .*"
                                        r"placement.max_engine_restarts \(2\) exhausted"):
        sup.poll(1)


def test_scale_requests_add_then_remove_the_newest_engines(fake_ray, monkeypatch, tmp_path):
    Clock(monkeypatch)
    cfg = load_config(None, ["placement.num_engines=1", "placement.max_engines=3"])
    sup, placed, pushes = _supervisor(cfg, {0: Engine("e0")}, tmp_path)
    run = RunDir(tmp_path)
    run.scale.write_text(json.dumps({"engines": 3}))
    sup.poll(4)
    assert {r: s.why for r, s in sup.starting.items()} == {1: "added", 2: "added"} and sup.restarts == 0
    sup.poll(4)  # the same request is applied once
    assert len(sup.starting) == 2
    placed.placed_groups.add(1)
    sup.poll(4)
    placed.spawned[1].up_ref.done = True
    sup.poll(5)  # up: its first heartbeat goes out
    sup.poll(5)  # answered: it joins
    assert list(placed.engines) == [0, 1] and list(sup.starting) == [2]
    run.scale.write_text(json.dumps({"engines": 1}))
    import os

    os.utime(run.scale, ns=(1, 1))  # a new request (another mtime)
    sup.poll(5)
    # The one still starting goes first, then the serving one with the highest rank: released, shut down, killed.
    assert sup.starting == {} and list(placed.engines) == [0]
    assert ("pg_removed", 2) in placed.log and ("pg_removed", 1) in placed.log
    assert ("release", 1, "scaled_down") in placed.log and placed.spawned[1].calls[-1] == "shutdown"
    # Ray ends the actors of a removed placement group: the graceful shutdown was asked for before that
    assert placed.calls_before_removal[1][-1] == "shutdown"
    assert placed.log[-1] == ("group", [0]) and pushes[-1] == (5, [0])


def test_a_scale_request_the_cluster_cannot_hold_is_refused_and_the_run_goes_on(fake_ray, monkeypatch, tmp_path):
    Clock(monkeypatch)
    cfg = load_config(None, ["placement.num_engines=1", "placement.max_engines=4"])
    sup, placed, _ = _supervisor(cfg, {0: Engine("e0")}, tmp_path)
    placed.room = 2
    RunDir(tmp_path).scale.write_text(json.dumps({"engines": 3}))
    sup.poll(1)
    assert sup.starting == {} and list(placed.engines) == [0]
    refused = [e for e in map(json.loads, (tmp_path / "fleet.jsonl").read_text().splitlines())]
    assert refused[-1]["event"] == "scale_refused" and "cannot be held with 3 engines" in refused[-1]["reason"]


def test_scale_target_names_what_is_wrong():
    cfg = load_config(None, ["placement.max_engines=4"])
    assert scale_target(cfg, '{"engines": 4}') == 4
    for text, msg in [('{"engines": 5}', "from 1 to placement.max_engines (4), got 5"),
                      ('{"engines": 0}', "got 0"), ('{"engines": "2"}', "got '2'"), ('{"engines": true}', "got True"),
                      ('{"n": 2}', 'with "engines"'), ("two", 'with "engines"')]:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            scale_target(cfg, text)
    assert "(1), got 2" in _err(lambda: scale_target(load_config(None), '{"engines": 2}'))  # None = num_engines


def _err(fn) -> str:
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


def test_a_placement_the_cluster_cannot_hold_fails_at_once_naming_fields_and_resources():
    cfg = load_config(None, ["placement.num_engines=2"])  # 2 x 1 + 1 learner x 1 CPU on a 2-CPU machine
    with pytest.raises(RunFailed) as err:
        check_fits(cfg, [{"CPU": 2.0}])
    msg = str(err.value)
    assert msg == ("the placement cannot be held: it needs 3 CPU and 0 GPU (placement.num_engines=2 x "
                   "(placement.engine_cpus=1, placement.engine_gpus=0); placement.learner_ranks=1 x "
                   "(placement.learner_cpus=1, placement.learner_gpus=0); placement.queue_cpus=0) but the cluster "
                   "has 2 CPU and 0 GPU on 1 node(s) (largest node 2 CPU, 0 GPU); lower those fields, add nodes, or "
                   "set placement.autoscaling if an autoscaler adds them")
    check_fits(load_config(None, ["placement.num_engines=2", "placement.engine_cpus=0.5"]), [{"CPU": 2.0}])
    check_fits(cfg, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])  # three 1-CPU nodes hold it, one bundle each
    check_fits(load_config(None, ["placement.num_engines=2", "placement.autoscaling=true"]), [{"CPU": 2.0}])
    big = load_config(None, ["placement.engine_cpus=1.5"])  # 2.5 CPU of 3, but no node holds 1.5
    assert "a bundle no node can hold (placement.num_engines=1" in _fails(big, [{"CPU": 1.0}] * 3)
    gpu = load_config(None, ["rollout.engine.device=cuda", "placement.engine_gpus=1"])
    assert "needs 2 CPU and 1 GPU" in _fails(gpu, [{"CPU": 8.0}])
    with pytest.raises(RunFailed, match=r"\+ 2 more engine\(s\)"):  # a scale-up beyond the cluster
        check_fits(load_config(None, ["placement.engine_cpus=0.5"]), [{"CPU": 2.0}], extra_engines=2)


def _fails(cfg, nodes) -> str:
    with pytest.raises(RunFailed) as err:
        check_fits(cfg, nodes)
    return str(err.value)


def test_a_start_failure_seen_after_its_bound_counts_one_restart(fake_ray, monkeypatch):
    clock, sup, placed = _replacement_spawned(monkeypatch, restarts=3)
    _crash_at_start(sup, placed)
    clock.now += 200  # a long step: the failed start is only looked at after start_timeout_s
    sup.poll(1)
    assert sup.restarts == 2 and sup.starting[1].actor is None  # the failure, once; the new start waits


def test_an_engine_that_fails_during_a_rebuild_is_taken_out_and_the_rebuild_retried(fake_ray, monkeypatch):
    clock = Clock(monkeypatch)
    sup, placed, pushes = _supervisor(load_config(None, CFG), {0: Engine("e0"), 1: Engine("e1", health=_dead())})
    clock.now += 10
    sup.poll(1)  # engine 1 out, the group rebuilt with engine 0
    placed.placed_groups.add(1)
    sup.poll(1)
    placed.spawned[1].up_ref.done = True
    sup.poll(1)  # up; its first heartbeat goes out
    calls = {"n": 0}

    def rebuild_fails_once(engines=None, bound=None):
        calls["n"] += 1
        if calls["n"] == 1:  # the rebuild with the replacement: it died right after it came up
            placed.spawned[1].health_ref = _dead()
            raise waits.ActorDied("engines joining weights_1: rollout actor 1 died (gone)")
        placed.log.append(("group", sorted(placed.engines)))

    placed.rebuild_weight_group = rebuild_fails_once
    sup.poll(2)  # the replacement is taken out again (a restart more), nothing admits, no RunFailed
    assert list(placed.engines) == [0] and sup.restarts == 2 and sup.regroup_pending
    assert ("start", [1]) not in placed.log
    sup.poll(3)  # the next poll rebuilds with the survivor
    assert placed.log[-1] == ("group", [0]) and pushes[-1] == (3, [0]) and set(sup.starting) == {1}


def test_an_engine_hung_before_it_joins_is_retried_and_never_holds_the_group(fake_ray, monkeypatch, tmp_path):
    """Its engine came up, then hung: its first heartbeat never answers. The group is never rebuilt with it
    (its rendezvous would hold every member); after health_check_timeout_s + 10 s it is retried."""
    clock = Clock(monkeypatch)
    sup, placed, learner = _supervisor(load_config(None, CFG), {0: Engine("e0"), 1: Engine("e1", health=_dead())},
                                       tmp_path, learner=True)
    clock.now += 10
    sup.poll(1)
    placed.placed_groups.add(1)
    sup.poll(1)
    placed.spawned[1].up_ref.done = True
    placed.spawned[1].health_ref = Ref(done=False)
    sup.poll(2)
    clock.now += 39
    sup.poll(3)
    assert 1 in sup.starting and sup.restarts == 1 and placed.log.count(("group", [0])) == 1
    clock.now += 2
    sup.poll(4)
    assert fake_ray[-1] == "new1" and sup.restarts == 2 and sup.starting[1].actor is None
    assert placed.log.count(("group", [0])) == 1 and not any(e == ("group", [0, 1]) for e in placed.log)
    last = json.loads((tmp_path / "fleet.jsonl").read_text().splitlines()[-2])
    assert last["event"] == "start_failed" and last["reason"] == "its first heartbeat: no heartbeat in 30 s (hung)"


def _replacement_up(monkeypatch, tmp_path=None, restarts=3):
    """Engine 1 of two failed and its replacement's engine is up (the next poll regroups with it)."""
    clock = Clock(monkeypatch)
    cfg = load_config(None, CFG + [f"placement.max_engine_restarts={restarts}"])
    sup, placed, learner = _supervisor(cfg, {0: Engine("e0"), 1: Engine("e1", health=_dead())}, tmp_path, learner=True)
    clock.now += 10
    sup.poll(1)
    placed.placed_groups.add(1)
    sup.poll(1)
    placed.spawned[1].up_ref.done = True
    sup.poll(1)  # its first heartbeat goes out (answered at once: the next poll regroups)
    return clock, sup, placed, learner


def test_the_learner_is_never_held_by_a_regroup_push_and_a_joiner_serves_only_once_it_landed(fake_ray, monkeypatch):
    clock, sup, placed, learner = _replacement_up(monkeypatch)
    learner.landed = False  # the push to the replacement is slow
    waits = learner.pushes.count("waited")
    sup.poll(2)  # regroup: the group forms and the push starts; the loop goes back to training at once
    sup.poll(3)
    sup.poll(4)
    assert learner.pushes[-1] == (2, [0, 1]) and learner.pushes.count("waited") == waits + 1  # the settle only
    assert placed.joining == {1} and ("start", [1]) not in placed.log  # in the group, not admitting
    learner.landed = True
    sup.poll(5)
    assert placed.log[-1] == ("start", [1]) and sup.replaced[-1]["version"] == 2  # the version its push carried
    assert all(timeout == 0 for timeout, pending in fake_ray.waits if pending)  # nothing pending was waited for


def _forming(monkeypatch, tmp_path=None):
    """A replacement is up; the group forms by hand (``jobs[-1].finish()``), as a hung engine would hold it."""
    clock, sup, placed, learner = _replacement_up(monkeypatch, tmp_path)
    jobs = []
    sup.form = lambda fn: jobs.append(Formation(fn)) or jobs[-1]
    return clock, sup, placed, learner, jobs


def test_the_loop_never_waits_for_a_group_to_form_and_pushes_the_weights_current_once_formed(fake_ray, monkeypatch,
                                                                                              tmp_path):
    from async_dapo.checkpoint.run_dir import write_scale_request

    clock, sup, placed, learner, jobs = _forming(monkeypatch, tmp_path)
    pushes = len(learner.pushes)
    sup.poll(2)  # the regroup starts: the group forms beside the loop
    assert sup.forming and len(jobs) == 1 and placed.joining == {1}
    write_scale_request(RunDir(tmp_path), {"engines": 1})  # would remove engine 1, a member of the forming group
    for version in (3, 4, 5):  # three training steps while it forms: no push, no admission, the request waits
        clock.now += 1
        sup.poll(version)
    assert learner.pushes[pushes:] == ["waited"] and ("start", [1]) not in placed.log and list(placed.engines) == [0, 1]
    assert sup.forming and len(jobs) == 1
    jobs[0].finish()
    sup.poll(6)  # formed: the weights current now go out; the joiner admits once they landed
    assert placed.log[-2:] == [("group", [0, 1]), ("start", [1])] and learner.pushes[-2:] == [(6, [0, 1]), "waited"]
    assert sup.replaced[-1]["version"] == 6 and list(placed.engines) == [0, 1]
    # Each step of a formation is bounded by 5 x the median formation (0.5 s each here), at least 30 / 3.
    assert placed.bounds == [10.0, 10.0] and sup.group_bound() == 10.0
    assert supervise.watch_bound(30.0, [3.0, 9.0, 3.0]) == 15.0 and supervise.watch_bound(30.0, [7.0]) == 30.0
    sup.poll(7)  # then the request that waited
    assert placed.log[-1] == ("pg_removed", 1) and list(placed.engines) == [0]


def test_a_group_that_cannot_form_names_the_hung_engine_which_is_replaced(fake_ray, monkeypatch):
    clock, sup, placed, learner, jobs = _forming(monkeypatch)
    sup.poll(2)

    def hung():
        raise waits.EnginesFailed("engines joining async_dapo_weights_2", {1: "did not answer in 30 s (hung)"})

    jobs[0].fn = hung
    jobs[0].finish()
    sup.poll(3)  # the replacement that hung in the rendezvous is out (a restart more); the survivor regroups
    assert list(placed.engines) == [0] and sup.restarts == 2 and set(sup.starting) == {1} and fake_ray[-1] == "new1"
    assert ("start", [1]) not in placed.log and len(jobs) == 2  # the next formation, without it, has begun
    jobs[1].finish()
    sup.poll(4)
    assert ("group", [0]) in placed.log[-2:] and learner.pushes[-2:] == [(4, [0]), "waited"] and not sup.forming


def test_a_fleet_change_while_the_group_forms_forms_it_again_before_any_push(fake_ray, monkeypatch):
    clock, sup, placed, learner, jobs = _forming(monkeypatch)
    sup.poll(2)
    placed.engines[0].health_ref = _dead()  # the survivor dies while the group forms
    clock.now += 10
    sup.poll(3)  # its heartbeat: taken out at once; the formation in flight is not stopped
    jobs[0].finish()
    pushes = len(learner.pushes)
    sup.poll(4)  # formed with a dead member: formed again, with the replacement alone, before any push
    assert learner.pushes[pushes:] == ["waited"] and len(jobs) == 2 and list(placed.engines) == [1]
    jobs[1].finish()
    sup.poll(5)
    assert placed.log.count(("group", [1])) == 1 and learner.pushes[-2:] == [(5, [1]), "waited"]


def test_a_joiner_whose_push_failed_never_serves_and_is_replaced(fake_ray, monkeypatch, tmp_path):
    clock, sup, placed, learner = _replacement_up(monkeypatch, tmp_path)
    sup.poll(2)  # regroup with the replacement, push started
    placed.spawned[1].health_ref = _dead()  # it died under its first push
    learner.error = waits.WaitExpired("weight push: learner rank 0 failed: broadcast timed out")
    sup.poll(3)
    assert ("start", [1]) not in placed.log and list(placed.engines) == [0] and placed.joining == set()
    assert sup.restarts == 2 and set(sup.starting) == {1} and learner.pushes[-1] == (3, [0])  # regrouped at once
    events = [e["event"] for e in map(json.loads, (tmp_path / "fleet.jsonl").read_text().splitlines())]
    assert "joined" not in events and events[-3:] == ["failed", "removed", "starting"]


def test_a_replacement_that_dies_right_after_joining_is_replaced_not_fatal(fake_ray, monkeypatch):
    clock, sup, placed, learner = _replacement_up(monkeypatch)
    placed.start_fails[1] = "process died (SIGKILL)"
    sup.poll(2)
    sup.poll(3)  # the push landed; its start fails: replaced again, one restart more, the run goes on
    assert sup.restarts == 2 and list(placed.engines) == [0] and set(sup.starting) == {1} and sup.replaced == []
    assert fake_ray.count("new1") == 1


def test_an_engine_hung_inside_a_push_is_taken_out_once_the_push_runs_past_its_bound(fake_ray, monkeypatch):
    """The bound: 5 x the median push, at least health_check_timeout_s / 3, at most all of it. Past it, an
    engine still loading while another has loaded is hung (its heartbeat cannot tell: loading is silent)."""
    clock = Clock(monkeypatch)
    sup, placed, _ = _supervisor(load_config(None, CFG), {0: Engine("e0"), 1: Engine("e1"), 2: Engine("e2")})
    assert sup.push_bound() == 10.0  # no push measured yet: 30 / 3
    placed.push_durations = [0.5, 4.0, 9.0]
    assert sup.push_bound() == 20.0  # 5 x 4.0
    placed.push_durations = [7.0]
    assert sup.push_bound() == 30.0  # capped at health_check_timeout_s
    placed.push_durations = [1.0]
    placed.push_in_flight = (5, clock.now, dict(placed.engines))
    placed.engines[0].status_ref = Ref({"version": 5, "loading_s": None})  # loaded
    placed.engines[1].status_ref = Ref({"version": 4, "loading_s": 12.0})  # still loading
    placed.engines[2].status_ref = Ref({"version": 4, "loading_s": None})  # draining: not judged
    clock.now += 9.9
    sup.detect(5)  # within the bound (and before the first heartbeat): nobody is asked
    assert [e.calls for e in placed.engines.values()] == [[], [], []]
    clock.now += 0.2
    sup.detect(5)
    assert list(placed.engines) == [0, 2] and fake_ray == ["e1"] and sup.restarts == 1
    assert placed.log[0] == ("release", 1, "actor_failed")


def test_a_lone_engine_whose_processes_are_stopped_is_hung_inside_the_push(fake_ray, monkeypatch, caplog):
    """No other engine to compare with: one whose processes are stopped makes no progress, whatever it shows."""
    clock = Clock(monkeypatch)
    sup, placed, pushes = _supervisor(load_config(None, CFG), {0: Engine("e0")})
    placed.push_in_flight = (2, clock.now, dict(placed.engines))
    placed.engines[0].status_ref = Ref({"version": 1, "loading_s": 11.0, "stopped": []})
    clock.now += 10.5
    sup.detect(2)  # loading, alone, running: not judged (it may be slow; weight_sync.timeout_s bounds it)
    assert list(placed.engines) == [0]
    placed.engines[0].status_ref = Ref({"version": 1, "loading_s": 12.0, "stopped": [4242]})
    clock.now += 1.0
    sup.detect(2)
    assert list(placed.engines) == [] and fake_ray == ["e0"] and sup.restarts == 1
    assert "rollout actor 0 failed: hung inside the push of weight version 2: its processes [4242] are stopped" \
        in caplog.text
    sup.poll(3)  # no engine serves: a group of none, no push, until the replacement is up
    assert placed.log[-1] == ("group", []) and not sup.forming and not sup.pushing and list(sup.starting) == [0]
    assert [p for p in pushes if p != "waited"] == []


def test_a_push_that_every_engine_loaded_is_not_asked_about_again(fake_ray, monkeypatch):
    clock = Clock(monkeypatch)
    sup, placed, _ = _supervisor(load_config(None, CFG), {0: Engine("e0"), 1: Engine("e1")})
    placed.push_in_flight = (3, clock.now, dict(placed.engines))
    for e in placed.engines.values():
        e.status_ref = Ref({"version": 3, "loading_s": None})
    clock.now += 11
    sup.detect(3)
    clock.now += 5
    sup.detect(3)
    asked = [[c for c in e.calls if c == "push_status"] for e in placed.engines.values()]
    assert asked == [["push_status"], ["push_status"]] and sup.restarts == 0


def test_a_scale_json_that_cannot_be_read_is_refused_once_and_requests_are_new_by_number(fake_ray, monkeypatch,
                                                                                         tmp_path):
    """A FIFO, a directory or a symbolic link at scale.json is refused (logged, one scale_refused event) and
    the run goes on: poll() neither blocks nor raises. Two requests with the same mtime are both applied."""
    import os
    import threading

    from async_dapo.checkpoint.run_dir import write_scale_request

    Clock(monkeypatch)
    cfg = load_config(None, ["placement.num_engines=1", "placement.max_engines=3"])
    sup, placed, _ = _supervisor(cfg, {0: Engine("e0")}, tmp_path)
    run = RunDir(tmp_path)
    (tmp_path / "real.json").write_text(json.dumps({"engines": 2}))
    for make, kind in ((os.mkfifo, "not a regular file but a FIFO"), (os.mkdir, "not a regular file but a directory"),
                       (lambda p: p.symlink_to(tmp_path / "real.json"), "a symbolic link")):
        make(run.scale)
        polled = threading.Thread(target=lambda: [sup.poll(1) for _ in range(2)], daemon=True)  # refused once
        polled.start()
        polled.join(2)
        if polled.is_alive():
            os.close(os.open(run.scale, os.O_WRONLY | os.O_NONBLOCK))  # lets a reader blocked on the FIFO go
            pytest.fail(f"poll() blocked on {kind}")
        os.rmdir(run.scale) if run.scale.is_dir() and not run.scale.is_symlink() else run.scale.unlink()
        last = json.loads(run.fleet.read_text().splitlines()[-1])
        assert (last["event"], last["seq"]) == ("scale_refused", None) and last["reason"].startswith(
            f"{run.scale}: {kind}"), last
    assert sup.starting == {} and list(placed.engines) == [0]
    assert write_scale_request(run, {"engines": 1}).seq == 1  # as many as serve: answered all the same
    sup.poll(1)
    stamp = run.scale.stat().st_mtime_ns
    assert write_scale_request(run, {"engines": 2}).seq == 2
    os.utime(run.scale, ns=(stamp, stamp))  # a coarse clock (NFS) gives both the same mtime
    sup.poll(1)
    sup.poll(1)
    assert list(sup.starting) == [1]  # the second request was seen, and applied once
    events = [e for e in map(json.loads, run.fleet.read_text().splitlines()) if e["event"].startswith("scale")]
    assert [(e["event"], e["seq"]) for e in events] == [("scale_refused", None)] * 3 + [("scale", 1), ("scale", 2)]
    assert events[-2]["engines"] == 1 and events[-1]["adding"] == [1]


def test_the_loop_skips_its_push_while_a_group_forms():
    """The loop's own push goes over the weight group: while a new one forms, it is skipped (the regroup
    pushes the weights current once formed), and the previous push is not waited for again."""
    import types

    from async_dapo.orchestrator import Run

    run, calls = Run.__new__(Run), []
    run.version, run._push_failed_before = 5, False
    run.placed = types.SimpleNamespace(wait_push=lambda meanwhile=None: calls.append("wait"))
    run.supervisor = types.SimpleNamespace(forming=True, pushing=False, regroup_pending=False)
    assert run._previous_push_ok() is False and calls == []
    run.supervisor.forming = False
    assert run._previous_push_ok() is True and calls == ["wait"]
