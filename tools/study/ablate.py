"""Ablation studies: a grid of normal training runs (cells x seeds), each in its own run directory, resumable,
summarised as CSV, PNG curves and a Markdown table.

    python tools/study/ablate.py --study staleness [--preset quick|full|grid] [--seeds 0 1 2] [--out runs/ablate]
    python tools/study/ablate.py --study dapo --preset grid --address http://HEAD:8265 --out /shared/ablate

Studies (``--list`` prints their cells):
* ``staleness``: eta in {0, 1, 2, 4, 8} x off-policy correction in {none, naive, decoupled} (AReaL's
  staleness table in miniature). ``rollout.max_inflight_prompts`` and ``replay.capacity_groups`` follow
  (eta + 1) x B, so admission, not a cap, bounds how far generation runs ahead.
* ``dapo``: the DAPO paper's Table 1 in miniature, cumulative, each row config flags only: naive GRPO
  (symmetric clip 0.2, sample-level loss, no overlong shaping, no filtering) -> + overlong filtering ->
  + clip-higher (0.28) -> + soft overlong punishment -> + token-level loss -> + dynamic sampling (= DAPO).
  The task (``DAPO_TASK``) gives length a role: the warm start shows the carry/borrow line on half of its
  carry/borrow problems (16-17 tokens against 3-4), and the budget is 15 tokens with a 5-token soft zone, so
  those answers are cut (the table reports the truncation rate of the trained samples of steps 1-10).

Presets: ``quick`` (CI smoke: 2 cells, 1 seed, a few steps; numbers are not results), ``full`` (sized to
finish on one 2-core machine in <= 90 minutes: staleness eta in {0, 1, 4} x 3 corrections, the 6 Table 1
rows; 3 seeds), ``grid`` (every cell of the study; for a cluster). Every run validates on the task's >= 1,000
distinct held-out problems (``data.synthetic.heldout_fraction`` 0.5) and starts from one warm start built
once in OUT/<study>/model (bootstrap seed 0). A seed sets ``logging.seed``, ``data.shuffle_seed`` and
``rollout.engine.random_seed``.

Locally the runs go one after another (``async-dapo train`` in a child process each). With ``--address``
each run is submitted to that Ray cluster as a job (Ray's job API, as ``ray job submit`` does; the
entrypoint is the same ``async-dapo train`` command with ``placement.ray_address=auto``), at most
``--max-jobs`` at a time; OUT must be on storage the cluster's nodes share (the jobs write their run
directories there and this tool reads them back); on several nodes also pass the multi-node settings,
``--set placement.nnodes=N --set transport.bind_host=0.0.0.0`` (every run's ``logging.run_dir`` is the study's,
under OUT, whatever ``--set`` says). A run whose metrics already hold its end is not run again.

Outputs in OUT/<study>/: runs.csv (one row per run), curves.csv (one row per validation), table.md, and
curves.png (held-out avg@k versus step, versus generated samples and versus wall minutes; mean over seeds,
band = min..max).
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
from common import (  # noqa: E402
    REPO, check_reusable, cli_command, finished, load_config, parser, records, run_train, step_records,
    train_command, write_table,
)

# The DAPO study's task: the warm start writes the carry/borrow line for half of its carry/borrow problems
# (16-17 tokens with EOS, other answers 3-4), so a 15-token budget cuts ~17 % of the first step's responses
# (measured: docs/results/throughput_and_studies.md): the policy can only score on those problems by learning the short form, and
# how the loss treats cut responses (filtered, punished, or plain -1) decides how fast it does.
DAPO_TASK = ["data.synthetic.response_style=steps", "rollout.max_response_length=15",
             "reward.overlong_buffer_length=5"]
VAL = ["data.synthetic.heldout_fraction=0.5", "logging.val_prompts=2000"]  # 1,013 distinct held-out problems


@dataclass(frozen=True)
class Preset:
    cells: list[str]  # cell names of the study, in table order
    seeds: list[int]
    steps: int
    val_every: int
    extra: list[str] = field(default_factory=list)  # the study's task and sizes: the warm start and every run


def staleness_cells(etas: list[int], batch: int = 64) -> dict[str, list[str]]:
    cells = {}
    for eta in etas:
        for corr in ("none", "naive", "decoupled"):
            window = (eta + 1) * batch
            cells[f"eta{eta}/{corr}"] = [f"replay.max_staleness={eta}", f"algorithm.correction.mode={corr}",
                                         f"rollout.max_inflight_prompts={window}",
                                         f"replay.capacity_groups={max(256, window)}"]
    return cells


def dapo_cells() -> dict[str, list[str]]:
    rows = [
        ("naive GRPO", ["algorithm.clip_high=0.2", "algorithm.loss_agg_mode=seq-mean-token-mean",
                        "reward.overlong_buffer_enable=false", "algorithm.overlong_filtering=false",
                        "algorithm.dynamic_sampling.enable=false"]),
        ("+ overlong filtering", ["algorithm.overlong_filtering=true"]),
        ("+ clip-higher", ["algorithm.clip_high=0.28"]),
        ("+ soft overlong punishment", ["reward.overlong_buffer_enable=true"]),
        ("+ token-level loss", ["algorithm.loss_agg_mode=token-mean"]),
        ("+ dynamic sampling (DAPO)", ["algorithm.dynamic_sampling.enable=true"]),
    ]
    cells, acc = {}, {}
    for name, sets in rows:  # cumulative: each row changes the previous row's flags
        acc.update(s.split("=", 1) for s in sets)
        cells[name] = [f"{k}={v}" for k, v in acc.items()]
    return cells


QUICK = ["algorithm.train_batch_groups=16", "learner.mini_batch_groups=8"]
ETAS, FULL_ETAS = [0, 1, 2, 4, 8], [0, 1, 4]
DAPO_ROWS = list(dapo_cells())
# study -> (cells for a batch of B groups, presets); cell names do not depend on B
STUDIES = {
    "staleness": (lambda batch: staleness_cells(ETAS, batch), {
        "quick": Preset(["eta0/none", "eta1/decoupled"], [0], 4, 2, QUICK),
        "full": Preset(list(staleness_cells(FULL_ETAS)), [0, 1, 2], 80, 40),
        "grid": Preset(list(staleness_cells(ETAS)), [0, 1, 2], 200, 40),
    }),
    "dapo": (lambda batch: dapo_cells(), {
        "quick": Preset([DAPO_ROWS[0], DAPO_ROWS[-1]], [0], 4, 2, QUICK + DAPO_TASK),
        "full": Preset(DAPO_ROWS, [0, 1, 2], 80, 40, DAPO_TASK),
        "grid": Preset(DAPO_ROWS, [0, 1, 2], 200, 40, DAPO_TASK),
    }),
}


@dataclass
class Job:
    cell: str
    seed: int
    run_dir: Path
    sets: list[str]
    steps: int

    def done(self, config: str) -> bool:
        """Finished with this job's config (a finished run with another config stops the study)."""
        if not finished(self.run_dir, self.steps):
            return False
        check_reusable(self.run_dir, config, self.sets)
        return True


