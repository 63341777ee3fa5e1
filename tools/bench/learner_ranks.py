"""Calibrate the planner's learner against ranks on this machine: the real FSDP2 learner rank
(async_dapo.learner.rank.LearnerWorker, gloo) with 1 and with 2 ranks, one process per rank, no Ray, no
engine, on synthetic groups of known token counts; the step seconds fitted to the planner's learner model
(async_dapo.planning.learner_model.step_seconds) and written as the profile's ``learner`` part.

    python tools/bench/learner_ranks.py --config configs/tiny_cpu.yaml [--set k=v ...] [--model DIR]
                                        --out runs/calibrate/learner.yaml [--quick] [--ranks 1 2]

The grid (every cell: 1 step discarded, then ``--steps`` timed; rank 0's wall):

* two batch sizes: B groups of G samples with responses of L and 4L tokens (L = max_response_length / 4);
* the config's micro-batch budget and a quarter of it (more micro-batches, same tokens);
* one optimizer update per step (mini_batch_groups = B) and two (B / 2), with correction ``naive``
  (no proximal pass), and two updates with the config's correction (its proximal pass).

Fits (least squares, micro-batch and update counts read from the learner's own plan, batching.plan_step):
1 rank: step s = step_base_s + per_token_s·T + per_micro_batch_s·m + per_update_s·U over the naive cells
(a coefficient the fit makes negative is fixed at 0 and the others refitted),
then forward_share = (proximal cell − its naive twin) / the second mini-batch's compute. 2 ranks: the
residual over the 1-rank model with tokens and updates halved = collective seconds per micro-batch (a slope
over m, per rank) -> collective_bandwidth_bytes_per_s = 3·collective_bytes·(1/2) / slope. Prints every
cell, the fit's residuals, and the 2-rank step predicted against measured.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tools/: common.py
import common  # noqa: E402


def cells(cfg, quick: bool) -> list[dict]:
    """The grid above: one dict per cell (what to set on the learner and which batch)."""
    B, budget = cfg.algorithm.train_batch_groups, cfg.learner.micro_batch_tokens
    out = []
    for lengths in ("short", "long"):
        for micro in (budget, max(16, budget // 4)):
            out.append({"batch": lengths, "micro_batch_tokens": micro, "mini_batch_groups": B, "mode": "naive"})
        out.append({"batch": lengths, "micro_batch_tokens": budget, "mini_batch_groups": max(1, B // 2),
                    "mode": "naive"})
        if not quick or lengths == "long":
            out.append({"batch": lengths, "micro_batch_tokens": budget, "mini_batch_groups": max(1, B // 2),
                        "mode": cfg.algorithm.correction.mode})
    return out


def make_batch(cfg, response: int, vocab: int, seed: int) -> list:
    """B groups of G samples, ``response`` tokens each after a 12-token prompt; half the samples correct."""
    import numpy as np

    from async_dapo.stream.wire import Group, Sample

    rng = np.random.default_rng(seed)
    groups = []
    for i in range(cfg.algorithm.train_batch_groups):
        samples = tuple(Sample(
            response_ids=rng.integers(3, vocab, size=response).astype(np.int32),
            logprobs=(-math.log(vocab) - 0.5 * rng.random(response)).astype(np.float32),
            versions=np.zeros(response, np.int32), reward=1.0 if j % 2 else -1.0, score=1.0 if j % 2 else -1.0,
            acc=bool(j % 2), truncated=False, finish_reason="stop", gen_seconds=0.1) for j in range(cfg.rollout.n))
        groups.append(Group(group_id=f"g{seed}-{i}", prompt_index=i, epoch=0, engine_rank=0,
                            prompt_ids=rng.integers(3, vocab, size=12).astype(np.int32), ground_truth="1",
                            data_source="calibrate", samples=samples, created_at=1.0, admitted_version=0))
    return groups


def variant(cfg, cell: dict):
    learner = cfg.learner.model_copy(update={"micro_batch_tokens": cell["micro_batch_tokens"],
                                             "mini_batch_groups": cell["mini_batch_groups"]})
    algorithm = cfg.algorithm.model_copy(update={"correction": cfg.algorithm.correction.model_copy(
        update={"mode": cell["mode"]})})
    return cfg.model_copy(update={"learner": learner, "algorithm": algorithm})


def rank_main(rank: int, world: int, port: int, cfg_json: str, grid: list[dict], steps: int, out: str) -> None:
    """One rank: build the real learner, run every cell, rank 0 writes the timings (JSON)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from async_dapo.config import Config
    from async_dapo.learner.rank import LearnerWorker

    cfg = Config.model_validate_json(cfg_json)
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    vocab = worker.model.config.vocab_size
    L = max(1, cfg.rollout.max_response_length // 4)
    batches = {"short": make_batch(cfg, L, vocab, 1), "long": make_batch(cfg, 4 * L, vocab, 2)}
    results = []
    try:
        for cell in grid:
            worker.cfg = variant(cfg, cell)  # plan() and train_step() read the learner section per call
            plan = worker.plan(batches[cell["batch"]])
            seconds = []
            for i in range(steps + 1):
                t = time.perf_counter()
                worker.train_step(batches[cell["batch"]])
                if i:
                    seconds.append(time.perf_counter() - t)
            tokens = sum(len(g.prompt_ids) * len(g.samples) + sum(len(s.response_ids) for s in g.samples)
                         for g in batches[cell["batch"]])
            first = sum(len(g.prompt_ids) * len(g.samples) + sum(len(s.response_ids) for s in g.samples)
                        for g in batches[cell["batch"]][:cell["mini_batch_groups"]])
            results.append({**cell, "ranks": world, "tokens": tokens, "first_mini_batch_tokens": first,
                            "micro": sum(len(p.micro_batches) for p in plan), "updates": len(plan),
                            "s": statistics.median(seconds)})
    finally:
        worker.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def measure(cfg, world: int, grid: list[dict], steps: int, timeout_s: float) -> list[dict]:
    """Run the grid on ``world`` rank processes (spawned, not Ray); bounded by ``timeout_s``."""
    import multiprocessing as mp

    from async_dapo.weights.sync import free_port

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "cells.json")
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, cfg.model_dump_json(), grid, steps, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:  # ours, by handle
            p.kill()
            p.join(10)
        if alive or any(p.exitcode for p in procs):
            raise SystemExit(f"learner ranks ({world}): " + ("timed out after "
                             f"{timeout_s:.0f} s" if alive else f"exit codes {[p.exitcode for p in procs]}"))
        return json.loads(Path(out).read_text())


