"""Multi-node rule at start: a placement that lands on more nodes than placement.nnodes stops the run with
one line saying what to set (the load-time rules were checked for nnodes)."""

import pytest

from async_dapo.config import load_config
from async_dapo.placement import check_nodes
from async_dapo.supervise import RunFailed


def test_a_placement_on_more_nodes_than_nnodes_stops_the_run(monkeypatch):
    import importlib

    pg_module = importlib.import_module("ray.util.placement_group")  # the module (ray.util also names a function so)
    monkeypatch.setattr(pg_module, "placement_group_table",
                        lambda pg: {"bundles_to_node_id": {0: "node-a", 1: "node-b", 2: "node-a"}})
    with pytest.raises(RunFailed, match=r"spans 2 nodes but placement.nnodes is 1: set placement.nnodes") as err:
        check_nodes(load_config(None), pg=None)
    assert "\n" not in str(err.value) and "logging.run_dir" in str(err.value)
    check_nodes(load_config(None, ["placement.nnodes=2", "logging.run_dir=/mnt/shared/run",
                                   "transport.bind_host=0.0.0.0"]), pg=None)  # declared: fine