def plan(args, preset: Preset, cells: dict[str, list[str]], model: Path) -> list[Job]:
    jobs = []
    for cell in preset.cells:
        for seed in args.seeds or preset.seeds:
            run_dir = (args.out / args.study / args.preset / f"{_slug(cell)}_s{seed}").resolve()
            sets = [*VAL, *preset.extra, f"model.path={model}", "model.bootstrap=null", "checkpoint.every_steps=0",
                    "checkpoint.export_hf=false", f"learner.total_steps={preset.steps}",
                    f"logging.val_every_steps={preset.val_every}", f"logging.seed={seed}",
                    f"data.shuffle_seed={seed}", f"rollout.engine.random_seed={seed}",
                    *cells[cell], *args.overrides, f"logging.run_dir={run_dir}",  # the study's, after --set
                    *(["placement.ray_address=auto"] if args.address else [])]  # a job joins the cluster it runs on
            jobs.append(Job(cell, seed, run_dir, sets, preset.steps))
    return jobs


def study_run_dir(args) -> str:
    """The override that puts a config's run directory in the study's (absolute: valid for a multi-node
    ``--set placement.nnodes=N`` too); every run gets its own below it (``plan``), after the ``--set``s."""
    return f"logging.run_dir={(args.out / args.study).resolve()}"


def _slug(cell: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in cell).strip("_").replace("__", "_")


