"""Multi-node rule at start: a placement that lands on more nodes than placement.nnodes stops the run with
one line saying what to set (the load-time rules were checked for nnodes)."""

import pytest

from async_dapo.config import load_config
from async_dapo.fleet.placement import check_nodes
from async_dapo.waits import RunFailed


def test_a_placement_on_more_nodes_than_nnodes_stops_the_run(monkeypatch):
    import importlib

    import ray

    pg_module = importlib.import_module("ray.util.placement_group")  # the module (ray.util also names a function so)
    monkeypatch.setattr(pg_module, "placement_group_table",
                        lambda pg: {"bundles_to_node_id": {0: "node-a", 1: "node-b", 2: "node-a"}})
    driver = {"node": "node-a"}
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"get_node_id": lambda self: driver["node"]})())
    with pytest.raises(RunFailed, match=r"spans 2 nodes \(the driver's included\) but placement.nnodes is 1: set "
                                        r"placement.nnodes") as err:
        check_nodes(load_config(None), pgs=[None])
    assert "\n" not in str(err.value) and "logging.run_dir" in str(err.value)
    two = load_config(None, ["placement.nnodes=2", "logging.run_dir=/mnt/shared/run", "transport.bind_host=0.0.0.0"])
    check_nodes(two, pgs=[None])  # declared: fine
    driver["node"] = "node-c"  # a head that only drives: the replay queue's node is a third one
    with pytest.raises(RunFailed, match=r"spans 3 nodes \(the driver's included\) but placement.nnodes is 2"):
        check_nodes(two, pgs=[None])


class _Id:
    def __init__(self, value):
        self.value = value

    def hex(self):
        return self.value


class _Handle:
    def __init__(self, actor_id):
        self._actor_id = _Id(actor_id)


def test_a_dead_actor_behind_a_single_call_is_named(monkeypatch):
    """Placed.get on one actor's call: the stop line says which actor died (learner rank, rollout actor or
    replay queue), found by the actor id in Ray's error, not "actor died" alone."""
    import ray

    from async_dapo.fleet.placement import Placed
    from async_dapo.waits import ActorDied

    placed = Placed(load_config(None), pg=None, replay=_Handle("aa01"), engines={0: _Handle("bb01"), 1: _Handle("bb02")},
                    learners=[_Handle("cc01"), _Handle("cc02")])
    for actor_id, role in [("cc02", "learner rank 1"), ("bb02", "rollout actor 1"), ("aa01", "replay queue"),
                           ("dd0123456789abcdef", "actor dd0123456789"), (None, "an actor")]:
        def dead(refs, timeout, actor_id=actor_id):
            raise ray.exceptions.RayActorError(actor_id=actor_id, error_msg="The actor died unexpectedly")

        monkeypatch.setattr(ray, "get", dead)
        with pytest.raises(ActorDied) as err:
            placed.get("ref", "close weight group")
        assert str(err.value) == f"close weight group: {role} died (The actor died unexpectedly)"
