"""The calibration's run phase (tools/bench/in_run.py): the cores a run's processes use, split into the
engines' schedulers, the learner ranks and the background, and the training loop's own seconds per step,
on hand-made samples; and its sampling of a real process tree."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
import in_run  # noqa: E402


def test_cores_by_role_splits_schedulers_learner_ranks_and_the_rest():
    """Over 4 s: the scheduler used 3.2 CPU s (0.8 cores), learner rank 7 1.6 s (0.4), the driver 0.4 s and
    the replay queue 0.8 s (0.3 together); a process born in the window (the detokenizer, 0.4 s) counts from
    zero; one that ended before the second sample is not counted."""
    before = {10: (5.0, "sglang::scheduler"), 7: (2.0, "ray::LearnerWorker"), 1: (3.0, "python"),
              2: (1.0, "ray::ReplayQueue.admit"), 99: (9.0, "gone")}
    after = {10: (8.2, "sglang::scheduler"), 7: (3.6, "ray::LearnerWorker"), 1: (3.4, "python"),
             2: (1.8, "ray::ReplayQueue.get_batch"), 11: (0.4, "sglang::detokenizer")}
    cores = in_run.cores_by_role(before, after, 4.0, learner_pids={7})
    assert cores["engines"] == pytest.approx(0.8)
    assert cores["learner"] == pytest.approx(0.4)
    assert cores["background"] == pytest.approx((0.4 + 0.8 + 0.4) / 4.0)


def test_cores_by_name_counts_each_process_name_and_a_ray_actor_whatever_method_it_runs():
    """The same samples by name: the replay queue under one name across its methods, largest first."""
    before = {10: (5.0, "sglang::scheduler"), 7: (2.0, "ray::LearnerWorker"), 1: (3.0, "python"),
              2: (1.0, "ray::ReplayQueue.admit"), 3: (0.0, "ray::ReplayQueue")}
    after = {10: (8.2, "sglang::scheduler"), 7: (3.6, "ray::LearnerWorker"), 1: (3.4, "python"),
             2: (1.8, "ray::ReplayQueue.get_batch"), 3: (0.4, "ray::ReplayQueue"), 11: (0.2, "sglang::detokenizer")}
    cores = in_run.cores_by_name(before, after, 4.0, learner_pids={7})
    assert list(cores) == ["sglang::scheduler", "learner", "ray::ReplayQueue", "python", "sglang::detokenizer"]
    assert cores["ray::ReplayQueue"] == pytest.approx((0.8 + 0.4) / 4.0)
    assert cores["sglang::scheduler"] == pytest.approx(0.8) and cores["python"] == pytest.approx(0.1)


def test_loop_overhead_is_the_step_minus_its_wait_train_and_push_calls():
    steps = [{"perf/time_per_step": 1.0, "perf/wait_data_s": 0.5, "perf/update_actor_s": 0.4,
              "perf/weight_push_stall_s": 0.02},
             {"perf/time_per_step": 0.8, "perf/wait_data_s": 0.2, "perf/update_actor_s": 0.5,
              "perf/weight_push_stall_s": 0.04},
             {"perf/time_per_step": 1.5, "perf/wait_data_s": 0.5, "perf/update_actor_s": 0.5,
              "perf/weight_push_stall_s": 0.03}]  # a pause of 0.47 s: the median does not follow it
    assert in_run.loop_overhead_s(steps) == pytest.approx(0.08)
    assert in_run.push_stall_s(steps) == pytest.approx(0.03)
    late = [{**steps[0], "perf/update_actor_s": 0.6}]  # clock skew between processes: never below 0
    assert in_run.loop_overhead_s(late) == 0.0


def test_loop_split_through_two_batch_sizes_hand_computed():
    # 48 samples: 14 ms, 512 samples: 50 ms -> 36 ms / 464 samples = 0.0776 ms per sample, 10.28 ms per step
    per_step, per_sample = in_run.loop_split((48, 0.014), (512, 0.050))
    assert per_sample == pytest.approx(0.036 / 464) and per_step == pytest.approx(0.050 - 512 * 0.036 / 464)
    assert in_run.loop_split((48, 0.060), (512, 0.050)) == (0.050, 0.0)  # cheaper with more: all per step
    per_step, per_sample = in_run.loop_split((48, 0.001), (512, 0.050))  # the line through < 0 at 0 samples
    assert per_step == 0.0 and per_sample == pytest.approx(0.050 / 512)
    with pytest.raises(ValueError, match="smaller and a larger"):
        in_run.loop_split((512, 0.05), (48, 0.01))


def test_cpu_seconds_sees_a_process_tree_and_its_busy_child():
    """A parent sleeping beside a child that spins for CPU: the child's CPU time grows, the parent's barely."""
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\ntime.sleep(5)"
    launcher = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        deadline = time.monotonic() + 30
        while True:
            seen = in_run.cpu_seconds(parent.pid)
            child = [cpu for pid, (cpu, _) in seen.items() if pid != parent.pid]
            if child and child[0] >= 0.6 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert parent.pid in seen and len(seen) == 2
        assert child[0] >= 0.6 and seen[parent.pid][0] < child[0]
    finally:
        for pid in in_run.cpu_seconds(parent.pid):  # the child first (we started it, through the parent)
            if pid != parent.pid:
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=30)


def test_the_profile_part_shares_this_machines_cores_only_when_engines_run_on_cpu():
    """0.05 s of loop overhead per step over 512 samples; 0.45 cores of background: on CPU the roles share
    os.cpu_count() cores, on CUDA they do not share cores at all (cores None)."""
    got = {"cores": {"engines": 0.9, "learner": 0.4, "background": 0.45}, "wall_s": 10.0,
           "steps": [{"perf/time_per_step": 1.0, "perf/wait_data_s": 0.5, "perf/update_actor_s": 0.44,
                      "perf/weight_push_stall_s": 0.01}] * 3}
    part, loop_s, how = in_run.overhead_part(got, "cpu", 512)
    assert part == {"cores": os.cpu_count(), "background_cores": 0.45}
    assert loop_s == pytest.approx(0.05)
    assert "push call's median 0.0100 s -> learner_stall_s" in how
    assert "0.45" in how and "512 samples" in how
    assert in_run.overhead_part(got, "cuda", 512)[0]["cores"] is None