def build_model(args, preset: Preset) -> Path:
    """One warm start for the whole study (the task's validation split changes the bootstrap's data)."""
    model = (args.out / args.study / "model").resolve()
    cmd = cli_command("bootstrap", args.config, [*VAL, *preset.extra, f"model.path={model}", *args.overrides,
                                                 study_run_dir(args)])
    import subprocess

    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bootstrap of the study model ({model}) took over --run-timeout {args.run_timeout:.0f} s")
    if proc.returncode != 0:
        raise SystemExit(f"bootstrap of the study model failed:\n{proc.stderr[-3000:]}")
    return model


def run_local(args, jobs: list[Job]) -> None:
    for i, job in enumerate(jobs, 1):
        if job.done(args.config):
            print(f"[{i}/{len(jobs)}] {job.cell} seed {job.seed}: finished earlier", flush=True)
            continue
        t0 = time.perf_counter()
        rc = run_train(args.config, job.sets, job.run_dir.with_suffix(".log"), args.run_timeout)
        print(f"[{i}/{len(jobs)}] {job.cell} seed {job.seed}: exit {rc} in {time.perf_counter() - t0:.0f} s"
              + ("" if rc == 0 else f" (see {job.run_dir.with_suffix('.log')})"), flush=True)


def run_cluster(args, jobs: list[Job]) -> None:
    """Submit every unfinished run as a Ray job (at most ``--max-jobs`` at once) and wait for all. Each job
    has a stable id (study, preset, cell, seed), so a rerun adopts a job still running from an earlier
    invocation instead of starting a second one into the same directory; every call to the head is bounded
    (``CALL_TIMEOUT_S``), each job by ``--run-timeout``; on any exit the jobs still running are stopped."""
    token_auth_env(os.environ)  # before ray is imported: Ray reads RAY_AUTH_MODE once, at import
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = _call(JobSubmissionClient, args.address, what=f"connect to {args.address}")
    ended = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    known = {j.submission_id: j.status for j in _call(client.list_jobs, what="list jobs") if j.submission_id}
    todo = [j for j in jobs if not j.done(args.config)]
    for job in jobs:
        if job not in todo:
            print(f"{job.cell} seed {job.seed}: finished earlier", flush=True)
    running: dict[str, tuple[Job, float]] = {}
    try:
        while todo or running:
            while todo and len(running) < args.max_jobs:
                job = todo.pop(0)
                sid = _job_id(args, job)
                if known.get(sid) in ended:  # an earlier attempt ended without finishing: a new attempt
                    sid = f"{sid}-{int(time.time())}"
                if sid not in known:
                    # As tools/cluster/submit.sh submits: the repository as working dir (Ray leaves .gitignore'd
                    # paths such as runs/ and .venv/ behind), async_dapo installed on every node.
                    entry = shlex.join(["async-dapo", *train_command(args.config, job.sets)[3:]])
                    _call(client.submit_job, entrypoint=entry, submission_id=sid,
                          runtime_env={"working_dir": str(REPO)}, what=f"submit {sid}")
                running[sid] = (job, time.monotonic())
                print(f"{'adopted' if sid in known else 'submitted'} {sid}: {job.cell} seed {job.seed}", flush=True)
            time.sleep(10)
            for sid, (job, t0) in list(running.items()):
                status = _call(client.get_job_status, sid, what=f"status of {sid}")
                if status in ended:
                    del running[sid]
                    tail = "" if status == JobStatus.SUCCEEDED else "\n" + _call(
                        client.get_job_logs, sid, what=f"logs of {sid}")[-2000:]
                    print(f"{sid} ({job.cell} seed {job.seed}): {status}{tail}", flush=True)
                elif time.monotonic() - t0 > args.run_timeout:
                    _call(client.stop_job, sid, what=f"stop {sid}")
                    del running[sid]
                    print(f"{sid}: stopped after --run-timeout {args.run_timeout:.0f} s", flush=True)
    finally:
        for sid in running:  # interrupted or failed here: leave no job of ours running unattended
            try:
                _call(client.stop_job, sid, what=f"stop {sid}")
            except Exception as exc:  # the head may be what failed
                print(f"could not stop {sid}: {exc}", flush=True)


def token_auth_env(environ) -> None:
    """``RAY_AUTH_MODE=token`` in ``environ`` when it is unset and Ray keeps a token (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, where Ray 2.60's ``ray start --head`` leaves it): the job
    client sends the token only in token mode, and a head with token auth refuses requests without it
    ("Missing authentication token"), as tools/cluster/submit.sh does for the CLI. Ray reads the mode when
    ``ray`` is first imported, so this must run before that import."""
    tokens = environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH")
    if "RAY_AUTH_MODE" not in environ and (tokens or (Path.home() / ".ray" / "auth_token").exists()):
        environ["RAY_AUTH_MODE"] = "token"


