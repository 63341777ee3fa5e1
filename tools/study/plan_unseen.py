"""The planner on runs it has never seen: a seeded generator draws configs of the CPU default (group size,
batch, η, epochs, update mode, engines, learner ranks; within what a 2-core machine holds), the planner
predicts each from ONE profile calibrated on the default alone, each config is run for real, and the table
gives every figure's error against the targets (steps/s ±15 %, mean staleness ±0.3, idle ratios ±0.1), plus
a diagnostic: steps/s predicted again with the run's own measured accuracy as keep's drift.

    python tools/study/plan_unseen.py --profile runs/calibrate/tiny.yaml [--configs 8] [--seed 0]
                                      [--steps 24 --warmup 6] [--out runs/plan_unseen]

The runs are normal ``async-dapo train`` runs (validation and checkpoints off), measured as
tools/bench/throughput.py measures a mode (its ``summarize``: the steps after the warm-up). ``--list`` prints
the drawn configs without running them. A run whose metrics already hold its end is not run again.
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


def main(argv=None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--profile", type=Path, required=True, help="planner profile calibrated on the default")
    ap.add_argument("--configs", type=int, default=8, help="configs to draw (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--out", type=Path, default=common.REPO / "runs" / "plan_unseen")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds one run may take")
    ap.add_argument("--list", action="store_true", help="print the drawn configs and exit")
    args = ap.parse_args(argv)
    drawn = draw(args.configs, args.seed)
    if args.list:
        for c in drawn:
            print(c)
        return 0
    from throughput import summarize

    from async_dapo import planning as pl

    profile = pl.load_profile(args.profile)
    rows = []
    for c in drawn:
        run_dir = args.out / c["name"]
        sets = sets_for(c, args.steps, run_dir)
        cfg = common.load_config(CONFIG, sets)
        if not common.finished(run_dir, args.steps):
            rc = common.run_train(CONFIG, sets, args.out / f"{c['name']}.log", args.timeout)
            if rc:
                print(f"{c['name']}: exit {rc}; see {args.out / (c['name'] + '.log')}", flush=True)
                continue
        meas = summarize(run_dir, cfg, args.warmup)
        shape = pl.Shape.from_config(cfg)
        pred = pl.predict(profile, shape, 60, 10, sync_baseline=False).row()
        rows.append({**c, **compare(pred, meas), **at_measured_accuracy(pl, profile, shape, meas)})
        print(rows[-1], flush=True)
    cols = ["name", *SPACE] + [f"{k}_{s}" for k in TARGETS for s in ("pred", "meas", "err", "ok")] + [
        "keep_pred", "keep_meas", "steps_per_s_pred_at_acc", "steps_per_s_err_at_acc"]
    fmt = {c: ".3f" for c in cols if c.endswith(("_pred", "_meas", "_err"))}
    print(common.write_table(rows, cols, args.out / "table.md", args.out / "table.csv", fmt), flush=True)
    met = sum(r["steps_per_s_ok"] for r in rows)
    print(f"steps/s within ±15 % on {met} of {len(rows)} configs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
