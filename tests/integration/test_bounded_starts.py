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
from async_dapo.fleet.placement import connect_ray
from async_dapo.waits import WaitExpired
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


PLACE = """
import logging, os, sys
from async_dapo.fleet import placement
from async_dapo.config import load_config
from async_dapo.waits import RunFailed
logging.basicConfig(level=logging.INFO, format="%(message)s")
placement.REPORT_EVERY_S = 2.0  # the one-minute report, sooner
over = os.cpu_count() + 1  # one engine more than this machine has CPUs, one CPU each
cfg = load_config(None, [f"placement.num_engines={over}", "placement.start_timeout_s=120"] + sys.argv[1:])
park = placement.connect_ray(cfg)
cfg.placement.start_timeout_s = 7  # after Ray's own start, which may take longer on a loaded machine
try:
    placement.place(cfg)
except RunFailed as exc:
    print("STOP", exc)
    sys.exit(0)
sys.exit("placed a run the cluster cannot hold")
"""


def _place(*overrides: str) -> tuple[str, str, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", PLACE, *overrides], capture_output=True, text=True, timeout=180,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr, time.monotonic() - t0


def test_a_placement_the_cluster_cannot_hold_stops_at_once_naming_fields_and_resources():
    stdout, _, seconds = _place()
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("STOP the placement cannot be held: it needs ") and "placement.num_engines=" in line
    assert "but the cluster has " in line and "on 1 node(s)" in line and "placement.autoscaling" in line
    assert seconds < 90  # at once after Ray's start, not after placement.start_timeout_s of waiting


def test_a_placement_that_waits_for_nodes_says_so_and_is_bounded():
    """With placement.autoscaling nodes may come: it waits, reporting what it waits for, up to its bound."""
    stdout, stderr, _ = _place("placement.autoscaling=true")
    reports = [line for line in stderr.splitlines() if "placement: waiting for resources:" in line]
    assert len(reports) >= 2 and "bundle(s)" in reports[0] and "the cluster has free" in reports[0], stderr[-2000:]
    line = stdout.strip().splitlines()[-1]
    assert "not placed in 7 s (placement.start_timeout_s); the cluster has free" in line, line
