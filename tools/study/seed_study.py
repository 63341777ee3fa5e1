"""Does the default learn whatever the start? Runs ``async-dapo train`` for every (bootstrap seed, RL seed)
pair, one after another, and prints one Markdown table of the validation curves and the gains.

    python tools/study/seed_study.py --config configs/tiny_cpu.yaml --bootstrap-seeds 0 1 2 --rl-seeds 0 1 \
        [--out runs/seed_study] [--set a.b=c ...]

Bootstrap seed b builds its own warm start (``model.bootstrap.seed=b``, cached in OUT/model_b<b>; with
``sft_target_accuracy`` it stops where that seed reaches the target). RL seed r sets ``logging.seed``,
``data.shuffle_seed`` and ``rollout.engine.random_seed``. Each run writes OUT/b<b>_r<r>; a run that
finished its steps is not run again (the study resumes), and stops the study if it was made with another
config (choose another --out). Minutes are counted from the step-0 validation (start-up excluded); the
wall column is the whole command without the warm start (the run's time/total_s - time/bootstrap_s: as
README's command runs once the model is cached).
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
from common import check_reusable, finished, load, parser, records, run_train  # noqa: E402
from val_curve import val_rows  # noqa: E402  (tools/study/, this tool's directory)

GAIN = 0.10  # the bar: +10 points of held-out avg@k


def run_one(args, b: int, r: int) -> Path:
    run_dir = args.out / f"b{b}_r{r}"
    sets = [*args.overrides, f"model.path={args.out / f'model_b{b}'}", f"model.bootstrap.seed={b}",
            f"logging.seed={r}", f"data.shuffle_seed={r}", f"rollout.engine.random_seed={r}",
            f"logging.run_dir={run_dir}"]
    if finished(run_dir, args.steps):
        check_reusable(run_dir, args.config, sets)
        print(f"{run_dir}: finished earlier, not run again", flush=True)
        return run_dir
    print(f"{run_dir}: training ({' '.join(sets)})", flush=True)
    rc = run_train(args.config, sets, args.out / f"b{b}_r{r}.log", timeout_s=args.run_timeout)
    if rc != 0:
        print(f"{run_dir}: exit {rc} (see {args.out / f'b{b}_r{r}.log'})", flush=True)
    return run_dir


def summary(run_dir: Path, b: int, r: int) -> dict:
    rows = val_rows(run_dir)
    boot = json.loads((run_dir.parent / f"model_b{b}" / "bootstrap.json").read_text())["report"]
    phases = next((x for x in records(run_dir) if "time/total_s" in x), {})
    # Without the warm start: the first run of a bootstrap seed builds it, the README's command finds it cached.
    wall = phases.get("time/total_s", float("nan")) - phases.get("time/bootstrap_s", 0.0)
    t0, base = rows[0]["time"], rows[0]["val/avg_at_k"]
    curve = [(x["step"], (x["time"] - t0) / 60, x["val/avg_at_k"]) for x in rows]
    hit = next(((s, m) for s, m, v in curve if v - base >= GAIN), None)
    return {"b": b, "r": r, "sft_steps": boot["sft_steps"], "curve": curve, "base": base,
            "end_gain": curve[-1][2] - base, "best_gain": max(v for *_, v in curve) - base, "hit": hit,
            "wall_s": wall, "distinct": rows[0].get("val/distinct_prompts")}


def table(results: list[dict]) -> str:
    steps = [s for s, _, _ in results[0]["curve"]]
    head = ["bootstrap seed (SFT steps)", "RL seed", *[f"step {s}" for s in steps], "Δ end", "Δ best",
            "+10 pt at step (min)", "wall (model cached)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in results:
        hit = f"{x['hit'][0]} ({x['hit'][1]:.1f})" if x["hit"] else "not reached"
        cells = [f"{x['b']} ({x['sft_steps']})", str(x["r"]), *(f"{v:.3f}" for *_, v in x["curve"]),
                 f"{100 * x['end_gain']:+.1f} pt", f"{100 * x['best_gain']:+.1f} pt", hit,
                 f"{x['wall_s'] / 60:.1f} min"]
        lines.append("| " + " | ".join(cells) + " |")
    ends = [100 * x["end_gain"] for x in results]
    spread = f"{statistics.mean(ends):+.1f} ± {statistics.stdev(ends):.1f}" if len(ends) > 1 else f"{ends[0]:+.1f}"
    lines.append(f"\nGain at the end: {spread} points (mean ± sd over {len(ends)} runs); "
                 f"{sum(x['hit'] is not None for x in results)} of {len(results)} reached +10 points.")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__file__, __doc__, config=True)
    ap.add_argument("--bootstrap-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rl-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path, default=Path("runs/seed_study"))
    ap.add_argument("--run-timeout", type=float, default=3600, help="seconds one run may take")
    args = ap.parse_args()
    args.out, args.config = args.out.resolve(), Path(args.config).resolve()  # runs start in the repository root
    args.steps = load(args).learner.total_steps  # what a finished run trained
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for b in args.bootstrap_seeds:
        for r in args.rl_seeds:
            run_dir = run_one(args, b, r)
            if finished(run_dir, args.steps):
                results.append(summary(run_dir, b, r))
    if results:
        print(table(results))


if __name__ == "__main__":
    main()
