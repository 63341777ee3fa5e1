"""End to end through the real stack (SGLang CPU engine, Ray, zmq, FSDP2/gloo, TensorBoard): a few
asynchronous steps; then a run killed after a checkpoint and resumed with --resume reproduces the next
step's loss; then a tiny run submitted with `ray job submit` to a local head finishes SUCCEEDED.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CPU_CONFIG, REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUIRED_TAGS = """critic/score/mean critic/rewards/mean critic/advantages/mean reward/acc_mean response_length/mean
response_length/max response_length/clip_ratio prompt_length/mean actor/entropy actor/token_prob_mean actor/pg_clipfrac
actor/pg_clipfrac_upper actor/pg_clipfrac_low_side actor/pg_clipfrac_lower actor/ppo_kl actor/grad_norm actor/grad_norm_max actor/pg_loss
actor/lr actor/is_weight_mean actor/is_weight_max actor/rollout_logprob_abs_diff staleness/mean staleness/max replay/depth
replay/dropped_all_correct replay/dropped_all_wrong replay/dropped_stale replay/rejected_malformed
perf/gen_tokens_per_s perf/train_tokens_per_s perf/time_per_step perf/total_num_tokens perf/wait_data_s perf/weight_push_s
perf/weight_push_stall_s perf/learner_idle_ratio perf/rollout_idle_ratio train/version val/avg_at_k val/pass_at_k
val/maj_at_k""".split()
ETA = 1


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(CPU_CONFIG),
            "--set", f"logging.run_dir={run_dir}", "--set", f"replay.max_staleness={ETA}",
            *SMALL, *extra]


# The default's 64-group batches make a step ~2.5 s here; the system tests only need a few small steps.
SMALL = ["--set", "logging.val_prompts=16", "--set", "logging.val_n=2", "--set", "checkpoint.export_hf=false",
         "--set", "algorithm.train_batch_groups=16", "--set", "learner.mini_batch_groups=16",
         "--set", "rollout.max_inflight_prompts=32"]


def _steps(run_dir: Path) -> list[dict]:
    """The training-step rows of metrics.jsonl (not the validation rows or the final wall-time row)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in rows if "train/version" in m]