def nonnegative_lstsq(X, y):
    """Least squares with every coefficient >= 0: a coefficient the fit makes negative (on CPU, a larger
    micro-batch can run slower per token than several small ones) is fixed at 0 and the rest refitted."""
    import numpy as np

    free = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        coef[free] = np.linalg.lstsq(X[:, free], y, rcond=None)[0]
        if coef.min() >= 0 or len(free) == 1:
            return np.clip(coef, 0.0, None)
        free.remove(int(np.argmin(coef)))


def fit_one_rank(rows: list[dict]) -> tuple[dict, list[float]]:
    """Least squares over the naive cells: s = base + per_token·T + per_micro·m + per_update·U (negatives
    clipped to 0); then forward_share from the proximal cells. Returns (the learner part, residuals)."""
    import numpy as np

    naive = [r for r in rows if r["mode"] == "naive"]
    X = np.array([[1.0, r["tokens"], r["micro"], r["updates"]] for r in naive])
    y = np.array([r["s"] for r in naive])
    coef = nonnegative_lstsq(X, y)
    part = {"step_base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_micro_batch_s": float(coef[2]),
            "per_update_s": float(coef[3])}
    shares = []
    for r in rows:
        if r["mode"] == "naive":
            continue
        twin = next(n for n in naive if n["batch"] == r["batch"] and n["updates"] == r["updates"]
                    and n["micro_batch_tokens"] == r["micro_batch_tokens"])
        second = (r["tokens"] - r["first_mini_batch_tokens"]) * part["per_token_s"]
        if second > 0:
            shares.append((r["s"] - twin["s"]) / second)
    part["forward_share"] = float(min(1.0, max(0.0, statistics.median(shares)))) if shares else 1 / 3
    return part, list(y - X @ coef)


def fit_two_ranks(part: dict, rows: list[dict], collective_bytes: float) -> tuple[dict, list[tuple]]:
    """The 2-rank cells' excess over the 1-rank model with tokens and updates halved, as a slope over the
    rank's micro-batches -> the collectives' bandwidth. Returns (the added fields, (cell, residual) pairs)."""
    import numpy as np

    naive = [r for r in rows if r["mode"] == "naive"]
    base = [part["step_base_s"] + part["per_token_s"] * r["tokens"] / 2 + part["per_micro_batch_s"] * r["micro"]
            + part["per_update_s"] * r["updates"] / 2 for r in naive]
    excess = np.array([r["s"] - b for r, b in zip(naive, base)])
    micro = np.array([float(r["micro"]) for r in naive])
    slope = float(np.clip(np.linalg.lstsq(micro[:, None], excess, rcond=None)[0][0], 1e-9, None))
    bw = 3 * collective_bytes * 0.5 / slope
    return ({"collective_bytes": collective_bytes, "collective_bandwidth_bytes_per_s": bw},
            [(r, e - slope * r["micro"]) for r, e in zip(naive, excess)])


