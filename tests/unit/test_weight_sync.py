"""async_dapo.weights.sync's three interfaces without Ray or an engine: the learner's sender (one gloo rank:
snapshot, background send, the explicit "engines loaded version v" callback, failures reported once by
wait()), the placement-side group lifecycle (ranks, names, generations, the dtype rule) with stand-in
actor handles, and the engine-side load sequence against a stand-in tokenizer manager. The real push to
SGLang is tests/integration/test_learner.py and test_rollout.py."""

import asyncio
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from async_dapo.config import load_config
from async_dapo.waits import EnginesFailed, RunFailed
from async_dapo.weights.sync import (
    ActorCallback, Bucket, WeightGroup, WeightSender, WeightUpdateError, group_name, load, plan_buckets,
    sglang_name,
)


@pytest.fixture(scope="module")
def one_rank():
    from async_dapo.weights.sync import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def _sender(*sets):
    cfg = load_config(None, ["weight_sync.timeout_s=5", *sets])
    return WeightSender(cfg, 0, 1, "cpu", datetime.timedelta(seconds=30))


def _params():
    return [("model._orig_mod.w", torch.arange(6, dtype=torch.float32).reshape(3, 2)),
            ("lm_head.weight", torch.ones(2, 2))]


def test_push_snapshots_sends_and_then_calls_on_loaded_with_its_version(one_rank):
    sender, told = _sender(), []
    params = _params()
    out = sender.push(params, 7, [], told.append)
    params[0][1].add_(100)  # the next optimizer step: the snapshot must not see it
    assert sender.wait() >= 0.0
    assert told == [7]
    last = sender.last()
    assert last["version"] == 7 and last["error"] == "" and last["bytes"] == 0  # no group: nothing broadcast
    # 6 + 4 float32 values in the engine dtype (cpu auto -> float32); one bucket
    assert out["push_bytes"] == 40.0 and out["push_buckets"] == 1.0


def test_a_failing_callback_fails_the_push_and_wait_reports_it_once(one_rank):
    sender = _sender()

    def refuse(version):
        raise TimeoutError(f"queue did not take version {version}")

    sender.push(_params(), 3, [], refuse)
    with pytest.raises(RuntimeError, match="weight push of version 3 failed on rank 0: .*did not take version 3"):
        sender.wait()
    assert sender.wait() >= 0.0  # reported once: a retried push starts clean
    assert sender.last()["failed"].startswith("TimeoutError")


def test_a_push_never_overlaps_a_sender_still_busy(one_rank):
    sender, gate = _sender("weight_sync.timeout_s=0.2"), threading.Event()
    sender.push(_params(), 1, [], lambda v: gate.wait(30))  # the callback holds the sender
    with pytest.raises(RuntimeError, match=r"weight push of version 1: sender still busy after 0 s"):
        sender.push(_params(), 2, [], None)
    with pytest.raises(RuntimeError, match="sender still busy; cannot rebuild the weight group"):
        sender.close()
    gate.set()
    assert sender.wait() >= 0.0 and sender.last()["version"] == 1


def test_engine_names_drop_training_wrappers_and_buckets_split_by_dtype_and_size():
    assert sglang_name("model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    plan = plan_buckets([("a", torch.float32, (4,)), ("b", torch.float32, (4,)), ("c", torch.bfloat16, (2,)),
                         ("d", torch.bfloat16, (100,))], bucket_bytes=32)
    assert [b.names for b in plan] == [("a", "b"), ("c",), ("d",)]
    assert [b.nbytes for b in plan] == [32, 4, 200]


class _Method:
    def __init__(self, log, name, answer=None):
        self.log, self.name, self.answer = log, name, answer

    def remote(self, *args):
        self.log.append((self.name, args))
        return self.answer

    def options(self, concurrency_group=None):
        assert concurrency_group == "control", concurrency_group  # the only group a learner call names
        return self


