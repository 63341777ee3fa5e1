"""The planner on runs it has never seen: a seeded generator draws configs of the CPU default (group size,
batch, η, epochs, update mode, engines, learner ranks; within what a 2-core machine holds), the planner
predicts each from ONE profile calibrated on the default alone, each config is run for real, and the table
gives every figure's error against the targets (steps/s ±15 %, mean staleness ±0.3, idle ratios ±0.1), plus
a diagnostic: steps/s predicted again with the run's own measured accuracy as keep's drift.

    python tools/study/plan_unseen.py --profile runs/calibrate/tiny.yaml [--configs 8] [--seed 0]
                                      [--steps 24 --warmup 6] [--repeats 1] [--out runs/plan_unseen]

The runs are normal ``async-dapo train`` runs (validation and checkpoints off), measured as
tools/bench/throughput.py measures a mode (its ``summarize``: the steps after the warm-up). ``--repeats N``
runs every config N times, round by round (c0..c7, then c0..c7 again: a drift of the shared machine's speed
lands on every config alike); the measured figures are the rounds' mean, and ``steps_per_s_spread`` is
(max − min) / mean over them. ``--list`` prints the drawn configs without running them. A run whose metrics
already hold its end is not run again.

``--diagnose`` runs nothing new but each config's learner alone, and prints per config where the time of a
step goes, predicted against measured over the rounds already in ``--out``: the learner's step alone (the
real learner ranks on synthetic groups of the config's shape, as tools/bench/learner_ranks.py, against the
planner's ``step_seconds``), the training call in the run (``perf/update_actor_s`` plus the loop's own time,
against the prediction's ``train_s``), the learner's wait for data, and the samples the engines finished per
second (``replay/received_samples``).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tools/: common.py
sys.path.insert(0, str(HERE.parent / "bench"))  # throughput.summarize
import common  # noqa: E402

CONFIG = "configs/tiny_cpu.yaml"
# batch_order pinned: the planner's queue hands out batches in arrival order (admission order is not modelled)
BASE = ["logging.val_every_steps=0", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
        "replay.batch_order=arrival"]
# What the generator draws from (2 cores: at most 3 busy processes; a batch small enough for a short run).
SPACE = {"G": (4, 6, 8, 12, 16), "B": (8, 16, 24, 32), "eta": (0, 1, 2, 4), "epochs": (1, 2),
         "update_mode": ("inflight", "drain", "abort"), "engines": (1, 2), "ranks": (1, 2)}
CORES = 2  # the machine the space is drawn for
TARGETS = {"steps_per_s": 0.15, "staleness_mean": 0.3, "learner_idle": 0.1, "rollout_idle": 0.1}


def draw(n: int, seed: int) -> list[dict]:
    """``n`` distinct configs, none equal to the default's shape; engines + ranks <= 3."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        c = {k: rng.choice(v) for k, v in SPACE.items()}
        if c["engines"] + c["ranks"] > 3 or (c["eta"] == 0 and c["update_mode"] != "inflight"):
            continue
        key = tuple(c.values())
        if key not in seen:
            seen.add(key)
            out.append({"name": f"c{len(out)}", **c})
    return out


