"""The calibration's run phase (tools/bench/calibrate.py, phase g): what a real run costs beyond its roles.

The other phases time each role alone. A run also has a training loop (metrics, logging, the batch's
hand-over), a replay queue, the rollout actors' host side and Ray's own processes, all on the same cores.
This phase runs the config for real (``async-dapo train``, validation and checkpoints off) and measures:

* ``contention.background_cores``: the CPU seconds per second of every process of the run (the driver's
  process tree, Ray's included) except the engines' SGLang schedulers and the learner ranks, over the steps
  after the warm-up (psutil's CPU times, sampled at both ends of that window);
* ``contention.cores``: this machine's CPUs, when the engines run on CPU (None on GPU: the roles' compute
  does not share cores there);
* the loop's own seconds per step outside the batch wait, the train call and the push call
  (``perf/time_per_step − perf/wait_data_s − perf/update_actor_s − perf/weight_push_stall_s``, the median
  over the steps: a rare pause, a garbage collection or a log flush, is not the loop's work per step); the
  calibration runs the config at two batch sizes and splits it into ``learner.loop_per_step_s`` (metrics
  and logs) and ``learner.loop_per_sample_s`` (the batch's hand-over) with :func:`loop_split`;
* ``push.learner_stall_s``: the median push call in the run (``perf/weight_push_stall_s``): what the loop
  loses to each push while the engines and the other processes are busy.

Run alone, it also prints the cores used per process name (the learner ranks as ``learner``) and the
window's steps/s and samples finished per second.

    python tools/bench/in_run.py --config configs/tiny_cpu.yaml [--set k=v ...] [--steps 24 --warmup 8]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tools/: common.py
import common  # noqa: E402

SCHEDULER = "sglang::scheduler"  # the process title SGLang gives an engine's scheduler (its compute)


def cpu_seconds(root_pid: int) -> dict[int, tuple[float, str]]:
    """pid -> (user + system CPU seconds, process name) of ``root_pid`` and every descendant alive now."""
    import psutil

    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (t.user + t.system, p.name())
        except psutil.Error:  # ended between the listing and the read
            continue
    return out


def cores_by_name(before: dict, after: dict, wall_s: float, learner_pids: set[int]) -> dict[str, float]:
    """CPU cores used over ``wall_s`` per process name (the learner ranks as ``learner``), largest first: where
    the background goes (the rollout actors' host side, the replay queue, the driver, Ray). A Ray actor's
    title names the method it runs now (``ray::ReplayQueue.get_batch``): counted under the actor."""
    used: dict[str, float] = {}
    for pid, (cpu, name) in after.items():
        key = "learner" if pid in learner_pids else name.split(".")[0] if name.startswith("ray::") else name
        used[key] = used.get(key, 0.0) + max(0.0, cpu - before.get(pid, (0.0, name))[0]) / wall_s
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


def cores_by_role(before: dict, after: dict, wall_s: float, learner_pids: set[int]) -> dict[str, float]:
    """CPU cores used over ``wall_s`` by the engines' schedulers, the learner ranks and everything else (the
    background), from two :func:`cpu_seconds` samples; a process born in between counts from zero. The
    per-name figures of :func:`cores_by_name`, summed by role."""
    used = {"engines": 0.0, "learner": 0.0, "background": 0.0}
    for name, cores in cores_by_name(before, after, wall_s, learner_pids).items():
        used["learner" if name == "learner" else "engines" if name.startswith(SCHEDULER) else "background"] += cores
    return used


def loop_overhead_s(steps: list[dict]) -> float:
    """Median seconds per step the training loop spent outside the batch wait, the train call and the push
    call (never below 0)."""
    return max(0.0, statistics.median(r["perf/time_per_step"] - r["perf/wait_data_s"] - r["perf/update_actor_s"]
                                      - r["perf/weight_push_stall_s"] for r in steps))


def push_stall_s(steps: list[dict]) -> float:
    """Median seconds the loop spent in the push call per step."""
    return statistics.median(r["perf/weight_push_stall_s"] for r in steps)


def loop_split(small: tuple[int, float], large: tuple[int, float]) -> tuple[float, float]:
    """(per step, per sample) through the loop's seconds per step at two batch sizes, each ``(samples,
    seconds)``, each part clipped at 0 (the other then carries the larger batch's whole cost)."""
    (n1, s1), (n2, s2) = small, large
    if n2 <= n1:
        raise ValueError(f"need a smaller and a larger batch, got {n1} and {n2} samples")
    per_sample = (s2 - s1) / (n2 - n1)
    if per_sample < 0:
        return max(0.0, s2), 0.0
    per_step = s2 - per_sample * n2
    if per_step < 0:
        return 0.0, max(0.0, s2) / n2
    return per_step, per_sample


def _steps_done(run_dir: Path) -> int:
    try:
        return len(common.step_records(common.records(run_dir)))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def measure(config: str | Path, sets: list[str], run_dir: Path, steps: int, warmup: int, timeout_s: float,
            log=print) -> dict:
    """Run the config for ``steps`` steps in ``run_dir`` and measure the window after ``warmup`` steps (see
    the module doc). Returns the cores by role, the window's step records and its wall seconds."""
    if not 0 < warmup < steps - 1:
        raise SystemExit(f"run phase: need 0 < warmup < steps - 1 (got {warmup}, {steps})")
    sets = [*sets, "logging.val_every_steps=0", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
            f"learner.total_steps={steps}", f"logging.run_dir={run_dir}"]
    from async_dapo.checkpoint.run_dir import archive_previous_run

    if (moved := archive_previous_run(run_dir)) is not None:  # its steps must not count as this run's
        log(f"run: the previous run phase's directory moved to {moved}")
    run_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as out:
        proc = common.start_train(config, sets, out)
        try:
            first = _sample_at(proc, run_dir, warmup, deadline)
            last = _sample_at(proc, run_dir, steps - 1, deadline)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            common.end_run(proc)
            raise SystemExit(f"run phase: the run did not end within the phase's {timeout_s:.0f} s") from None
        except BaseException:
            common.end_run(proc)
            raise
    if rc:
        raise SystemExit(f"run phase: the run exited {rc}; see {run_dir.parent / (run_dir.name + '.log')}")
    learners = {int(p) for p in json.loads((run_dir / "actors.json").read_text())["learner"].values()}
    wall = last["t"] - first["t"]
    records = common.step_records(common.records(run_dir))[first["steps"]:last["steps"]]
    log(f"run: steps {first['steps'] + 1}..{last['steps']} in {wall:.1f} s")
    return {"cores": cores_by_role(first["cpu"], last["cpu"], wall, learners), "steps": records, "wall_s": wall,
            "by_name": cores_by_name(first["cpu"], last["cpu"], wall, learners)}


def _sample_at(proc: subprocess.Popen, run_dir: Path, steps: int, deadline: float) -> dict:
    """Wait until the run has logged ``steps`` steps, then sample its processes' CPU times."""
    while (done := _steps_done(run_dir)) < steps:
        if proc.poll() is not None:
            raise SystemExit(f"run phase: the run ended (exit {proc.returncode}) after {done} steps")
        if time.monotonic() > deadline:
            raise SystemExit(f"run phase: {done} of {steps} steps before the phase's timeout")
        time.sleep(0.1)
    return {"t": time.perf_counter(), "cpu": cpu_seconds(proc.pid), "steps": done}


def overhead_part(got: dict, engine_device: str, samples: int) -> tuple[dict, float, str]:
    """(the contention fields, the loop's seconds per step, their source line) from :func:`measure`'s result
    of a run training ``samples`` samples per step."""
    cores = got["cores"]
    shared = (os.cpu_count() or 1) if engine_device == "cpu" else None
    overhead = loop_overhead_s(got["steps"])
    how = (f"a real run of the config, {len(got['steps'])} steps over {got['wall_s']:.1f} s after the warm-up: "
           f"CPU cores used by the schedulers {cores['engines']:.2f}, the learner ranks {cores['learner']:.2f}, "
           f"everything else (driver, replay, rollout actors' host side, Ray) {cores['background']:.2f} -> "
           f"background_cores; cores = {shared} (os.cpu_count() when the engines run on CPU); the loop's own "
           f"median(time_per_step - wait_data_s - update_actor_s - push_stall) = {overhead:.4f} s per step at "
           f"{samples} samples; the push call's median {push_stall_s(got['steps']):.4f} s -> learner_stall_s")
    return {"cores": shared, "background_cores": cores["background"]}, overhead, how


def main() -> int:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", type=Path, default=common.REPO / "runs" / "in_run")
    ap.add_argument("--timeout", type=float, default=900, help="seconds the run may take")
    args = ap.parse_args()
    cfg = common.load_model(args)
    sets = [*args.overrides, f"model.path={cfg.model.path}", "model.bootstrap=null"]
    got = measure(args.config, sets, args.out, args.steps, args.warmup, args.timeout)
    from async_dapo.device import resolve_device

    samples = cfg.algorithm.train_batch_groups * cfg.rollout.n
    part, loop_s, how = overhead_part(got, resolve_device(cfg.rollout.engine.device), samples)
    by_name = ", ".join(f"{name} {cores:.2f}" for name, cores in got["by_name"].items() if cores >= 0.005)
    first, last = got["steps"][0], got["steps"][-1]
    wall = last["time"] - first["time"]
    finished = last["replay/received_samples"] - first["replay/received_samples"]
    print(json.dumps({"contention": part, "loop_s": loop_s, "learner_stall_s": push_stall_s(got["steps"])}), how,
          f"cores by process: {by_name}; {(len(got['steps']) - 1) / wall:.3f} steps/s, "
          f"{finished / wall:.0f} samples finished/s", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