class _Actor:
    """Records calls; ``.remote`` returns the answer itself, and the group's ``get`` passes it through."""

    def __init__(self, log, who, dtype="bfloat16"):
        for m in ("join_weight_group", "leave_weight_group", "open_weight_group", "close_weight_group"):
            setattr(self, m, _Method(log, f"{who}.{m}"))
        self.weight_dtype = _Method(log, f"{who}.weight_dtype", dtype)


class _Hung:
    """An answer that never comes."""


def _fake_ray(monkeypatch):
    """Ray with refs that are their own answers (a _Hung one never ready); records each wait's bound and
    refuses an unbounded wait on a pending ref (it would block the loop forever)."""
    import sys
    import types

    waits = []

    def wait(refs, num_returns=1, timeout=None):
        pending = [r for r in refs if isinstance(r, _Hung)]
        assert timeout is not None or not pending, "an unbounded wait on an engine that never answers"
        waits.append(timeout)
        return [r for r in refs if not isinstance(r, _Hung)], pending

    def get(ref, timeout=None):
        if isinstance(ref, Exception):  # a call that failed: ray.get raises its error
            raise ref
        return ref

    fake = types.SimpleNamespace(wait=wait, get=get,
                                 exceptions=types.SimpleNamespace(RayActorError=type("E", (Exception,), {})))
    monkeypatch.setitem(sys.modules, "ray", fake)
    return waits


def _group(log, *sets):
    cfg = load_config(None, list(sets))
    ports = iter(range(29500, 29600))
    got = []

    def get(refs, what, timeout_s=None):
        got.append(what)
        return refs

    return WeightGroup(cfg, "gloo", get, lambda: ("127.0.0.1", next(ports))), got


def test_the_group_places_each_engine_tp_ranks_after_learner_rank_0(monkeypatch):
    log, waits = [], _fake_ray(monkeypatch)
    group, waited = _group(log, "rollout.engine.tp_size=2", "placement.engine_gpus=2",
                           "rollout.engine.device=cuda", "placement.health_check_timeout_s=7")
    learner, engines = _Actor(log, "L"), {0: _Actor(log, "E0"), 3: _Actor(log, "E3")}
    group.open(learner, engines)
    joins = [args for name, args in log if name.endswith("join_weight_group")]
    assert joins == [("127.0.0.1", 29500, 5, 1, "async_dapo_weights_0", "gloo"),
                     ("127.0.0.1", 29500, 5, 3, "async_dapo_weights_0", "gloo")]
    # The learner's rendezvous is bounded like the engines' answers: by the heartbeat's bound, not the push's.
    assert ("L.open_weight_group", ("127.0.0.1", 29500, 5, "async_dapo_weights_0", "bfloat16", 7.0)) in log
    assert waited == ["learner rank 0 opening async_dapo_weights_0"] and waits == [7.0, 12.0]


def test_an_engine_that_hangs_in_the_rendezvous_is_named_within_the_heartbeat_bound(monkeypatch):
    log, waits = [], _fake_ray(monkeypatch)
    group, _ = _group(log, "placement.health_check_timeout_s=9")
    learner, engines = _Actor(log, "L"), {0: _Actor(log, "E0"), 1: _Actor(log, "E1")}
    engines[1].join_weight_group.answer = _Hung()
    # Engine 0's join fails because engine 1 never came (its rendezvous timed out): engine 0 is not to blame.
    engines[0].join_weight_group.answer = RuntimeError("init_weights_update_group refused: store timeout")
    with pytest.raises(EnginesFailed) as err:
        group.open(learner, engines)
    assert err.value.failed == {1: "did not answer in 9 s (hung)"} and waits == [9.0, 14.0]
    assert str(err.value) == "engines joining async_dapo_weights_0: rollout actor 1 did not answer in 9 s (hung)"


