"""The supervisor's stop rule, without Ray: once placement.max_engine_restarts replacements are used up, a
failed rollout actor stops the run with one line naming the actor, the reason and the last checkpoint."""

import pytest

from async_dapo.config import load_config
from async_dapo.supervise import EngineSupervisor, RunFailed


class _Placed:
    def __init__(self, cfg):
        self.cfg, self.engines = cfg, []


def test_exhausted_restarts_stop_the_run_naming_actor_and_checkpoint():
    cfg = load_config(None, ["placement.max_engine_restarts=2"])
    sup = EngineSupervisor(_Placed(cfg), lambda: "runs/x/checkpoints/step_40 (continue with --resume runs/x)")
    sup.restarts = 2
    with pytest.raises(RunFailed) as err:
        sup.replace(3, "process died (SIGKILL)", 41, push=None)
    msg = str(err.value)
    assert msg == ("rollout actor 3 failed: process died (SIGKILL); placement.max_engine_restarts (2) exhausted; "
                   "last checkpoint: runs/x/checkpoints/step_40 (continue with --resume runs/x)")
    assert "\n" not in msg and sup.restarts == 2
