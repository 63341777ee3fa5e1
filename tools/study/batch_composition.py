"""What async batches train on: the trained batches' response lengths against every group that arrived in
the same window, per staleness bound, update mode and batch order, on the long-tail task (lengths from 5 to
250 tokens; correctness falls with length). One normal training run per cell, one after another.

    python tools/study/batch_composition.py [--cells sync e1-inflight ...] [--steps 30] [--out runs/composition]

Per run, over the steps after ``--skip``: ``trained_length_ratio`` (mean of ``replay/trained_length_ratio``:
a batch's mean response length / the mean length of every group that arrived since the batch before it), the
cumulative ratio (``handed_out_tokens / handed_out_samples`` over ``received_tokens / received_samples``: the
trained population against the finished one), keep (accepted / received), the accuracy of every sample
generated for the training prompts (kept or dropped) in the first and last 10 steps, steps/s, mean
staleness, the admission-order batches forced by ``replay.order_wait_s``, and the generated tokens never
trained by reason (``rollout/wasted_tokens/*``, as a share of every token that arrived or was aborted).
From the trained batches themselves (``logging.record_batches``): ``long_share``, the share of trained samples
at least as long as the warm start's p75 (76 tokens: docs/results/throughput_and_studies.md, "Long-tail
responses"), and ``long_per_step``; and ``continued``, the tokens kept across an abort and continued
(``rollout/continued_tokens``) as a share of the same total.

Difficulty, two ways. ``acc_ratio_cum``: the accuracy of the trained samples (the recorded batches) over
the accuracy of every sample that arrived in the same steps (``replay/received_correct`` /
``replay/received_samples``), i.e. difficulty as the sampling policy saw it (the live metric is
``replay/trained_acc_ratio``). ``p_trained`` / ``p_admitted`` / ``p_ratio``: each prompt's difficulty as the
warm start's accuracy p on it (n samples with the run's sampling parameters, scored by the run's reward;
``calibrate.sample_groups``), averaged over the groups trained after ``--skip`` and over the prompts
admitted in the same steps (the queue's cursor order is seeded and the same in every cell, so the prompts
admitted are the cursor's positions between ``replay/admitted`` at the two ends); ``p_ratio_se`` is the
ratio's standard error from the spread of the trained groups' p. p is sampled once for
the first prompts of that order and cached in ``<out>/warm_p.json``; ``--no-difficulty`` skips it.

Cells (``--list``): ``sync`` (η 0); ``e{1,2,4}-{inflight,drain,abort,abort-partial}``
(``replay.batch_order=arrival``; ``abort-partial`` is abort with ``rollout.partial_rollout``); the same with
``-admission`` (``replay.batch_order=admission``). ``rollout.max_inflight_prompts`` and
``replay.capacity_groups`` follow (η + 1) × B.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # calibrate.sample_groups
import common  # noqa: E402

CONFIG = "configs/longtail_cpu.yaml"
BASE_SETS = ["logging.val_every_steps=0", "checkpoint.every_steps=0", "rollout.drain_timeout_s=30",
             "logging.record_batches=true"]
WARM_P75 = 76  # tokens: the warm start's p75 response length on this task (docs/results/throughput_and_studies.md)
COLUMNS = ["cell", "eta", "update_mode", "batch_order", "steps", "steps_per_s", "length_ratio", "length_ratio_cum",
           "keep", "acc_first10", "acc_last10", "staleness_mean", "forced_batches", "wasted_filtered",
           "wasted_stale", "wasted_abort", "continued", "long_share", "long_per_step", "acc_ratio_cum", "p_trained",
           "p_admitted", "p_ratio", "p_ratio_se"]


def cells() -> dict[str, dict]:
    out = {"sync": {"eta": 0, "update_mode": "inflight", "batch_order": "arrival"}}
    for eta in (1, 2, 4):
        for mode in ("inflight", "drain", "abort", "abort-partial"):
            for order in ("arrival", "admission"):
                name = f"e{eta}-{mode}" + ("-admission" if order == "admission" else "")
                out[name] = {"eta": eta, "update_mode": mode, "batch_order": order}
    return out


def sets_for(cell: dict, steps: int, batch_groups: int) -> list[str]:
    eta = cell["eta"]
    return [*BASE_SETS, f"learner.total_steps={steps}", f"replay.max_staleness={eta}",
            f"rollout.max_inflight_prompts={(eta + 1) * batch_groups}",
            f"replay.capacity_groups={max(128, (eta + 1) * batch_groups)}",
            f"rollout.update_mode={cell['update_mode'].removesuffix('-partial')}",
            f"rollout.partial_rollout={str(cell['update_mode'].endswith('-partial')).lower()}",
            f"replay.batch_order={cell['batch_order']}"]


def long_samples(run_dir: Path, skip: int) -> tuple[float, float]:
    """(share of the trained samples at least WARM_P75 tokens long, how many per step) over the recorded
    batches after step ``skip``."""
    files = [(int(f.stem.split("_")[1]), f) for f in (run_dir / "batches").glob("step_*.bin")]
    lengths = [len(smp.response_ids) for g in trained_groups(run_dir, skip) for smp in g.samples]
    long = sum(n >= WARM_P75 for n in lengths)
    return long / max(len(lengths), 1), long / max(sum(step > skip for step, _ in files), 1)


def trained_groups(run_dir: Path, skip: int) -> list:
    """The groups of the recorded batches after step ``skip``."""
    from async_dapo.stream.wire import read_groups

    files = [(int(f.stem.split("_")[1]), f) for f in (run_dir / "batches").glob("step_*.bin")]
    return [g for step, f in sorted(files) if step > skip for g in read_groups(f)]


def warm_p(cfg, prompts: int, path: Path) -> list[float]:
    """The warm start's accuracy on each of the first ``prompts`` prompts of the queue's order (index = position
    in that order), cached in ``path`` for the same model, sampling and number of prompts or more."""
    key = {"model": str(cfg.model.path), "n": cfg.rollout.n, "temperature": cfg.rollout.temperature,
           "top_p": cfg.rollout.top_p, "max_response_length": cfg.rollout.max_response_length,
           "reward": cfg.reward.function, "seed": cfg.data.shuffle_seed}
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["key"] == key and len(cached["p"]) >= prompts:
            return cached["p"]
    from calibrate import sample_groups
    from transformers import AutoTokenizer

    from async_dapo.data.rows import train_rows
    from async_dapo.rollout.engine import start_engine

    t0 = time.perf_counter()
    engine = start_engine(cfg.rollout.engine, cfg.model.path)
    try:
        records = sample_groups(engine, AutoTokenizer.from_pretrained(cfg.model.path), train_rows(cfg), cfg, prompts)
    finally:
        engine.shutdown()
    p = [sum(r["correct"]) / len(r["correct"]) for r in records]
    path.write_text(json.dumps({"key": key, "p": p}))
    print(f"warm start's p on {prompts} prompts x {cfg.rollout.n}: {time.perf_counter() - t0:.0f} s, "
          f"mean {statistics.fmean(p):.3f}", flush=True)
    return p


def difficulty(cfg, run_dir: Path, skip: int, p: list[float] | None) -> dict:
    """``acc_ratio_cum`` and the warm start's p of the trained groups against the admitted prompts (the
    module doc); p None: the four p figures are NaN."""
    from async_dapo.data.rows import PromptCursor, train_rows

    steps = common.step_records(common.records(run_dir))
    first, last = steps[skip - 1] if skip else {}, steps[-1]
    groups = trained_groups(run_dir, skip)
    acc = [bool(a) for g in groups for a in g.accuracies]
    arrived = ((last["replay/received_correct"] - first.get("replay/received_correct", 0))
               / max(last["replay/received_samples"] - first.get("replay/received_samples", 0), 1))
    out = {"acc_ratio_cum": (sum(acc) / max(len(acc), 1)) / arrived if arrived else float("nan"),
           "p_trained": float("nan"), "p_admitted": float("nan"), "p_ratio": float("nan"), "p_ratio_se": float("nan")}
    if p is None:
        return out
    lo, hi = int(first.get("replay/admitted", 0)), int(last["replay/admitted"])
    order = [index for _, index in PromptCursor(len(train_rows(cfg)), seed=cfg.data.shuffle_seed).take(hi)]
    p_of = {index: p[pos] for pos, index in enumerate(order) if pos < len(p)}
    trained = [p_of[g.prompt_index] for g in groups if g.prompt_index in p_of]
    admitted = [p_of[i] for i in order[lo:hi] if i in p_of]
    if trained and admitted:
        out.update(p_trained=statistics.fmean(trained), p_admitted=statistics.fmean(admitted))
        out["p_ratio"] = out["p_trained"] / out["p_admitted"]
        if len(trained) > 1:  # the trained mean's standard error (the admitted mean, over more prompts, as fixed)
            out["p_ratio_se"] = statistics.stdev(trained) / len(trained) ** 0.5 / out["p_admitted"]
    return out


def admitted_at_end(run_dir: Path) -> int:
    return int(common.step_records(common.records(run_dir))[-1]["replay/admitted"])


def summarise(name: str, cell: dict, run_dir: Path, skip: int) -> dict:
    steps = common.step_records(common.records(run_dir))
    if len(steps) <= skip + 1:
        raise SystemExit(f"{run_dir}: {len(steps)} steps recorded, need more than --skip {skip} + 1")
    window, first, last = steps[skip:], steps[skip - 1] if skip else None, steps[-1]
    wall = sum(r["perf/time_per_step"] for r in window)

    def delta(key: str) -> float:
        return last.get(key, 0.0) - (first or {}).get(key, 0.0)

    trained = delta("replay/handed_out_tokens") / max(delta("replay/handed_out_samples"), 1)
    arrived = delta("replay/received_tokens") / max(delta("replay/received_samples"), 1)
    waste_total = max(delta("replay/received_tokens") + delta("rollout/wasted_tokens/abort"), 1)
    acc = lambda rows: common.queue_rates(rows[0] if rows else None, rows[-1])["acc"]  # noqa: E731
    return {"cell": name, **cell, "steps": len(steps), "steps_per_s": len(window) / wall,
            "length_ratio": statistics.fmean(r.get("replay/trained_length_ratio", float("nan")) for r in window),
            "length_ratio_cum": trained / arrived if arrived else float("nan"),
            "keep": common.queue_rates(first, last)["keep"],
            "acc_first10": common.queue_rates(None, steps[min(9, len(steps) - 1)])["acc"],
            "acc_last10": acc(steps[-11:]),
            "staleness_mean": statistics.fmean(r.get("staleness/mean", 0.0) for r in window),
            "forced_batches": last.get("replay/forced_batches", 0.0),
            **{f"wasted_{k}": delta(f"rollout/wasted_tokens/{k}") / waste_total for k in ("filtered", "stale", "abort")},
            "continued": delta("rollout/continued_tokens") / waste_total,
            **dict(zip(("long_share", "long_per_step"), long_samples(run_dir, skip)))}


def main(argv=None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--cells", nargs="+", default=["sync", "e1-inflight", "e4-inflight", "e4-drain", "e4-abort",
                                                   "e4-inflight-admission", "e4-abort-admission"])
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (default %(default)s)")
    ap.add_argument("--skip", type=int, default=4, help="first steps left out of the figures")
    ap.add_argument("--out", type=Path, default=common.REPO / "runs" / "composition")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides, every run")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--list", action="store_true", help="print the cells and exit")
    ap.add_argument("--no-difficulty", action="store_true", help="skip the warm start's p (its own engine run)")
    args = ap.parse_args(argv)
    table = cells()
    if args.list:
        for name, cell in table.items():
            print(name, cell)
        return 0
    unknown = [c for c in args.cells if c not in table]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; --list prints them")
    B = common.load_config(CONFIG).algorithm.train_batch_groups
    rows = []
    for name in args.cells:
        run_dir = args.out / name
        sets = [*sets_for(table[name], args.steps, B), *args.extra, f"logging.run_dir={run_dir}"]
        if not common.finished(run_dir, args.steps):
            t = time.perf_counter()
            rc = common.run_train(CONFIG, sets, args.out / f"{name}.log", args.timeout)
            print(f"{name}: exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
            if rc:
                print(f"{name}: see {args.out / (name + '.log')}", flush=True)
                continue
        rows.append(summarise(name, table[name], run_dir, args.skip))
        print(rows[-1], flush=True)
    cfg = common.load_config(CONFIG)
    done = [args.out / row["cell"] for row in rows]
    p = None if args.no_difficulty or not done else warm_p(cfg, max(map(admitted_at_end, done)), args.out / "warm_p.json")
    for row, run_dir in zip(rows, done):
        row.update(difficulty(cfg, run_dir, args.skip, p))
    fmt = {c: ".3f" for c in COLUMNS if c not in ("cell", "eta", "update_mode", "batch_order", "steps", "forced_batches")}
    print(common.write_table(rows, COLUMNS, args.out / "table.md", args.out / "table.csv", fmt), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