def test_async_run_end_to_end(tiny_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    # A validation of 600 distinct problems x 32 samples (many steps' worth of generation) at steps 0, 2, 4:
    # the learner must not wait for it. (With 8 samples a validation sometimes ended within one step.)
    subprocess.run(_train_cmd(run_dir, "--set", "learner.total_steps=4", "--set", "logging.val_every_steps=2",
                              "--set", "logging.val_prompts=600", "--set", "logging.val_n=32"),
                   check=True, cwd=REPO, timeout=900)
    steps = _steps(run_dir)
    assert [m["train/version"] for m in steps] == [1.0, 2.0, 3.0, 4.0]  # versions advance
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = {r["step"]: (i, r) for i, r in enumerate(rows) if "val/avg_at_k" in r}
    trained = {int(r["train/version"]): i for i, r in enumerate(rows) if "train/version" in r}
    # val_before_train, every 2 steps and the last; one due while the previous still ran is skipped and
    # counted (this validation takes several steps), the last one is always there
    skipped = int(steps[-1]["val/skipped"])
    assert {0, 4} <= set(vals) <= {0, 2, 4} and len(vals) + skipped == 3, (sorted(vals), skipped)
    # Validation off the critical path: the validation started at step 0 (or 2) was logged only after the
    # learner had trained the next step, and it reports the policy versions that produced its samples.
    assert any(trained[s + 1] < i for s, (i, _) in vals.items() if s + 1 in trained), [r.get("step") for r in rows]
    for s, (_, r) in vals.items():
        assert s <= r["val/version"] <= r["val/version_max"] and r["val/distinct_prompts"] == 600
    assert all(m["staleness/max"] <= ETA for m in steps)  # every trained group within eta
    assert max(m["staleness/max"] for m in steps) >= 1  # and the run really overlapped
    last = steps[-1]
    assert last["replay/dropped_all_correct"] + last["replay/dropped_all_wrong"] > 0  # drops are counted
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    missing = set(REQUIRED_TAGS) - set(events.Tags()["scalars"])
    assert not missing, missing


def _started_processes(driver: int, run_dir: Path) -> dict[int, str]:
    """Every process the run started, by PID: the driver's descendants (the Ray instance it started, every
    actor's worker process, the engines' scheduler and detokenizer), checked against actors.json so that
    the roles the run reports are really among them."""
    import psutil

    procs = {p.pid: " ".join(p.cmdline()[:3]) for p in psutil.Process(driver).children(recursive=True)}
    actors = json.loads((run_dir / "actors.json").read_text())
    roles = [actors["rollout"]["0"], actors["learner"]["0"], actors["replay"]]
    assert all(pid in procs for pid in roles), (roles, procs)
    engine_children = psutil.Process(actors["rollout"]["0"]).children(recursive=True)
    assert len(engine_children) >= 2, engine_children  # SGLang's scheduler and detokenizer
    assert any("gcs_server" in cmd for cmd in procs.values()) and any("raylet" in cmd for cmd in procs.values())
    return procs


def _assert_gone(procs: dict[int, str], within_s: float = 60.0) -> None:
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + within_s
    while (left := {pid: cmd for pid, cmd in procs.items() if alive(pid)}) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"still running after SIGTERM: {left}"


def test_kill_after_checkpoint_then_resume_gives_same_next_step_loss(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # Run 1 checkpoints every 2 steps and records every batch it trains on; it is stopped (SIGTERM to the
    # driver alone: its own shutdown must end everything it started) once it has trained at least one step
    # past a checkpoint.
    cmd = _train_cmd(run_dir, "--set", "learner.total_steps=60", "--set", "checkpoint.every_steps=2",
                     "--set", "checkpoint.keep_last=100", "--set", "logging.val_every_steps=0",
                     "--set", "logging.record_batches=true")
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not (
                (run_dir / "metrics.jsonl").exists() and len(_steps(run_dir)) >= 3):
            time.sleep(0.5)
        assert proc.poll() is None, "run 1 ended early"
        started = _started_processes(proc.pid, run_dir)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:  # only if the test failed before or while stopping it: its whole group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == 130  # SIGTERM takes the Ctrl-C path: every actor and engine shut down
    _assert_gone(started)
    logged = {int(m["train/version"]): m for m in _steps(run_dir)}
    done = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / "meta.json").exists())
    ckpt = max(s for s in done if s + 1 in logged)  # a complete checkpoint whose next step run 1 trained

    # Run 2 resumes from that checkpoint and trains on run 1's recorded next batch.
    subprocess.run(_train_cmd(run_dir, "--resume", str(run_dir / "checkpoints" / f"step_{ckpt}"),
                              "--set", f"learner.total_steps={ckpt + 1}", "--set", "logging.val_every_steps=0",
                              "--set", f"data.replay_batches={run_dir / 'batches'}"),
                   check=True, cwd=REPO, timeout=900)
    resumed = _steps(run_dir)[-1]
    assert resumed["train/version"] == ckpt + 1
    assert resumed["actor/pg_loss"] == logged[ckpt + 1]["actor/pg_loss"]  # bit-identical next-step loss
    assert resumed["actor/grad_norm"] == logged[ckpt + 1]["actor/grad_norm"]


def test_ray_job_submit_to_local_head_succeeds(tiny_model, tmp_path):
    import re

    from tests.raycluster import LocalCluster

    # One node on its own loopback address, ended by PID (a plain `ray stop` would end every Ray instance here).
    cluster = LocalCluster(ips=("127.0.0.2",), cpus=2).start()
    env, dash = cluster.env, cluster.dashboard_url
    try:
        job = subprocess.run(
            [str(REPO / "tools" / "cluster" / "submit.sh"), "--address", dash, "--",
             "--config", str(CPU_CONFIG), "--set", f"model.path={tiny_model}", "--set", "model.bootstrap=null",
             "--set", f"logging.run_dir={tmp_path / 'job_run'}", "--set", "learner.total_steps=2",
             "--set", "logging.val_every_steps=0", *SMALL],
            env=env, timeout=900, capture_output=True, text=True)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        job_id = re.search(r"raysubmit_\w+", job.stdout + job.stderr).group(0)
        # A fresh interpreter: Ray reads RAY_AUTH_MODE at import (the head enables token auth, see submit.sh).
        probe = ("import sys; from ray.job_submission import JobSubmissionClient as C; "
                 "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)")
        status = subprocess.run([sys.executable, "-c", probe, dash, job_id],
                                env={**env, "RAY_AUTH_MODE": "token"}, timeout=120, capture_output=True, text=True)
        assert status.stdout.strip() == "SUCCEEDED", status.stdout + status.stderr[-2000:]
        steps = _steps(tmp_path / "job_run")
        assert [m["train/version"] for m in steps] == [1.0, 2.0]
    finally:
        cluster.stop()  # the node we started, by PID