CALL_TIMEOUT_S = 120  # one request to the Ray head (Ray's job client sets no timeout of its own)


def _call(fn, *args, what: str, **kwargs):
    """``fn(*args, **kwargs)`` in a helper thread, given up after CALL_TIMEOUT_S with an error naming it."""
    from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout

    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout=CALL_TIMEOUT_S)
    except FutureTimeout:
        raise SystemExit(f"Ray head: {what}: no answer in {CALL_TIMEOUT_S} s") from None
    finally:
        pool.shutdown(wait=False)


def _job_id(args, job: Job) -> str:
    return f"ablate-{args.study}-{args.preset}-{_slug(job.cell)}-s{job.seed}"


def summarize(job: Job, n: int) -> tuple[dict, list[dict]] | None:
    """(one row for runs.csv, the run's validation curve) or None if the run did not finish."""
    rows = records(job.run_dir)
    steps = {r["step"]: r for r in step_records(rows)}
    if not finished(job.run_dir, job.steps) or not any(r.get("step") == 0 and "val/avg_at_k" in r for r in rows):
        return None  # not finished, or no step-0 validation (skipped on a timeout): no baseline for a gain
    start = min(r["time"] for r in rows if "time" in r)
    curve = [{"cell": job.cell, "seed": job.seed, "step": r["step"], "minutes": (r["time"] - start) / 60,
              "samples": steps[r["step"]]["replay/received"] * n if r["step"] in steps else 0.0,
              "avg_at_k": r["val/avg_at_k"]} for r in rows if "val/avg_at_k" in r]
    total = next(r for r in rows if "time/total_s" in r)
    run = {"cell": job.cell, "seed": job.seed, "steps": max(steps), "avg_at_k_0": curve[0]["avg_at_k"],
           "avg_at_k_end": curve[-1]["avg_at_k"], "gain_pt": 100 * (curve[-1]["avg_at_k"] - curve[0]["avg_at_k"]),
           "best_gain_pt": 100 * (max(c["avg_at_k"] for c in curve) - curve[0]["avg_at_k"]),
           # The first batches are the groups that finished first (short answers), so one step says little.
           "truncated_first10": statistics.mean(steps[k]["response_length/clip_ratio"] for k in sorted(steps)[:10]),
           "staleness_mean": statistics.mean(r["staleness/mean"] for r in steps.values()),
           "samples": curve[-1]["samples"], "wall_min": total["time/total_s"] / 60,
           "distinct_val": next(r["val/distinct_prompts"] for r in rows if "val/distinct_prompts" in r)}
    return run, curve


def cell_table(runs: list[dict], cells: list[str]) -> list[dict]:
    """Mean ± sd over seeds per cell, in the study's order."""
    out = []
    for cell in cells:
        mine = [r for r in runs if r["cell"] == cell]
        if not mine:
            continue
        gains = [r["gain_pt"] for r in mine]
        ends = [r["avg_at_k_end"] for r in mine]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        out.append({"cell": cell, "seeds": len(mine), "avg@k start": statistics.mean(r["avg_at_k_0"] for r in mine),
                    "avg@k end": f"{statistics.mean(ends):.3f} ± {sd(ends):.3f}",
                    "gain (pt)": f"{statistics.mean(gains):+.1f} ± {sd(gains):.1f}",
                    "best gain (pt)": statistics.mean(r["best_gain_pt"] for r in mine),
                    "truncated (steps 1-10)": statistics.mean(r["truncated_first10"] for r in mine),
                    "staleness": statistics.mean(r["staleness_mean"] for r in mine),
                    "samples (k)": statistics.mean(r["samples"] for r in mine) / 1000,
                    "wall min": statistics.mean(r["wall_min"] for r in mine)})
    return out


