"""The supervisor's stop rule, without Ray: once placement.max_engine_restarts replacements are used up, a
failed rollout actor stops the run with one line naming the actor and the reason (the orchestrator adds
the last checkpoint)."""

import pytest

from async_dapo.config import load_config
from async_dapo.fleet.supervise import EngineSupervisor
from async_dapo.waits import RunFailed


class _Placed:
    def __init__(self, cfg):
        self.cfg, self.engines = cfg, {}


def test_exhausted_restarts_stop_the_run_naming_actor_and_checkpoint():
    cfg = load_config(None, ["placement.max_engine_restarts=2"])
    sup = EngineSupervisor(_Placed(cfg), lambda: "unused", push=None, wait_push=None, push_status=None)
    sup.restarts = 1
    with pytest.raises(RunFailed) as err:  # two failures in one heartbeat, one restart left: none replaced
        sup.replace([(3, "process died (SIGKILL)"), (5, "no output from the engine in 30 s (hung)")], 41)
    msg = str(err.value)
    assert msg == ("rollout actor 3 failed: process died (SIGKILL), rollout actor 5 failed: no output from the "
                   "engine in 30 s (hung); placement.max_engine_restarts (2) exhausted")
    assert "\n" not in msg and sup.restarts == 1  # the orchestrator appends the last checkpoint