def test_an_engine_that_hangs_leaving_is_named_before_the_new_group_forms(monkeypatch):
    log, waits = [], _fake_ray(monkeypatch)
    group, _ = _group(log, "placement.health_check_timeout_s=9")
    learner, engines = _Actor(log, "L"), {0: _Actor(log, "E0"), 2: _Actor(log, "E2")}
    engines[2].leave_weight_group.answer = _Hung()
    with pytest.raises(EnginesFailed, match=r"engines leaving async_dapo_weights_0: rollout actor 2 did not answer"):
        group.rebuild(learner, engines)
    assert [n for n, _ in log] == ["L.close_weight_group", "E0.leave_weight_group", "E2.leave_weight_group"]
    assert waits == [9.0] and group.name == "async_dapo_weights_1"  # one wait for both, the next name is fresh


def test_a_rebuild_closes_leaves_and_reopens_under_the_next_name_and_a_new_port(monkeypatch):
    log = []
    _fake_ray(monkeypatch)
    group, _ = _group(log)
    learner, engines = _Actor(log, "L"), {0: _Actor(log, "E0")}
    group.open(learner, engines)
    log.clear()
    group.rebuild(learner, engines)
    assert group.name == group_name(1) == "async_dapo_weights_1"
    assert [n for n, _ in log] == ["L.close_weight_group", "E0.leave_weight_group", "E0.weight_dtype",
                                   "E0.join_weight_group", "L.open_weight_group"]
    assert log[1][1] == ("async_dapo_weights_0",)
    assert log[3][1][:2] == ("127.0.0.1", 29501) and log[3][1][4] == "async_dapo_weights_1"


def test_engines_in_different_dtypes_stop_the_run_naming_the_key(monkeypatch):
    log = []
    _fake_ray(monkeypatch)
    group, _ = _group(log)
    with pytest.raises(RunFailed, match=r"different dtypes \['bfloat16', 'float32'\]: set rollout.engine.dtype"):
        group.open(_Actor(log, "L"), {0: _Actor(log, "E0"), 1: _Actor(log, "E1", dtype="float32")})
    assert not [n for n, _ in log if n.endswith("join_weight_group")]  # nobody was left waiting in a rendezvous


def test_the_loaded_callback_tells_the_actor_method_its_version(monkeypatch):
    import sys
    import types

    waited = []
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(
        get=lambda ref, timeout=None: waited.append((ref, timeout))))
    log = []
    queue = types.SimpleNamespace(set_version=_Method(log, "set_version", "ref"))
    ActorCallback(queue, "set_version", 12.0)(4)
    assert log == [("set_version", (4,))] and waited == [("ref", 12.0)]


class _LoadTM:
    """Tokenizer manager stand-in for the engine end: refuses bucket ``refuse_at`` if set."""

    def __init__(self, refuse_at=None):
        self.calls, self.refuse_at = [], refuse_at

    async def begin_weight_update(self, obj, request):
        self.calls.append("begin")
        return True, ""

    async def update_weights_from_distributed(self, obj, request):
        self.calls.append((tuple(obj.names), obj.flush_cache, obj.weight_version, obj.group_name))
        return (False, "shape mismatch") if len(self.calls) - 1 == self.refuse_at else (True, "")

    async def end_weight_update(self, obj, request):
        self.calls.append("end")
        return True, ""


BUCKETS = [Bucket(("a",), ("float32",), ((2,),)), Bucket(("b", "c"), ("float32", "float32"), ((1,), (3,)))]


def test_the_engine_loads_buckets_in_order_and_flushes_its_cache_once():
    tm = _LoadTM()
    asyncio.run(load(tm, BUCKETS, "g", 5))
    assert tm.calls == ["begin", (("a",), False, "5", "g"), (("b", "c"), True, "5", "g"), "end"]


def test_a_refused_bucket_still_ends_the_update_and_raises():
    tm = _LoadTM(refuse_at=1)
    with pytest.raises(WeightUpdateError, match="weight update to version 5 refused: shape mismatch"):
        asyncio.run(load(tm, BUCKETS, "g", 5))
    assert tm.calls == ["begin", (("a",), False, "5", "g"), "end"]
