"""Starts that used to wait without a bound: joining a Ray cluster that is not there, and the engine start of
``async-dapo eval``. Each now stops after its configured bound with one line naming what it waited for.
Both run in a child process: an unfinished ray.init or engine start must not stay in the test process."""

import subprocess
import sys
import time

import pytest

from tests.conftest import CPU_CONFIG, REPO

pytestmark = pytest.mark.integration

JOIN = """
import sys
from async_dapo.config import load_config
from async_dapo.placement import connect_ray
from async_dapo.supervise import WaitExpired
cfg = load_config(None, ["placement.ray_address=127.0.0.9:6399", "placement.start_timeout_s=3"])
try:
    connect_ray(cfg)
except WaitExpired as exc:
    print(exc)
    sys.exit(0)
sys.exit("connected to a cluster that does not exist")
"""


def test_joining_an_absent_cluster_stops_after_start_timeout():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("ray.init(address='127.0.0.9:6399'): not connected in 3 s "
                                  "(placement.start_timeout_s)")
    assert time.monotonic() - t0 < 60


def test_eval_engine_start_is_bounded(tiny_model):
    cmd = [str(REPO / ".venv" / "bin" / "async-dapo") if (REPO / ".venv").exists() else "async-dapo", "eval",
           "--config", str(CPU_CONFIG), "--set", f"model.path={tiny_model}", "--set", "model.bootstrap=null",
           "--set", "placement.start_timeout_s=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert lines[-1] == ("eval failed: TimeoutError: engine start (placement.start_timeout_s): not ready in 2 s "
                         "(no log file)"), lines[-3:]
