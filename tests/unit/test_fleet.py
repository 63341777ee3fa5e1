"""The rollout fleet's logic without Ray or an engine: the supervisor's background state machine (a failure
takes the engine out and rebuilds the group with the survivors at once; the replacement joins only when its
engine is up, after the current weights were pushed to it; a hung heartbeat is judged by its age, never
waited for), scale requests (added engines, removal order, refusals), and the placement's fit check that
stops an impossible run at once with one line. Ray's calls are replaced by a scripted double; the real
paths are tests/integration/test_fleet_e2e.py."""

import json

import pytest
import ray

from async_dapo import supervise
from async_dapo.checkpoints import RunDir
from async_dapo.config import load_config
from async_dapo.placement import check_fits
from async_dapo.supervise import EngineSupervisor, RunFailed, scale_target


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

    def _call(self, what, ref):
        self.calls.append(what)
        return ref

    def __repr__(self):
        return self.name


class Placed:
    """What the supervisor uses of async_dapo.placement.Placed, recording what it was asked to do."""

    def __init__(self, cfg, engines):
        self.cfg, self.engines, self.starting, self.engine_pgs = cfg, dict(engines), {}, {}
        self.log, self.placed_groups, self.room = [], set(), None
        self.replay = type("Q", (), {"release_engine": _Method(lambda rank, why: self._did("release", rank, why))})()
        self.spawned: dict[int, Engine] = {}

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
        self.spawned[rank] = Engine(f"new{rank}", up=Ref(done=False))
        return self.spawned[rank]

    def rebuild_weight_group(self):
        self.log.append(("group", sorted(self.engines)))

    def start_rollouts(self, which):
        self.log.append(("start", which))

    def check_room(self, engines):
        if self.room is not None and engines > self.room:
            raise RunFailed(f"the placement cannot be held with {engines} engines")

    def remove_engine_group(self, rank):
        self.engine_pgs.pop(rank, None)
        self.log.append(("pg_removed", rank))


@pytest.fixture
def fake_ray(monkeypatch):
    killed = []
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: ([r for r in refs if r.done],
                                                                                  [r for r in refs if not r.done]))

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


def _supervisor(cfg, engines, tmp_path=None):
    placed = Placed(cfg, engines)
    pushes = []
    sup = EngineSupervisor(placed, lambda: "ckpt", push_now=lambda v: pushes.append((v, sorted(placed.engines))),
                           wait_push=lambda: pushes.append("waited"), run_dir=RunDir(tmp_path) if tmp_path else None)
    return sup, placed, pushes


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
    clock.now += 30
    sup.poll(12)  # up: the group takes it, the current weights are pushed, and only then does it start admitting
    assert placed.log[-2:] == [("group", [0, 1]), ("start", [1])]
    assert pushes[-1] == (12, [0, 1]) and list(placed.engines) == [0, 1] and sup.starting == {}
    assert sup.replaced == [{"engines": [1], "why": "replacement", "version": 12, "recovery_s": 35.0, "start_s": 35.0}]
    events = [e["event"] for e in map(json.loads, (tmp_path / "fleet.jsonl").read_text().splitlines())]
    assert events == ["failed", "removed", "starting", "regrouped", "up", "regrouped", "joined"]


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
    sup.poll(5)
    assert list(placed.engines) == [0, 1] and list(sup.starting) == [2]
    run.scale.write_text(json.dumps({"engines": 1}))
    import os

    os.utime(run.scale, ns=(1, 1))  # a new request (another mtime)
    sup.poll(5)
    # The one still starting goes first, then the serving one with the highest rank: released, shut down, killed.
    assert sup.starting == {} and list(placed.engines) == [0]
    assert ("pg_removed", 2) in placed.log and ("pg_removed", 1) in placed.log
    assert ("release", 1, "scaled_down") in placed.log and placed.spawned[1].calls[-1] == "shutdown"
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
    calls = {"n": 0}

    def rebuild_fails_once():
        calls["n"] += 1
        if calls["n"] == 1:  # the rebuild with the replacement: it died right after it came up
            placed.spawned[1].health_ref = _dead()
            raise supervise.ActorDied("engines joining weights_1: rollout actor 1 died (gone)")
        placed.log.append(("group", sorted(placed.engines)))

    placed.rebuild_weight_group = rebuild_fails_once
    sup.poll(2)  # the replacement is taken out again (a restart more), nothing admits, no RunFailed
    assert list(placed.engines) == [0] and sup.restarts == 2 and sup.regroup_pending
    assert ("start", [1]) not in placed.log
    sup.poll(3)  # the next poll rebuilds with the survivor
    assert placed.log[-1] == ("group", [0]) and pushes[-1] == (3, [0]) and set(sup.starting) == {1}