def param_bytes(cfg) -> float:
    """The learner's parameters in its compute dtype (what FSDP all-gathers)."""
    from safetensors import safe_open

    size = 2 if cfg.learner.param_dtype == "bfloat16" else 4
    total = 0
    for f in sorted(Path(cfg.model.path).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return float(total * size)


def calibrate(cfg, ranks: list[int], quick: bool, steps: int, timeout_s: float, log) -> tuple[dict, str]:
    """The learner part of a planner profile and its source line."""
    from async_dapo.planning import Shape
    from async_dapo.planning.learner_model import step_seconds
    from async_dapo.planning.profile import LearnerProfile

    grid = cells(cfg, quick)
    by_rank = {}
    for world in ranks:
        t0 = time.perf_counter()
        by_rank[world] = measure(cfg, world, grid, steps, timeout_s)
        for r in by_rank[world]:
            log(f"ranks {world}: {r['batch']:5s} micro_budget {r['micro_batch_tokens']:5d} mini_batch_groups "
                f"{r['mini_batch_groups']:3d} {r['mode']:9s}: tokens {r['tokens']:6d}, micro {r['micro']:3d}, "
                f"updates {r['updates']}: {r['s']:.4f} s")
        log(f"ranks {world}: {time.perf_counter() - t0:.0f} s")
    part, resid = fit_one_rank(by_rank[min(ranks)])
    log("1 rank fit: " + ", ".join(f"{k} {v:.3e}" for k, v in part.items()) + "; residuals "
        + ", ".join(f"{100 * e / r['s']:+.1f} %" for e, r in zip(resid, [x for x in by_rank[min(ranks)]
                                                                      if x["mode"] == "naive"])))
    how = (f"tools/bench/learner_ranks.py: real LearnerWorker ranks (gloo, spawned processes), synthetic "
           f"batches of {cfg.algorithm.train_batch_groups} x {cfg.rollout.n}; 1 rank: lstsq s = base + "
           f"per_token·T + per_micro·m + per_update·U over {sum(r['mode'] == 'naive' for r in by_rank[min(ranks)])} "
           f"cells, forward_share from the proximal cells")
    if 2 in by_rank:
        extra, resid2 = fit_two_ranks(part, by_rank[2], param_bytes(cfg))
        part.update(extra)
        lp = LearnerProfile(**part)
        errs = []
        for r in by_rank[2]:
            shape = Shape(B=cfg.algorithm.train_batch_groups, G=cfg.rollout.n, eta=0, max_inflight_prompts=1,
                          learner_ranks=2, mini_batch_groups=r["mini_batch_groups"],
                          micro_batch_tokens=r["micro_batch_tokens"], proximal=r["mode"] != "naive")
            tokens = [r["tokens"] / cfg.algorithm.train_batch_groups] * cfg.algorithm.train_batch_groups
            errs.append(step_seconds(lp, shape, tokens) / r["s"] - 1)
        log(f"2 ranks: collectives {extra['collective_bandwidth_bytes_per_s']:.3e} B/s over "
            f"{extra['collective_bytes']:.0f} bytes; step predicted vs measured: "
            + ", ".join(f"{100 * e:+.1f} %" for e in errs))
        how += (f"; 2 ranks: excess over the 1-rank model (tokens, updates / 2) as a slope over micro-batches -> "
                f"bandwidth = 1.5 x {extra['collective_bytes']:.0f} bytes / slope; 2-rank steps predicted within "
                f"{100 * max(abs(e) for e in errs):.0f} %")
    return part, how


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the config's model.path)")
    ap.add_argument("--out", type=Path, required=True, help="YAML to write: {learner: ..., sources: ...}")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per cell (after 1 discarded)")
    ap.add_argument("--quick", action="store_true", help="CI-size: fewer cells, 2 timed steps")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each rank count may take")
    args = ap.parse_args()
    import yaml

    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)  # noqa: E731
    sets = [] if args.model is None else [f"model.path={args.model.resolve()}", "model.bootstrap=null"]
    cfg = common.load_model(args, sets)  # the model ready, by its absolute path
    part, how = calibrate(cfg, sorted(args.ranks), args.quick, 2 if args.quick else args.steps, args.timeout, log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(yaml.safe_dump({"learner": part, "sources": {"learner_ranks": how}}, sort_keys=False))
    print(f"learner ranks calibrated -> {args.out} in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