def plot(curves: list[dict], cells: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    for cell in cells:
        mine = [c for c in curves if c["cell"] == cell]
        if not mine:
            continue
        steps = sorted({c["step"] for c in mine})
        for ax, x in zip(axes, ("step", "samples", "minutes")):
            xs, mean, lo, hi = [], [], [], []
            for s in steps:
                at = [c for c in mine if c["step"] == s]
                xs.append(statistics.mean(c[x] for c in at))
                ys = [c["avg_at_k"] for c in at]
                mean.append(statistics.mean(ys))
                lo.append(min(ys))
                hi.append(max(ys))
            (line,) = ax.plot(xs, mean, marker="o", ms=3, label=cell)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    for ax, label in zip(axes, ("training step", "generated samples", "wall minutes")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out avg@k (mean over seeds, band = min..max)")
    axes[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(args, preset: Preset, jobs: list[Job], n: int) -> None:
    out = args.out / args.study
    summaries = [summarize(j, n) for j in jobs]
    done = [s for s in summaries if s is not None]
    missing = [f"{j.cell} seed {j.seed}" for j, d in zip(jobs, summaries) if d is None]
    runs = [r for r, _ in done]
    curves = [c for _, cs in done for c in cs]
    bad = [(r["cell"], r["seed"], k) for r in runs for k, v in r.items()
           if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise SystemExit(f"non-finite figures in the results: {bad}")
    run_cols = list(runs[0]) if runs else ["cell"]
    write_table(runs, run_cols, None, out / "runs.csv")
    write_table(curves, ["cell", "seed", "step", "minutes", "samples", "avg_at_k"], None, out / "curves.csv")
    cols = ["cell", "seeds", "avg@k start", "avg@k end", "gain (pt)", "best gain (pt)", "truncated (steps 1-10)",
            "staleness", "samples (k)", "wall min"]
    fmt = {"avg@k start": ".3f", "best gain (pt)": "+.1f", "truncated (steps 1-10)": ".3f", "staleness": ".2f",
           "samples (k)": ".1f", "wall min": ".1f"}
    title = (f"study {args.study}, preset {args.preset}: {preset.steps} steps, validation every {preset.val_every}, "
             f"seeds {args.seeds or preset.seeds}")
    table = write_table(cell_table(runs, preset.cells), cols, None, None, fmt)
    note = f"\n{len(missing)} run(s) missing: {', '.join(missing)}\n" if missing else ""
    (out / "table.md").write_text(f"{title}\n\n{table}{note}")
    if curves:
        plot(curves, preset.cells, out / "curves.png", title)
    print(f"\n{title}\n\n{table}{note}", flush=True)
    if missing:
        raise SystemExit(f"{len(missing)} run(s) did not finish")


def main() -> None:
    ap = parser(__file__, __doc__, config="configs/tiny_cpu.yaml")
    ap.add_argument("--study", choices=sorted(STUDIES), required=True)
    ap.add_argument("--preset", choices=["quick", "full", "grid"], default="full")
    ap.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    ap.add_argument("--seeds", type=int, nargs="+", help="RL seeds (default: the preset's)")
    ap.add_argument("--cells", nargs="+", help="run only these cells of the preset (default: all, in order)")
    ap.add_argument("--out", type=Path, default=Path("runs/ablate"))
    ap.add_argument("--address", help="Ray cluster (job API address, e.g. http://HEAD:8265): submit runs as jobs")
    ap.add_argument("--max-jobs", type=int, default=4, help="with --address: jobs running at once")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--list", action="store_true", help="print the study's cells and their overrides, then exit")
    ap.add_argument("--report", action="store_true",
                    help="start no run: summarise the runs finished so far (e.g. while a study is running elsewhere)")
    args = ap.parse_args()
    cells, presets = STUDIES[args.study]
    preset = presets[args.preset]
    if args.cells:
        unknown = sorted(set(args.cells) - set(preset.cells))
        if unknown:
            ap.error(f"--cells {unknown}: not cells of {args.study}/{args.preset} (--list shows them)")
        preset = replace(preset, cells=[c for c in preset.cells if c in args.cells])
    if args.list:
        for cell in preset.cells:
            print(f"{cell}: {' '.join(cells(64)[cell])}")
        return
    # A bad override fails here, with the run directory the study's (a relative default would break the
    # multi-node rule of a `--set placement.nnodes=2`).
    base = load_config(args.config, [*VAL, *preset.extra, *args.overrides, study_run_dir(args)])
    cells = cells(base.algorithm.train_batch_groups)
    model = (args.out / args.study / "model").resolve() if args.report else build_model(args, preset)
    jobs = plan(args, preset, cells, model)
    if not args.report:
        (run_cluster if args.address else run_local)(args, jobs)
    report(args, preset, jobs, base.rollout.n)


if __name__ == "__main__":
    main()