def sets_for(c: dict, steps: int, run_dir: Path) -> list[str]:
    window = (c["eta"] + 1) * c["B"]
    per_engine = -(-window // c["engines"])
    mini = c["B"] if c["B"] <= 16 else c["B"] // 2
    return [*BASE, f"rollout.n={c['G']}", f"algorithm.train_batch_groups={c['B']}",
            f"learner.mini_batch_groups={mini}", f"replay.max_staleness={c['eta']}",
            f"learner.epochs={c['epochs']}", f"rollout.update_mode={c['update_mode']}",
            f"placement.num_engines={c['engines']}", f"placement.learner_ranks={c['ranks']}",
            f"rollout.max_inflight_prompts={per_engine}", f"replay.capacity_groups={max(256, window)}",
            f"learner.total_steps={steps}", f"logging.run_dir={run_dir}", "rollout.drain_timeout_s=30",
            *cpus_for(c["engines"] + c["ranks"])]


def cpus_for(roles: int) -> list[str]:
    """Ray's CPU count per engine and per rank so that every role fits this machine's cores (a logical
    reservation: the processes share the cores whatever it says)."""
    share = min(1.0, int(100 * CORES / roles) / 100)
    return [f"placement.engine_cpus={share}", f"placement.learner_cpus={share}"]


def compare(pred: dict, meas: dict) -> dict:
    row = {}
    for key, tol in TARGETS.items():
        err = (pred[key] - meas[key]) / meas[key] if key == "steps_per_s" else pred[key] - meas[key]
        row.update({f"{key}_pred": pred[key], f"{key}_meas": meas[key], f"{key}_err": err,
                    f"{key}_ok": abs(err) <= tol})
    row["keep_pred"], row["keep_meas"] = pred["keep_rate"], meas["keep_rate"]
    return row


def mean_of(runs: list[dict]) -> dict:
    """The rounds' mean of every figure of :func:`throughput.summarize`, and the spread of steps/s."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    per_s = [r["steps_per_s"] for r in runs]
    out["steps_per_s_spread"] = (max(per_s) - min(per_s)) / out["steps_per_s"]
    return out


def run_dir_of(out: Path, name: str, round_: int) -> Path:
    """The first round in ``out/<name>`` (as a single run), later ones in ``out/<name>_r<k>``."""
    return out / (name if round_ == 0 else f"{name}_r{round_}")


def at_measured_accuracy(pl, profile, shape, meas: dict) -> dict:
    """A diagnostic, not the validation: steps/s predicted with keep's drift stated as the run's own mean
    accuracy (``accuracy_by_version`` = [received_acc]: every prompt's accuracy shifted to it), separating
    the keep rate's error from the pipeline's."""
    acc = meas.get("received_acc")
    if not profile.workload.prompts or acc is None or not 0 < acc < 1:
        return {"steps_per_s_pred_at_acc": float("nan"), "steps_per_s_err_at_acc": float("nan")}
    w = profile.workload.model_copy(update={"accuracy_by_version": [acc]})
    pred = pl.predict(profile.model_copy(update={"workload": w}), shape, 60, 10, sync_baseline=False)
    return {"steps_per_s_pred_at_acc": pred.steps_per_s,
            "steps_per_s_err_at_acc": (pred.steps_per_s - meas["steps_per_s"]) / meas["steps_per_s"]}


def learner_alone(pl, profile, cfg, ranks: int) -> tuple[float, float]:
    """(measured, predicted) seconds of one training step alone at ``cfg``'s shape: the real learner ranks
    on B synthetic groups of G samples (learner_ranks' short batch), against the planner's step_seconds."""
    import learner_ranks

    from async_dapo.planning.learner_model import step_seconds

    cell = {"batch": "short", "micro_batch_tokens": cfg.learner.micro_batch_tokens,
            "mini_batch_groups": cfg.learner.mini_batch_groups, "mode": cfg.algorithm.correction.mode}
    got = learner_ranks.measure(cfg, ranks, [cell], 4, 600)[0]
    B = cfg.algorithm.train_batch_groups
    return got["s"], step_seconds(profile.learner, pl.Shape.from_config(cfg), [got["tokens"] / B] * B)


def step_parts(run_dirs: list[Path], warmup: int) -> dict[str, float]:
    """Measured means over the rounds' steps after ``warmup``: the training call plus the loop's own time, the
    wait for data, and the samples finished per second."""
    import statistics

    train, wait, rates = [], [], []
    for run_dir in run_dirs:
        steps = common.step_records(common.records(run_dir))[warmup:]
        train += [r["perf/time_per_step"] - r["perf/wait_data_s"] - r["perf/weight_push_stall_s"] for r in steps]
        wait += [r["perf/wait_data_s"] for r in steps]
        rates.append((steps[-1]["replay/received_samples"] - steps[0]["replay/received_samples"])
                     / (steps[-1]["time"] - steps[0]["time"]))
    return {"train_s": statistics.fmean(train), "wait_s": statistics.fmean(wait),
            "samples_per_s": statistics.fmean(rates)}


def diagnose(pl, profile, drawn: list[dict], args) -> None:
    """The ``--diagnose`` table (module doc), one line per config with rounds in ``args.out``."""
    for c in drawn:
        dirs = [run_dir_of(args.out, c["name"], r) for r in range(args.repeats)]
        dirs = [d for d in dirs if common.finished(d, args.steps)]
        if not dirs:
            continue
        cfg = common.load_config(CONFIG, sets_for(c, args.steps, dirs[0]))
        pred = pl.predict(profile, pl.Shape.from_config(cfg), 60, 10, sync_baseline=False)
        meas, (alone, alone_pred) = step_parts(dirs, args.warmup), learner_alone(pl, profile, cfg, c["ranks"])
        G, B = c["G"], c["B"]
        print(f"{c['name']} (G {G}, B {B}, {c['update_mode']}, {c['engines']} engine(s), {c['ranks']} rank(s)): "
              f"learner alone {alone_pred:.3f} / {alone:.3f} s; in the run: training {pred.train_s:.3f} / "
              f"{meas['train_s']:.3f} s, wait for data {pred.learner_idle * pred.step_s:.3f} / {meas['wait_s']:.3f} s, "
              f"samples finished {pred.steps_per_s * B * G / pred.keep_rate:.0f} / {meas['samples_per_s']:.0f} per s "
              f"(predicted / measured, {len(dirs)} round(s))", flush=True)


def main(argv=None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--profile", type=Path, required=True, help="planner profile calibrated on the default")
    ap.add_argument("--configs", type=int, default=8, help="configs to draw (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--out", type=Path, default=common.REPO / "runs" / "plan_unseen")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds one run may take")
    ap.add_argument("--repeats", type=int, default=1, help="rounds: every config run this many times, round by "
                    "round; the table has their mean and spread (default %(default)s)")
    ap.add_argument("--list", action="store_true", help="print the drawn configs and exit")
    ap.add_argument("--diagnose", action="store_true", help="where a step's time goes, predicted against measured, "
                    "over the rounds already run, with each config's learner alone (see the module doc)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    drawn = draw(args.configs, args.seed)
    if args.list:
        for c in drawn:
            print(c)
        return 0
    from throughput import summarize

    from async_dapo import planning as pl

    profile = pl.load_profile(args.profile)
    if args.diagnose:
        diagnose(pl, profile, drawn, args)
        return 0
    measured: dict[str, list[dict]] = {c["name"]: [] for c in drawn}
    for round_ in range(args.repeats):
        for c in drawn:
            run_dir = run_dir_of(args.out, c["name"], round_)
            sets = sets_for(c, args.steps, run_dir)
            if not common.finished(run_dir, args.steps):
                log = run_dir.parent / f"{run_dir.name}.log"
                rc = common.run_train(CONFIG, sets, log, args.timeout)
                if rc:
                    print(f"{run_dir.name}: exit {rc}; see {log}", flush=True)
                    continue
            measured[c["name"]].append(summarize(run_dir, common.load_config(CONFIG, sets), args.warmup))
            print(f"{run_dir.name}: {measured[c['name']][-1]['steps_per_s']:.3f} steps/s", flush=True)
    rows = []
    for c in drawn:
        if not measured[c["name"]]:
            continue
        meas = mean_of(measured[c["name"]])
        shape = pl.Shape.from_config(common.load_config(CONFIG, sets_for(c, args.steps, args.out / c["name"])))
        pred = pl.predict(profile, shape, 60, 10, sync_baseline=False).row()
        rows.append({**c, **compare(pred, meas), "runs": len(measured[c["name"]]),
                     "steps_per_s_spread": meas["steps_per_s_spread"], **at_measured_accuracy(pl, profile, shape, meas)})
        print(rows[-1], flush=True)
    cols = ["name", *SPACE] + [f"{k}_{s}" for k in TARGETS for s in ("pred", "meas", "err", "ok")] + [
        "runs", "steps_per_s_spread", "keep_pred", "keep_meas", "steps_per_s_pred_at_acc", "steps_per_s_err_at_acc"]
    fmt = {c: ".3f" for c in cols if c.endswith(("_pred", "_meas", "_err", "_spread"))}
    print(common.write_table(rows, cols, args.out / "table.md", args.out / "table.csv", fmt), flush=True)
    met = sum(r["steps_per_s_ok"] for r in rows)
    print(f"steps/s within ±15 % on {met} of {len(rows)} configs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
