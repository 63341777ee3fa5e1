"""Fault injection through the real stack (SGLang CPU engine, Ray, zmq, FSDP2/gloo), each asserting the
outcome the user relies on (docs/reliability.md); engines killed or hung while a fleet trains are
test_fleet_e2e's:

* at eta = 0, a fraction of groups failing in the reward function (each abandoned, counted and its prompt
  re-issued: the run, which would deadlock if one slot leaked, trains every step), then a learner rank
  SIGKILLed: the run exits 1 within a bound, naming the rank and the last checkpoint; ``--resume`` trains
  the remaining steps, with exactly one metrics row per step and no prompt trained twice in an epoch;
* silence: no group ever reaches the queue, and the run stops naming what it waited for.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from tests.conftest import CPU_CONFIG, REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = ["--set", "logging.val_every_steps=0", "--set", "checkpoint.export_hf=false",
         "--set", "algorithm.train_batch_groups=16", "--set", "learner.mini_batch_groups=16",
         "--set", "rollout.max_inflight_prompts=32"]
# Fast fault detection for a 0.4M-parameter model (a push takes ~0.02 s, a request well under 1 s).
FAST = ["--set", "placement.health_check_interval_s=2", "--set", "placement.health_check_timeout_s=10",
        "--set", "weight_sync.timeout_s=20",
        "--set", "replay.silence_timeout_s=90"]


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(CPU_CONFIG),
            "--set", f"logging.run_dir={run_dir}", *SMALL, *FAST, *extra]


def _rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train_rows(run_dir: Path) -> list[dict]:
    return [m for m in _rows(run_dir) if "train/version" in m]


def _wait(pred, proc, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _actors(run_dir: Path) -> dict:
    return json.loads((run_dir / "actors.json").read_text())


def _start(cmd, log: Path):
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _end(proc) -> None:
    if proc.poll() is None:  # only if a test failed: the run's own process group, by its PID
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


def test_failing_groups_and_a_killed_learner_at_eta_0_then_resume_finishes(tiny_model, tmp_path):
    """At eta = 0, where a single leaked slot would deadlock the run, with ~34 % of the groups failing in the
    reward function (each abandoned, counted and its prompt re-issued): learner rank 0 is SIGKILLed after
    step 5, and the run exits 1 within a bound, naming the rank and the last checkpoint; ``--resume`` trains
    the remaining steps, with exactly one metrics row per step and no prompt trained twice in an epoch."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    flaky = REPO / "tests" / "faults" / "flaky_reward.py"
    sets = ["--set", "learner.total_steps=10", "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep_last=10",
            "--set", "replay.max_staleness=0", "--set", f"reward.function={flaky}:score"]
    proc = _start(_cmd(run_dir, *sets), log)
    try:
        _wait(lambda: len(_train_rows(run_dir)) >= 5, proc, 600, "step 5")
        os.kill(_actors(run_dir)["learner"]["0"], signal.SIGKILL)
        t_kill = time.time()
        rc = proc.wait(timeout=300)
    finally:
        _end(proc)
    noticed_s = time.time() - t_kill
    lines = [line for line in log.read_text().splitlines() if line.startswith("run failed:")]
    assert rc == 1 and len(lines) == 1, log.read_text()[-3000:]
    assert "learner rank 0 died" in lines[0] and "last checkpoint: " in lines[0], lines[0]
    ckpt_step = int(lines[0].split("checkpoints/step_")[1].split()[0])
    assert ckpt_step >= 4 and ckpt_step % 2 == 0
    print(f"\nlearner SIGKILL -> run exited 1: {noticed_s:.1f} s; {lines[0]}")
    assert noticed_s < 120  # a dead learner ends the run in bounded time (process exit included)
    _assert_failed_groups_counted(_train_rows(run_dir))

    # What the checkpoint kept of the work not trained yet (groups queued, the batch of the step the dead
    # learner did not finish): the resumed run reads every report of it back.
    kept = len(msgpack.unpackb((run_dir / "checkpoints" / f"step_{ckpt_step}" / "partials.bin").read_bytes()))
    resumed = subprocess.run(_cmd(run_dir, "--resume", str(run_dir), *sets), cwd=REPO, timeout=900,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _train_rows(run_dir)
    assert [m["step"] for m in rows] == list(range(1, 11))  # exactly one metrics row per step across kill + resume
    _assert_prompts_trained_once(run_dir)
    _assert_failed_groups_counted(rows)
    print(f"the checkpoint of step {ckpt_step} kept {kept} groups' work; the resumed run handed out "
          f"{rows[-1]['replay/partial_tokens_handed_out']:.0f} of its tokens")
    assert rows[-1]["replay/partials_restored"] == kept


def _assert_failed_groups_counted(rows: list[dict]) -> None:
    """Every step synchronous, and the groups the reward function failed abandoned under their reason (the
    run trained every step regardless: no slot leaked)."""
    last = rows[-1]
    print(f"abandoned {last['replay/abandoned']:.0f} groups (score_error) of {last['replay/received']:.0f} received "
          f"by the queue of the run that logged step {last['step']}")
    assert last["replay/abandoned/score_error"] >= 5  # ~34% of groups fail; each counted by reason
    assert last["replay/abandoned"] == last["replay/abandoned/score_error"]
    assert all(m["staleness/max"] == 0 for m in rows)  # still synchronous


def _assert_prompts_trained_once(run_dir: Path) -> None:
    """prompts.jsonl: one line per step, and no (epoch, prompt) pair trained twice."""
    rows = _rows(run_dir, "prompts.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    pairs = [tuple(p) for r in rows for p in r["prompts"]]
    assert len(pairs) == len(set(pairs)), "a prompt was trained twice in one epoch"


def test_silence_stops_the_run_with_what_it_waited_for(tiny_model, tmp_path):
    """A fault no heartbeat can see: the engine is healthy, but every group it makes is larger than
    transport.max_message_bytes (1 KiB here; a group is >= 2 KB), so each is abandoned as oversized and
    its prompt re-issued, and no group ever reaches the queue. After replay.silence_timeout_s the run exits
    1 with one line naming the wait, the live actors, the queue's counts and the abandon reasons — it
    never spins silently."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    t0 = time.time()
    # The shortest silence the config allows here: > health_check_timeout_s + weight_sync.timeout_s (10 + 8).
    done = subprocess.run(_cmd(run_dir, "--set", "learner.total_steps=5", "--set", "transport.max_message_bytes=1024",
                               "--set", "weight_sync.timeout_s=8", "--set", "replay.silence_timeout_s=20"),
                          cwd=REPO, timeout=600, capture_output=True, text=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("run failed:")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    print(f"\nstart -> exit 1: {time.time() - t0:.1f} s; {lines[0]}")
    assert "no group for" in lines[0] and "(replay.silence_timeout_s)" in lines[0]
    assert "1 of 1 serving rollout actors alive" in lines[0] and "running" in lines[0] and "queued" in lines[0]
    assert "abandoned" in lines[0] and "oversized" in lines[0]
    assert _train_rows(run_dir) == []
