"""Step time of the real system (Ray, SGLang, zmq, FSDP2) under several variants, side by side in one
invocation: the variants run interleaved (A B C A B C ...) so the machine's drift hits all of them alike.

    python tools/bench/steps.py --config configs/tiny_cpu.yaml --steps 60 --repeats 2 \
        --variant "before=rev:665514f" --variant "after=" \
        --variant "after, no sleep_on_idle=--set rollout.engine.sleep_on_idle=false"

A variant is ``NAME=[rev:REV] [--set a.b=c ...]``. ``rev:REV`` runs the code and config file of git
revision REV (checked out once into a temporary worktree) instead of the working tree's. Every variant
trains the same model (``--model``, bootstrap off) for ``--steps`` steps with no validation and no
checkpoint, plus ``--common`` overrides. Prints one Markdown row per variant: mean step time after the
first ``--warmup`` steps, of which waiting for data, generation tokens/s, and the whole command's wall time
(means over repeats, with the per-repeat step times). Absolute times vary run to run on a shared machine;
compare the ratios.
"""

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
from common import REPO, parser, records, run_train, step_records  # noqa: E402


def parse_variant(text: str) -> tuple[str, str | None, list[str]]:
    name, _, rest = text.partition("=")
    words = shlex.split(rest)
    rev = words.pop(0)[4:] if words and words[0].startswith("rev:") else None
    if any(w != "--set" for w in words[::2]):
        raise SystemExit(f"--variant {text!r}: after the optional rev:REV only '--set a.b=c' pairs are allowed")
    return name.strip(), rev, words


def checkout(rev: str, into: Path) -> Path:
    path = into / rev
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True, timeout=120)
    return path


def run(name: str, rev_dir: Path | None, sets: list[str], args, index: int) -> dict:
    root = rev_dir or REPO
    run_dir = args.out / f"{name.replace(' ', '_').replace(',', '')}_{index}"
    common = [f"learner.total_steps={args.steps}", "logging.val_every_steps=0", "checkpoint.every_steps=0",
              "checkpoint.export_hf=false", f"logging.run_dir={run_dir.resolve()}",
              f"model.path={args.model.resolve()}", "model.bootstrap=null", *args.common]
    log_path = run_dir.resolve().parent / f"{run_dir.name}.log"
    # In the revision's tree: its package, in the driver and every Ray worker (run_train's PYTHONPATH).
    rc = run_train(root / args.config, [*common, *sets[1::2]], log_path, timeout_s=args.run_timeout, cwd=root)
    if rc != 0:
        raise SystemExit(f"variant {name!r} failed (exit {rc}): see {log_path}")
    rows = records(run_dir)  # an older revision's rows carry the tags before the rename: records upgrades them
    steps = step_records(rows)[args.warmup:]
    total = next((r["time/total_s"] for r in rows if "time/total_s" in r), float("nan"))
    mean = lambda key: statistics.mean(r[key] for r in steps)  # noqa: E731
    return {"step_s": mean("perf/time_per_step"), "wait_s": mean("perf/wait_data_s"),
            "gen_tps": mean("perf/gen_tokens_per_s"), "total_s": total}


def main() -> None:
    ap = parser(__file__, __doc__)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml", help="relative to each variant's tree")
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=[rev:REV] [--set a.b=c ...] (repeatable; the first is the reference)")
    ap.add_argument("--common", action="append", default=[], metavar="A.B=C", help="override for every variant")
    ap.add_argument("--model", type=Path, default=Path("models/tiny_cpu"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_steps"))
    ap.add_argument("--run-timeout", type=float, default=1800)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for _, rev, _ in variants if rev}
        try:
            for i in range(args.repeats):
                for name, rev, sets in variants:
                    results[name].append(run(name, trees.get(rev), sets, args, i))
                    print(f"{name} #{i}: {json.dumps({k: round(v, 3) for k, v in results[name][-1].items()})}",
                          flush=True)
        finally:
            for path in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                               capture_output=True, timeout=120)
    base = statistics.mean(r["step_s"] for r in results[variants[0][0]])
    print(f"\n| variant | step s (after {args.warmup}) | per repeat | ratio to {variants[0][0]} | wait s | "
          "gen tok/s | command wall s |\n|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        step = statistics.mean(r["step_s"] for r in runs)
        per = " / ".join(f"{r['step_s']:.3f}" for r in runs)
        print(f"| {name} | {step:.3f} | {per} | {step / base:.2f} | "
              f"{statistics.mean(r['wait_s'] for r in runs):.3f} | {statistics.mean(r['gen_tps'] for r in runs):.0f} | "
              f"{statistics.mean(r['total_s'] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
