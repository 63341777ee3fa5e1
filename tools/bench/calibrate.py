"""Calibrate the planner (async_dapo/planning/) on this machine: measure each role ALONE and write a planner
profile YAML (the schema of ``async_dapo.planning.Profile``, validated before it is written).

    python tools/bench/calibrate.py --config configs/tiny_cpu.yaml [--set k=v ...] [--model models/tiny_cpu]
                                    --out runs/calibrate/<name>.yaml [--quick] [--phases engine actor ...]

Every figure of the roles comes from one role running by itself, except the contention phase, where the two
roles run at once but are NOT coupled (no weight push, no admission by version; the learner re-trains old
batches). The run phase (g) runs the config itself, for the run's own overhead only.

Phases (one Ray instance per placement, ``placement.place(cfg)`` as tools/bench/throughput.py does):

a. ``engine``: a bare in-process ``sglang.Engine`` (async_dapo.rollout.engine.start_engine: the rollout actor's own
   engine arguments) on the config's training prompts (data.encode_prompt), fixed-length generations
   (``ignore_eos``) of L tokens for n sequences; each (n, L) also with ``max_new_tokens = 1`` (the prefill).
   Per-iteration seconds = (wall(n, L) - wall(n, 1)) / (L - 1), fitted by least squares to
   a + b·n + c·K with K = n·(prompt_tokens + L/2) (negatives clipped to 0) -> decode_base_s,
   decode_per_seq_s, decode_per_ctx_token_s; prefill_per_token_s = slope of wall(n, 1) over the prompt
   tokens. max_running_seqs = min(max_inflight_prompts × n, max_total_tokens / (prompt + max_response/2)).
   Points whose context would not fit in max_total_tokens are skipped (the engine would queue them).
   Then the warm start as whole groups: the run's first 256 training prompts (16 with --quick) in the
   queue's own seeded order x n samples, scored by the run's reward ->
   workload.prompts (per prompt: its samples' lengths and outcomes; the planner derives keep for any G).
   Last, the engine continuously batched at the config's window (tools/bench/rollout.py's bare loop) at
   G = n/2, n and 2n: its seconds per group beyond the decode model's, fitted on per group + per sample × G,
   tell how b's cost splits (an SGLang request's own handling is paid per sample, not per group).
b. ``actor``: generation alone through the real rollout actor and replay queue (as throughput.generate_only,
   with the config's window: rollout.max_inflight_prompts; the queue's staleness and capacity opened so
   admission never binds). Gives prompt_tokens, the keep rate measured = accepted / (accepted +
   dynamic-sampling drops) from the queue's counters (a check on the keep derived from a's groups; without
   phase a, it and the accepted batches' lengths are the workload's keep_rate and response_lengths), and
   a cost per group = max(0, (measured s/batch - planner's s/batch) / groups received per batch), the
   planner's figure being the planner itself run with per_group_s = per_sample_s = 0, a free learner and
   no push (same window, and phase b's own keep rate and lengths); split into per_group_s and per_sample_s
   as a's fit splits the bare engine's (the actor in its run sets the level, the bare engine the shape).
``pair``: b again on two engines that split the window (CPU engines only): their groups/s over one
   engine's gives the effective contention.cores (below, with g's background_cores): two busy processes on
   these cores do less than twice one's work, beyond what the other processes' CPU explains.
c. ``learner``: the batches of b replayed into the learner ranks with the engines idle (throughput.train_only's
   loop): step seconds fitted to step_base_s + epochs · per_token_s · tokens / R, tokens =
   prompt + response tokens of the batch; when the token counts vary by < 10 %, step_base_s = 0 and
   per_token_s = mean s / mean tokens.
d. ``push``: weight pushes learner -> engines with the engines idle (as tools/bench/push.py): the sender's
   push_s, the engine's own update seconds (engine_pause_s), the learner's stall (push call); bandwidth from
   push.py's raw gloo broadcast of the same bytes, base_s = max(0, push_s - bytes / bandwidth).
e. ``contention``: the engines generate (as in b) while the learner re-trains the batches of c in a loop:
   engine_slowdown = alone received-groups/s / overlapped, learner_slowdown = overlapped step s / alone
   (both clipped at >= 1.0).

f. ``ranks``: the learner against ranks (tools/bench/learner_ranks.py: the real learner rank on 1 and 2
   processes over gloo, no Ray): per-token, per-micro-batch, per-update and collective figures, which replace
   c's two-figure fit in the profile; their compute figures are then scaled so that they reproduce c's mean
   step (the real learner actor on the run's batches sets the level, the synthetic cells the shape).

g. ``run``: the config run for real (tools/bench/in_run.py): the CPU its other processes keep busy (driver,
   replay queue, rollout actors' host side, Ray) -> contention.background_cores, this machine's CPUs ->
   contention.cores (engines on CPU only; with phase pair, the effective cores: cores = pair's ratio ×
   (2 + background_cores) / 2, within [1 + background_cores, CPUs]), the push call's median ->
   push.learner_stall_s (d's is with idle engines), and the training loop's own seconds per step; a second
   run at a quarter of the batch splits those into learner.loop_per_step_s (metrics, logs) and
   learner.loop_per_sample_s (the batch's hand-over). The engines' seconds per update
   (``perf/weight_load_s``) beyond the model's prediction without it, per sequence they hold, running or
   queued (occupancy x window x G) -> push.engine_pause_per_seq_s (inflight and abort: pausing retracts or
   aborts them; 0 for drain). Both runs' steps/s and engine time per update are then written beside the
   planner's prediction of them, as checks. The only phase that runs train and generate coupled; it
   measures what the roles alone cannot, and none of the roles' figures.

``--quick``: fewer points and batches (a CI-size smoke, about 6 minutes with the tiny model on 2 cores; its
numbers are not results). ``--phases``: run only some; the figures of the others come from ``--base``
(an earlier profile) or, for push and contention only, neutral values (free push, no contention). c, e and
pair need b (its batches, its rate).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tools/: common.py
sys.path.insert(0, str(HERE))  # tools/bench/: throughput.py, push.py
import common  # noqa: E402

PHASES = ("engine", "actor", "pair", "learner", "push", "contention", "ranks", "run")
ROLE_SETS = ["replay.max_staleness=1000", "replay.capacity_groups=1000000"]  # admission never binds (throughput)


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise SystemExit(f"non-finite figure {x}")
    return float(x)


# ------------------------------------------------------------------------------------------ a. engine
def engine_curve(cfg, quick: bool, log) -> tuple[dict, dict, float]:
    """(engine profile part without per_group_s, sources, mean prompt tokens of the prompts used)."""
    import numpy as np
    from transformers import AutoTokenizer

    from async_dapo.data.rows import encode_prompt, train_rows
    from async_dapo.rollout.engine import start_engine

    r, ec = cfg.rollout, cfg.rollout.engine
    window_seqs = r.max_inflight_prompts * r.n
    ns = [n for n in ((1, 8, 32, 128) if quick else (1, 8, 32, 128, 512)) if n <= window_seqs]
    if window_seqs not in ns and window_seqs < (128 if quick else 512):
        ns.append(window_seqs)
    ls = [16, 64] + ([256] if r.max_response_length >= 256 and not quick else [])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    rows = train_rows(cfg)
    prompts = [encode_prompt(tok, rows[i % len(rows)]) for i in range(max(ns))]
    ptok = statistics.mean(len(p) for p in prompts)
    if ec.context_length:
        ls = [L for L in ls if max(len(p) for p in prompts) + L <= ec.context_length] or [16]
    cap = ec.max_total_tokens
    params = {"temperature": r.temperature, "top_p": r.top_p, "ignore_eos": True}
    t0 = time.perf_counter()
    engine = start_engine(ec, cfg.model.path)
    log(f"engine: started in {time.perf_counter() - t0:.1f} s; n {ns}, L {ls}, prompt {ptok:.1f} tokens")
    points, pre = [], []
    try:
        engine.generate(input_ids=prompts[:8], sampling_params={**params, "max_new_tokens": 4})  # warm-up
        for n in ns:
            walls1 = []
            for L in ls:
                if cap and n * (ptok + L) > 0.9 * cap:
                    log(f"engine: n={n} L={L} skipped: {n * (ptok + L):.0f} context tokens > 0.9 x max_total_tokens {cap}")
                    continue
                t = time.perf_counter()
                engine.generate(input_ids=prompts[:n], sampling_params={**params, "max_new_tokens": 1})
                w1 = time.perf_counter() - t
                t = time.perf_counter()
                outs = engine.generate(input_ids=prompts[:n], sampling_params={**params, "max_new_tokens": L})
                wl = time.perf_counter() - t
                got = [len(o["output_ids"]) for o in outs]
                if min(got) != L:
                    log(f"engine: n={n} L={L}: some outputs shorter than L ({min(got)})")
                walls1.append(w1)
                points.append(decode_point(n, L, ptok, w1, wl))
                log(f"engine: n={n:4d} L={L:4d}: wall {wl:.3f} s, prefill(1 token) {w1:.3f} s, "
                    f"{points[-1][3] * 1e3:.3f} ms/iteration")
            if walls1:
                pre.append((n * ptok, statistics.median(walls1)))
        records = sample_groups(engine, tok, rows, cfg, 16 if quick else 256)
        lengths = [L for rec in records for L in rec["lengths"]]
        acc = statistics.mean(c for rec in records for c in rec["correct"])
        log(f"engine: warm start over {len(records)} prompts x {r.n}: accuracy {acc:.3f}, lengths {quantiles(lengths)}")
        bare, how_bare = bare_group_rates(engine, cfg, tok, quick, log)
    finally:
        engine.shutdown()
    decode, resid = fit_decode(points)
    log("engine: fit a + b·n + c·K -> a %.3e s, b %.3e s/seq, c %.3e s/ctx token; residuals (ms, %% of measured):"
        % tuple(decode.values()))
    for p, e in zip(points, resid):
        log(f"    n={p[0]:4d} L={p[1]:4d} K={p[2]:8.0f}: {e * 1e3:+.3f} ms ({100 * e / p[3]:+.1f} %)")
    slope, how_pre = fit_prefill(pre)
    per_seq_ctx = ptok + r.max_response_length / 2
    kv_seqs = int(cap / per_seq_ctx) if cap else window_seqs
    max_running = max(1, min(window_seqs, kv_seqs, ec.max_running_requests or window_seqs))
    pts = ", ".join(f"({p[0]},{p[1]})" for p in points)
    when = _now()
    part = {"max_running_seqs": max_running, **decode, "prefill_per_token_s": slope}
    rms = float(np.sqrt(np.mean((resid / np.array([p[3] for p in points])) ** 2)))
    src = {
        "decode": f"{when}: bare in-process sglang.Engine (async_dapo.rollout.engine.start_engine, the rollout actor's "
                  f"engine args), ignore_eos, config prompts ({ptok:.1f} tokens mean); (n, L) = {pts}; per-iteration "
                  f"= (wall(n,L) - wall(n,1)) / (L-1), lstsq a + b·n + c·K, K = n·(prompt + L/2), negatives "
                  f"clipped; rms relative residual {100 * rms:.1f} %",
        "prefill_per_token_s": f"{when}: {how_pre}, n = {[int(t / ptok) for t, _ in pre]}",
        "max_running_seqs": f"min(max_inflight_prompts x n = {window_seqs}, max_total_tokens {cap} / (prompt "
                            f"{ptok:.1f} + max_response_length/2) = {kv_seqs}, max_running_requests "
                            f"{ec.max_running_requests})",
    }
    src["prompts"] = (f"{when}: the bare engine sampling {len(records)} training prompts x n = {r.n} with the "
                      f"run's sampling parameters (temperature {r.temperature}, top_p {r.top_p}, max "
                      f"{r.max_response_length} tokens), scored by the run's reward: every sample, kept or "
                      f"filtered; accuracy {acc:.3f}; lengths {quantiles(lengths)}")
    src["bare_groups"] = f"{when}: {how_bare}"
    return part, src, ptok, records, bare


def bare_group_rates(engine, cfg, tok, quick: bool, log) -> tuple[dict[int, float], str]:
    """Groups per second of the bare engine, continuously batched at the config's window
    (rollout.max_inflight_prompts prompts in flight, each one batch request of G, as the actor sends a group;
    tools/bench/rollout.py's loop), at G = n/2, n and 2n: how an engine's cost beyond its decode iterations
    splits into per group and per sample (:func:`split_group_cost`)."""
    import rollout

    from async_dapo.rollout.actor import sampling_params

    n, window = cfg.rollout.n, cfg.rollout.max_inflight_prompts
    repeats, seconds = (1, 2.0) if quick else (2, 4.0)
    rates = {}
    for G in sorted({max(1, n // 2), n, 2 * n}):
        runs = engine.loop.run_until_complete(rollout.bare_loop(
            engine, rollout.prompt_stream(cfg, tok), G, sampling_params(cfg), window, window, repeats, seconds))
        rates[G] = sum(g for _, g, _ in runs) / sum(s for s, _, _ in runs)
        log(f"engine: G={G:3d}, {window} prompts in flight: {rates[G]:.2f} groups/s")
    how = (f"the bare engine continuously batched with {window} prompts in flight (one request of G samples "
           f"each, the actor's sampling parameters), after {window} groups, {repeats} x {seconds:.0f} s: groups/s "
           + ", ".join(f"G {G}: {v:.2f}" for G, v in rates.items()))
    return rates, how


def decode_point(n: int, L: int, ptok: float, w1: float, wl: float) -> tuple:
    """One engine measurement as the decode fit reads it: (n, L, K = n·(prompt + L/2), seconds per decode
    iteration = (wall(n, L) - wall(n, 1)) / (L - 1), wall(n, 1), wall(n, L))."""
    return n, L, n * (ptok + L / 2), max(wl - w1, 1e-9) / (L - 1), w1, wl


def fit_decode(points: list[tuple]) -> tuple[dict, "np.ndarray"]:
    """Least squares of seconds per iteration = a + b·n + c·K over :func:`decode_point` tuples, negatives
    clipped to 0 (and b = mean s/n when a + b would be 0: the planner divides by it) -> (decode_base_s,
    decode_per_seq_s, decode_per_ctx_token_s as a dict in that order, residuals in seconds)."""
    import numpy as np

    if len(points) < 3:
        raise SystemExit(f"engine: only {len(points)} (n, L) points fit: need 3 for the fit")
    X = np.array([[1.0, p[0], p[2]] for p in points])
    y = np.array([p[3] for p in points])
    coef = np.clip(np.linalg.lstsq(X, y, rcond=None)[0], 0.0, None)
    if coef[0] + coef[1] <= 0:  # the planner needs a + b > 0
        coef[1] = max(float(np.mean(y / X[:, 1])), 1e-9)
    fit = {"decode_base_s": float(coef[0]), "decode_per_seq_s": float(coef[1]),
           "decode_per_ctx_token_s": float(coef[2])}
    return fit, y - X @ coef


def fit_prefill(pre: list[tuple[float, float]]) -> tuple[float, str]:
    """(prompt tokens n·prompt, wall(n, max_new_tokens=1)) pairs -> (prefill_per_token_s, how it was found):
    the slope of a line with intercept (the fixed cost of a request is not prefill), or, when that slope is
    not positive (or there is one pair), wall / tokens at the largest n."""
    import numpy as np

    P = np.array([[1.0, t] for t, _ in pre])
    slope = float(np.linalg.lstsq(P, np.array([w for _, w in pre]), rcond=None)[0][1]) if len(pre) >= 2 else 0.0
    if slope > 0:
        return slope, "slope of wall(n, max_new_tokens=1) over n x prompt tokens (lstsq with intercept)"
    return pre[-1][1] / pre[-1][0], "wall(n, 1) / prompt tokens at the largest n (the slope was <= 0)"


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def quantiles(lengths: list[int]) -> str:
    """p10 ... p99, max, and the share at the budget-truncated maximum, as one line."""
    xs = sorted(lengths)
    qs = ", ".join(f"p{int(q * 100)} {xs[min(len(xs) - 1, int(q * len(xs)))]}" for q in QUANTILES)
    return f"{qs}, max {xs[-1]}, mean {statistics.mean(xs):.1f}"


def sample_groups(engine, tok, rows, cfg, prompts: int) -> list[dict]:
    """The warm start as whole groups: ``prompts`` training rows (drawn as training draws them) x n samples
    with the run's sampling parameters, up to the response budget, each scored by the run's reward function;
    per prompt its samples' lengths and outcomes (``acc``), whatever the group's fate (the actor phase only
    sees the groups dynamic sampling kept). The planner derives keep for any group size from these."""
    from async_dapo.data.reward import load_score_fn
    from async_dapo.data.rows import encode_prompt

    from async_dapo.data.rows import PromptCursor

    r, score = cfg.rollout, load_score_fn(cfg.reward)
    # the first prompts of the run's own order (the queue's cursor: a seeded permutation), not of the file
    # (a file's order can be anything: the synthetic task alternates levels, a dataset may be sorted)
    order = [index for _, index in PromptCursor(len(rows), seed=cfg.data.shuffle_seed).take(prompts)]
    ids = [encode_prompt(tok, rows[i]) for i in order for _ in range(r.n)]
    outs = engine.generate(input_ids=ids, sampling_params={"temperature": r.temperature, "top_p": r.top_p,
                                                           "max_new_tokens": r.max_response_length})
    records = []
    for k, i in enumerate(order):
        row, mine = rows[i], outs[k * r.n:(k + 1) * r.n]
        texts = [tok.decode(o["output_ids"], skip_special_tokens=True) for o in mine]
        records.append({"lengths": [max(1, len(o["output_ids"])) for o in mine],
                        "correct": [bool(score(row.data_source, t, row.ground_truth, row.extra_info).acc)
                                    for t in texts]})
    return records


# ------------------------------------------------------------------------------------------ b, c, d, e
def queue_stats(placed) -> dict:
    return placed.get(placed.replay.stats.remote(), "replay stats")


def generate(placed, warmup: int, count: int, timeout_s: float) -> dict:
    """throughput.generate_only's loop on an existing placement, with the queue's counters at the window's
    ends: s/batch, received groups/s over the window, the batches."""
    from throughput import collect_batches

    batches, (t0, s0) = collect_batches(placed, warmup, count, timeout_s, "generation phase",
                                        lambda: (time.perf_counter(), queue_stats(placed)))
    t1, s1 = time.perf_counter(), queue_stats(placed)
    return {"g_s": (t1 - t0) / count, "received_per_s": (s1["received"] - s0["received"]) / (t1 - t0),
            "received": s1["received"] - s0["received"], "stats": s1, "batches": batches, "wall_s": t1 - t0}


def generate_alone(cfg, warmup: int, count: int, timeout_s: float) -> dict:
    """:func:`generate` on a placement of its own (its own Ray instance), shut down after."""
    import ray

    from async_dapo.fleet.placement import place

    ray.init(address=cfg.placement.ray_address, include_dashboard=False, log_to_driver=False)
    placed = None
    try:
        placed = place(cfg)
        return generate(placed, warmup, count, timeout_s)
    finally:
        if placed is not None:
            placed.shutdown()
        ray.shutdown()


def batch_tokens(batch) -> int:
    return sum(len(g.prompt_ids) * len(g.samples) + sum(len(s.response_ids) for s in g.samples) for g in batch)


def train(placed, batches: list) -> list[float]:
    seconds = []
    for batch in batches:
        t = time.perf_counter()
        placed.on_learners("train_step", batch)
        seconds.append(time.perf_counter() - t)
    return seconds


def workload_part(cfg, gen: dict) -> tuple[dict, dict]:
    s, batches = gen["stats"], gen["batches"]
    lengths = [len(smp.response_ids) for b in batches for g in b for smp in g.samples]
    ptok = statistics.mean(len(g.prompt_ids) for b in batches for g in b)
    drops = s["dropped_all_correct"] + s["dropped_all_wrong"] + s["dropped_uniform"]
    keep = s["accepted"] / max(1, s["accepted"] + drops)
    if not cfg.algorithm.dynamic_sampling.enable:
        keep = 1.0
    when = _now()
    part = {"prompt_tokens": float(ptok), "response_lengths": [max(1, int(x)) for x in lengths],
            "keep_rate": max(1e-3, min(1.0, keep))}
    src = {"response_lengths": f"{when}: every sample of the {len(batches)} accepted batches of phase b "
                               f"({len(lengths)} samples; filtered groups' lengths are not seen), mean "
                               f"{statistics.mean(lengths):.2f}",
           "prompt_tokens": f"{when}: mean prompt ids of those batches' groups",
           "keep_rate": f"{when}: replay queue counters over phase b: accepted {s['accepted']} / (accepted + "
                        f"dropped_all_correct {s['dropped_all_correct']} + dropped_all_wrong "
                        f"{s['dropped_all_wrong']} + dropped_uniform {s['dropped_uniform']})"}
    return part, src


def shape_of(cfg, **changes):
    from async_dapo.planning import Shape

    return Shape.from_config(cfg).with_(**changes)


def engine_only_s_per_batch(cfg, engine: dict, workload: dict, **changes) -> float:
    """The planner's seconds per batch with per_group_s = per_sample_s = 0, a (nearly) free learner and no
    push: what the decode model alone predicts for phase b's generation (``changes``: to the run's shape)."""
    from async_dapo.planning import predict, profile_from_dict

    prof = profile_from_dict({
        "name": "engine-only", "hardware": "-", "engine": {**engine, "per_group_s": 0.0, "per_sample_s": 0.0},
        "learner": {"step_base_s": 1e-9, "per_token_s": 0.0},
        "push": {"base_s": 0.0, "bytes": 0.0, "bandwidth_bytes_per_s": 1e12, "engine_pause_s": 0.0},
        "workload": workload}, "engine-only profile")
    shape = shape_of(cfg, eta=1000, every_k_steps=10 ** 6, update_mode="inflight", **changes)
    return 1.0 / predict(prof, shape, steps=14, warmup=4, sync_baseline=False).steps_per_s


def fit_group_cost(residuals: dict[int, float]) -> tuple[float, float]:
    """(per group, per sample) seconds: least squares of an engine's seconds per group beyond its decode
    iterations, ``residuals`` {G: seconds}, on a + b·G, each clipped at 0 (one group size: all per group)."""
    import numpy as np

    if len(residuals) < 2:
        return max(0.0, statistics.fmean(residuals.values())), 0.0
    G = np.array(sorted(residuals), dtype=float)
    r = np.array([residuals[g] for g in sorted(residuals)])
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(G), G], 1), r, rcond=None)
    if b <= 0:
        return max(0.0, statistics.fmean(residuals.values())), 0.0
    if a < 0:  # through the origin
        return 0.0, max(0.0, float(np.dot(G, r) / np.dot(G, G)))
    return float(a), float(b)


def split_group_cost(cfg, engine: dict, workload: dict, bare: dict[int, float],
                     per_group: float) -> tuple[float, float, str]:
    """(per_group_s, per_sample_s): phase b's cost per group beyond the decode model (``per_group``, the actor
    in its run sets the level) split as the bare engine's is between per group and per sample, from its rates
    at several group sizes (:func:`bare_group_rates`) minus the decode model's at the same shapes."""
    n, B = cfg.rollout.n, cfg.algorithm.train_batch_groups
    resid = {G: 1.0 / rate - engine_only_s_per_batch(cfg, engine, workload, G=G, filter_groups=False) / B
             for G, rate in bare.items()}
    a, b = fit_group_cost(resid)
    share = b * n / (a + b * n) if a + b * n > 0 else 0.0
    how = (f"the bare engine's seconds per group beyond the decode model's at the same shape ("
           + ", ".join(f"G {G}: {1e3 * r:.3f} ms" for G, r in resid.items())
           + f") fitted a + b·G: a {1e3 * a:.3f} ms, b {1e3 * b:.3f} ms per sample, so {100 * share:.0f} % of a "
           f"group of {n}'s is per sample; phase b's {1e3 * per_group:.3f} ms per group split the same way")
    return (1 - share) * per_group, share * per_group / n, how


def fit_learner(seconds: list[float], tokens: list[int]) -> tuple[float, float, str]:
    """Step seconds against batch tokens -> (base s, s per token of a step, how): least squares
    s = base + slope x tokens, or base = 0 and slope = mean s / mean tokens when the token counts vary by
    < 10 % or there are < 3 steps (no slope to see), or when the fit gives a negative term."""
    import numpy as np

    s, t = seconds, tokens
    spread = (max(t) - min(t)) / statistics.mean(t)
    if spread < 0.10 or len(s) < 3:
        return 0.0, statistics.mean(s) / statistics.mean(t), (
            f"token counts vary by {100 * spread:.1f} % (< 10 % or < 3 steps): step_base_s = 0, "
            f"per_token_s = mean s / mean tokens")
    base, slope = (float(v) for v in np.linalg.lstsq(np.array([[1.0, x] for x in t]), np.array(s), rcond=None)[0])
    if base < 0 or slope <= 0:
        return 0.0, statistics.mean(s) / statistics.mean(t), ("lstsq gave a negative term: step_base_s = 0, "
                                                              "per_token_s = mean s / mean tokens")
    return base, slope, "lstsq step s = base + slope x tokens"


def learner_part(cfg, seconds: list[float], tokens: list[int], warmup: int) -> tuple[dict, dict, float]:
    s, t = seconds[warmup:], tokens[warmup:]
    epochs, R = cfg.learner.epochs, cfg.placement.learner_ranks
    when = _now()
    base, slope, how = fit_learner(s, t)
    part = {"step_base_s": max(0.0, base), "per_token_s": slope * R / epochs, "scaling_efficiency": 1.0}
    src = {"learner": f"{when}: train_step on phase b's batches with the engines idle (throughput.train_only's loop), "
                      f"{len(s)} steps after {warmup} discarded, tokens = prompt + response of the batch "
                      f"({min(t)}..{max(t)}); {how}; per_token_s = slope x ranks {R} / epochs {epochs}; "
                      f"mean step {statistics.mean(s):.3f} s"}
    return part, src, statistics.mean(s)


def push_phase(placed, cfg, pushes: int) -> tuple[dict, dict]:
    import ray

    import push as push_bench

    stalls, runs = [], []
    for _ in range(pushes + 1):  # the first one out of the figures (first-call overheads)
        started = placed.on_learners("push_weights", placed.serving(), None)
        placed.wait_push()
        last = placed.get(placed.learners[0].last_push.remote(), "last push")
        if last.get("error"):
            raise SystemExit(f"push failed: {last['error']}")
        stalls.append(max(s["push_blocking_s"] for s in started))
        runs.append(last)
    stalls, runs = stalls[1:], runs[1:]
    med = statistics.median
    nbytes = float(runs[0]["bytes"])
    push_s, pause_s, stall_s = med(r["push_s"] for r in runs), med(r["engine_s"] for r in runs), med(stalls)
    raw = push_bench.raw_gloo(ray, int(nbytes), pushes, cfg.weight_sync.timeout_s)
    bw = nbytes / max(med(raw), 1e-9)
    base = max(0.0, push_s - nbytes / bw)
    when = _now()
    part = {"base_s": base, "bytes": nbytes, "bandwidth_bytes_per_s": bw, "engine_pause_s": pause_s,
            "learner_stall_s": stall_s}
    src = {"push": f"{when}: {pushes} pushes (after 1 discarded) learner -> engines with the engines idle "
                   f"(as tools/bench/push.py): push_s median {push_s:.4f} s at the sender, engine's own update "
                   f"(engine_s) {pause_s:.4f} s -> engine_pause_s, push call {stall_s:.4f} s -> learner_stall_s "
                   f"(the run phase's push call replaces it when that phase runs); "
                   f"bytes = the push's bytes; bandwidth = bytes / median raw gloo broadcast of the same bytes "
                   f"(push.raw_gloo, {med(raw):.4f} s); base_s = push_s - bytes / bandwidth"}
    return part, src


def contention_phase(placed, batches: list, alone_rate: float, alone_steps: list[float], loops: int,
                     warmup_groups: int, log) -> tuple[dict, dict]:
    placed.start_rollouts()
    deadline = time.monotonic() + 600
    while queue_stats(placed)["received"] < warmup_groups:  # the engines are up to speed
        if time.monotonic() > deadline:
            raise SystemExit("contention phase: the engines produced nothing")
        time.sleep(0.5)
    t0, r0 = time.perf_counter(), queue_stats(placed)["received"]
    steps = []
    for _ in range(loops):
        steps += train(placed, batches)
    t1, r1 = time.perf_counter(), queue_stats(placed)["received"]
    rate = (r1 - r0) / (t1 - t0)
    alone_step, during = statistics.mean(alone_steps), statistics.mean(steps)
    eng = max(1.0, alone_rate / rate) if rate > 0 else 1.0
    lrn = max(1.0, during / alone_step)
    log(f"contention: {rate:.2f} groups/s generating while training (alone {alone_rate:.2f}); step {during:.3f} s "
        f"while generating (alone {alone_step:.3f})")
    when = _now()
    part = {"engine_slowdown": eng, "learner_slowdown": lrn}
    src = {"contention": f"{when}: engines generating (as phase b) while the learner re-trains phase b's "
                         f"{len(batches)} batches x {loops} (not coupled: no push, no admission by version): "
                         f"received groups/s {rate:.3f} vs alone {alone_rate:.3f} -> engine_slowdown "
                         f"(clipped >= 1, raw {alone_rate / max(rate, 1e-12):.3f}); step {during:.3f} s vs "
                         f"alone {alone_step:.3f} s (same batches) -> learner_slowdown (raw "
                         f"{during / alone_step:.3f})"}
    return part, src


def roles(cfg, phases: set, quick: bool, timeout_s: float, engine: dict | None, log,
          records: list[dict] | None = None, bare: dict[int, float] | None = None, pair_cfg=None) -> dict:
    """Phases b-e on one or two placements: b (generation alone) on the first; c, d, e on a second whose
    engines stay idle until e (no rollout can be paused once started)."""
    import ray

    from async_dapo.fleet.placement import place

    out = {"sources": {}}
    warmup, count = (1, 2) if quick else (3, 8)
    gen = None
    if "actor" in phases:
        gen = generate_alone(cfg, warmup, count, timeout_s)
        out["gen"] = gen
        out["workload"], src = workload_part(cfg, gen)
        out["sources"].update(src)
        phase_b = dict(out["workload"])  # what phase b itself generated: per_group_s is derived against it
        if records is not None:  # whole groups, kept or not (phase b's are the kept ones): keep is derived
            from async_dapo.planning import Workload
            from async_dapo.planning.workload import keep_rate

            measured = out["workload"].pop("keep_rate")
            out["sources"]["response_lengths_kept"] = out["sources"].pop("response_lengths")
            out["sources"]["keep_rate_phase_b"] = out["sources"].pop("keep_rate")
            out["workload"].pop("response_lengths")
            out["workload"]["prompts"] = records
            derived = keep_rate(Workload.model_validate(out["workload"]), cfg.rollout.n)
            out["sources"]["keep_rate_phase_b"] += f" = {measured:.3f}; derived from prompts: {derived:.3f}"
            log(f"actor: keep {measured:.3f} measured in phase b, {derived:.3f} derived from the warm start's groups")
        log(f"actor: {gen['g_s']:.3f} s/batch over {count} batches after {warmup}, "
            f"{gen['received_per_s']:.2f} groups received/s, keep_rate {phase_b['keep_rate']:.3f}")
        if engine is not None:
            pred = engine_only_s_per_batch(cfg, engine, phase_b)
            per_batch_groups = gen["received"] / count
            resid = max(0.0, (gen["g_s"] - pred) / per_batch_groups)
            out["sources"]["per_group_s"] = (
                f"{_now()}: phase b measured {gen['g_s']:.4f} s/batch ({per_batch_groups:.1f} groups received per "
                f"batch, {count} batches after {warmup}, window {cfg.rollout.max_inflight_prompts} prompts) minus "
                f"the planner's {pred:.4f} s/batch for the same shape with per_group_s = per_sample_s = 0, a free "
                f"learner and no push (async_dapo.planning.predict, 14 steps, 4 warm-up), / groups per batch; "
                f"clipped at 0: {1e3 * resid:.3f} ms per group")
            if bare:
                out["per_group_s"], out["per_sample_s"], how = split_group_cost(cfg, engine, phase_b, bare, resid)
                out["sources"]["per_sample_s"] = f"{_now()}: {how}"
            else:
                out["per_group_s"], out["per_sample_s"] = resid, 0.0
                out["sources"]["per_sample_s"] = "not measured (no engine phase): 0, all per group"
            log(f"actor: planner engine-only {pred:.3f} s/batch -> per_group_s {out['per_group_s']:.5f}, "
                f"per_sample_s {out['per_sample_s']:.5f}")
    if "pair" in phases:
        if gen is None:
            raise SystemExit("--phases pair needs the actor phase (one engine's rate)")
        if pair_cfg is None:
            out["sources"]["pair"] = "not measured: the engines do not run on CPU cores they share"
        else:
            out["pair_ratio"], out["sources"]["pair"] = pair_phase(pair_cfg, gen["received_per_s"], warmup, count,
                                                                   timeout_s, log)
    need = phases & {"learner", "push", "contention"}
    if not need:
        return out
    if ("learner" in need or "contention" in need) and gen is None:
        raise SystemExit("--phases learner/contention need the actor phase (its batches)")
    ray.init(address=cfg.placement.ray_address, include_dashboard=False, log_to_driver=False)
    placed = None
    try:
        placed = place(cfg)
        alone = None
        if gen is not None:
            batches = gen["batches"]
            tokens = [batch_tokens(b) for b in batches]
            seconds = train(placed, batches)
            lw = 1 if len(batches) > 2 else 0
            if "learner" in phases:
                out["learner"], src, _ = learner_part(cfg, seconds, tokens, lw)
                out["sources"].update(src)
                log(f"learner: steps {[round(s, 3) for s in seconds]} s, tokens {tokens}")
            alone = seconds[lw:]
            out["learner_steps"] = (seconds[lw:], tokens[lw:])
        if "push" in phases:
            out["push"], src = push_phase(placed, cfg, 2 if quick else 5)
            out["sources"].update(src)
            log(f"push: {out['push']}")
        if "contention" in phases:
            train_set = gen["batches"][lw:]
            out["contention"], src = contention_phase(placed, train_set, gen["received_per_s"], alone,
                                                      1 if quick else 2, cfg.algorithm.train_batch_groups, log)
            out["sources"].update(src)
    finally:
        if placed is not None:
            placed.shutdown()
        ray.shutdown()
    return out


def pair_sets(cfg) -> list[str]:
    """Overrides for phase ``pair``: two engines, the config's window split between them, and Ray CPU
    reservations that fit both engines and the learner ranks on this machine (logical: the processes share
    the cores whatever they say)."""
    roles_ = 2 + cfg.placement.learner_ranks
    share = min(cfg.placement.engine_cpus, int(100 * (os.cpu_count() or 1) / roles_) / 100)
    return ["placement.num_engines=2", f"rollout.max_inflight_prompts={-(-cfg.rollout.max_inflight_prompts // 2)}",
            f"placement.engine_cpus={share}", f"placement.learner_cpus={min(cfg.placement.learner_cpus, share)}"]


def pair_phase(cfg, alone_rate: float, warmup: int, count: int, timeout_s: float, log) -> tuple[float, str]:
    """Phase ``pair``: generation alone as in phase b, on two engines that split its window; their received
    groups/s over one engine's (phase b's), from which :func:`effective_cores` follows."""
    gen = generate_alone(cfg, warmup, count, timeout_s)
    ratio = gen["received_per_s"] / alone_rate
    log(f"pair: two engines {gen['received_per_s']:.2f} groups/s, one engine {alone_rate:.2f}: x {ratio:.3f}")
    return ratio, (f"{_now()}: two engines generating alone (phase b with placement.num_engines=2, "
                   f"{cfg.rollout.max_inflight_prompts} prompts in flight each), {count} batches after {warmup}: "
                   f"{gen['received_per_s']:.3f} groups/s received against one engine's {alone_rate:.3f} in phase "
                   f"b: x {ratio:.3f}")


def effective_cores(pair_ratio: float, background: float, cpus: float) -> tuple[float, str]:
    """contention.cores such that the planner's core sharing gives two engines generating alone
    ``pair_ratio`` times one engine's rate: each runs (2 + background) / cores times slower, so cores =
    pair_ratio × (2 + background) / 2; at least 1 + background (one engine alone is not slowed), at most
    the machine's ``cpus``."""
    raw = pair_ratio * (2 + background) / 2
    cores = min(cpus, max(1 + background, raw))
    return cores, (f"effective: two engines generated {pair_ratio:.3f} times one engine's groups/s (phase pair) -> "
                   f"cores = {pair_ratio:.3f} x (2 + background_cores {background:.3f}) / 2 = {raw:.3f}, within "
                   f"[1 + background_cores, {cpus:g} CPUs]: {cores:.3f}")


def learner_against_ranks(cfg, got: dict, quick: bool, sources: dict, log) -> dict:
    """Phase f (tools/bench/learner_ranks.py): the learner part fitted on 1 and 2 real ranks; phase c's
    steps (the run's own placement and batches), when measured, predicted by it as a check."""
    import learner_ranks

    from async_dapo.planning import Shape
    from async_dapo.planning.learner_model import step_seconds
    from async_dapo.planning.profile import LearnerProfile

    part, how = learner_ranks.calibrate(cfg, [1, 2], quick, 2 if quick else 3, 900, log)
    sources["learner_ranks"] = f"{_now()}: {how}"
    if got.get("learner_steps"):
        seconds, tokens = got["learner_steps"]
        B = cfg.algorithm.train_batch_groups
        pred = statistics.mean(step_seconds(LearnerProfile(**part), Shape.from_config(cfg), [t / B] * B)
                               for t in tokens)
        scale = statistics.mean(seconds) / pred
        part = scaled_compute(part, scale)
        check = (f"phase c's mean step {statistics.mean(seconds):.3f} s, predicted {pred:.3f} s by the ranks fit: "
                 f"its compute figures x {scale:.3f} (the real learner actor on the run's batches sets the level, "
                 f"the synthetic cells the shape against ranks)")
        sources["learner_ranks"] += f"; {check}"
        log(f"ranks: {check}")
    return part


def scaled_compute(part: dict, scale: float) -> dict:
    """The learner part with its compute figures (not its collectives) times ``scale``."""
    keys = ("step_base_s", "per_token_s", "per_micro_batch_s", "per_update_s")
    return {**part, **{k: part[k] * scale for k in keys if k in part}}


def run_phase(args, cfg, sources: dict, log) -> dict:
    """Phase g (tools/bench/in_run.py): the config run for real; the cores its other processes use, the push
    call in a run, the training loop's own seconds (a second run at a quarter of the batch splits them per
    step and per sample), and what the runs measured for :func:`run_check`."""
    import in_run

    from async_dapo.device import resolve_device

    steps, warmup = (8, 3) if args.quick else (24, 8)
    sets = [*args.overrides, f"model.path={cfg.model.path}", "model.bootstrap=null"]
    run_dir = args.out.parent / f"{args.out.stem}_run"
    got = in_run.measure(args.config, sets, run_dir, steps, warmup, args.run_timeout, log)
    samples = cfg.algorithm.train_batch_groups * cfg.rollout.n
    sharing, loop_s, how = in_run.overhead_part(got, resolve_device(cfg.rollout.engine.device), samples)
    sources["run"] = f"{_now()}: {how} ({run_dir})"
    log(f"run: {how}")
    out = {"sharing": sharing, "learner_stall_s": in_run.push_stall_s(got["steps"]), **run_figures(got["steps"])}
    small_sets = smaller_batch(cfg)
    if not small_sets:  # a batch of one group: the loop's cost cannot be split; all of it per sample
        out.update(loop_per_step_s=0.0, loop_per_sample_s=loop_s / samples)
        sources["loop"] = f"one batch size only ({samples} samples): {loop_s:.4f} s per step, all per sample"
        return out
    small_dir = run_dir.with_name(f"{run_dir.name}_small")
    small = in_run.measure(args.config, [*sets, *small_sets], small_dir, steps, warmup, args.run_timeout, log)
    small_cfg = common.load_config(args.config, [*sets, *small_sets])
    small_samples = small_cfg.algorithm.train_batch_groups * small_cfg.rollout.n
    small_loop = in_run.loop_overhead_s(small["steps"])
    per_step, per_sample = in_run.loop_split((small_samples, small_loop), (samples, loop_s))
    sources["loop"] = (f"{_now()}: the loop's median seconds per step outside the batch wait, the train call and "
                       f"the push call: {small_loop:.4f} at {small_samples} samples (a second run, "
                       f"{' '.join(small_sets)}; {small_dir}) and {loop_s:.4f} at {samples} (the run above): "
                       f"{per_step:.4f} s per step + {per_sample:.3e} s per sample (in_run.loop_split)")
    log(f"run: {sources['loop']}")
    return {**out, "loop_per_step_s": per_step, "loop_per_sample_s": per_sample,
            "small": {"cfg": small_cfg, **run_figures(small["steps"])}}


def smaller_batch(cfg) -> list[str]:
    """Overrides for the run phase's second run: a quarter of the batch (at least one group fewer), with as
    many optimizer updates per step where the mini-batch allows; [] for a batch of one group."""
    B, mini = cfg.algorithm.train_batch_groups, cfg.learner.mini_batch_groups
    small = min(B - 1, max(1, B // 4))
    if small < 1:
        return []
    updates = B // mini
    small_mini = small // updates if small % updates == 0 else small
    return [f"algorithm.train_batch_groups={small}", f"learner.mini_batch_groups={small_mini}"]


def run_figures(steps: list[dict]) -> dict:
    """What :func:`pause_part` and :func:`run_check` read from a run's steps after its warm-up."""
    return {"weight_load_s": statistics.fmean(r["perf/weight_load_s"] for r in steps),
            "occupancy": statistics.fmean(r["perf/rollout_occupancy"] for r in steps),
            "run_steps_per_s": (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"])}


def pause_per_seq(load_s: float, predicted_s: float, held: float) -> float:
    """push.engine_pause_per_seq_s: the run's engine seconds per update beyond what the model predicts
    without the term (the transfer, the idle engine's own load, the wait for the running iteration), per
    sequence the engine holds, running or queued (never below 0; 0 when it holds none)."""
    return max(0.0, load_s - predicted_s) / held if held > 0 else 0.0


def pause_part(profile, cfg, got: dict, sources: dict):
    """The profile with push.engine_pause_per_seq_s measured from the run phase's updates (inflight and abort
    pause the sequences the engine holds; drain holds none when it loads: kept)."""
    from async_dapo.planning import Shape, predict

    shape = Shape.from_config(cfg)
    if shape.update_mode == "drain":
        sources["pause_per_seq"] = ("not measured: the run drains before its loads (no sequence is paused); "
                                    f"kept {profile.push.engine_pause_per_seq_s:.3e}")
        return profile
    without = profile.model_copy(update={"push": profile.push.model_copy(update={"engine_pause_per_seq_s": 0.0})})
    pred = predict(without, shape, steps=30, warmup=6, sync_baseline=False)  # a --base profile may carry one
    # rollout/occupancy counts the engine's request table: running and queued, mean per engine
    held = got["occupancy"] * shape.max_inflight_prompts * shape.G
    per_seq = pause_per_seq(got["weight_load_s"], pred.weight_load_s, held)
    sources["pause_per_seq"] = (f"{_now()}: the run phase's engine seconds per update (perf/weight_load_s) "
                                f"{got['weight_load_s']:.4f} minus the model's {pred.weight_load_s:.4f} without "
                                f"the term, / {held:.0f} sequences held, running or queued (occupancy "
                                f"{got['occupancy']:.3f} x {shape.max_inflight_prompts} x {shape.G}) = {per_seq:.3e}")
    push = profile.push.model_copy(update={"engine_pause_per_seq_s": per_seq})
    return profile.model_copy(update={"push": push})


def run_check(profile, cfg, got: dict, sources: dict, key: str = "run_check", which: str = "run") -> None:
    """A run of the run phase predicted with the finished profile, beside what it measured (not fitted)."""
    from async_dapo.planning import Shape, predict

    pred = predict(profile, Shape.from_config(cfg), steps=30, warmup=6, sync_baseline=False)
    sources[key] = (f"{_now()}: the run phase's {which}, measured / predicted with this profile: steps/s "
                    f"{got['run_steps_per_s']:.3f} / {pred.steps_per_s:.3f}, engine seconds per update "
                    f"(perf/weight_load_s) {got['weight_load_s']:.4f} / {pred.weight_load_s:.4f}")


# ------------------------------------------------------------------------------------------ main
def engine_costs(got: dict, base: dict | None) -> dict:
    """The engine's per_group_s and per_sample_s: phase b's, else the base profile's, else 0."""
    if "per_group_s" in got:
        return {"per_group_s": got["per_group_s"], "per_sample_s": got["per_sample_s"]}
    e = base["engine"] if base else {}
    return {"per_group_s": e.get("per_group_s", 0.0), "per_sample_s": e.get("per_sample_s", 0.0)}


def split_as_base(got: dict, base: dict, n: int, sources: dict, where) -> None:
    """Without the engine phase (no bare rates at several group sizes): phase b's cost per group split
    between per group and per sample as the base profile's is, for a group of n."""
    e = base["engine"]
    total = e["per_group_s"] + e.get("per_sample_s", 0.0) * n
    share = e.get("per_sample_s", 0.0) * n / total if total > 0 else 0.0
    resid = got["per_group_s"] + got["per_sample_s"] * n
    got["per_group_s"], got["per_sample_s"] = (1 - share) * resid, share * resid / n
    sources["per_sample_s"] = (f"phase b's cost per group split as {where}'s is for a group of {n}: "
                               f"{100 * share:.0f} % per sample")


def param_bytes(cfg) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from async_dapo.device import engine_dtype, resolve_device

    dtype = getattr(torch, engine_dtype(resolve_device(cfg.rollout.engine.device), cfg.rollout.engine.dtype))
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    return float(sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size())


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the config's model.path)")
    ap.add_argument("--out", type=Path, required=True, help="profile YAML to write")
    ap.add_argument("--name", default=None, help="profile name (default: the --out file's stem)")
    ap.add_argument("--quick", action="store_true", help="CI-size: fewer engine points, 1 + 2 batches, 2 pushes")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--base", type=Path, default=None, help="profile giving the figures of skipped phases")
    ap.add_argument("--run-timeout", type=float, default=1800,
                    help="seconds the generation phase, and the run phase, may take")
    args = ap.parse_args()
    import yaml

    started = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - started:6.1f} s] {msg}", flush=True)  # noqa: E731
    sets = ["logging.val_every_steps=0", "checkpoint.every_steps=0", "checkpoint.export_hf=false"]
    if args.model is not None:
        sets += [f"model.path={args.model.resolve()}", "model.bootstrap=null"]
    cfg = common.load_model(args, sets)  # the model ready, by its absolute path
    role_cfg = common.load(args, [*sets, f"model.path={cfg.model.path}", "model.bootstrap=null", *ROLE_SETS])
    phases = set(args.phases)
    base = None
    if args.base is not None:
        from async_dapo.planning import load_profile

        base = load_profile(args.base).model_dump()
    elif phases & {"engine", "actor", "learner"} != {"engine", "actor", "learner"}:
        raise SystemExit("--phases without engine, actor or learner needs --base PROFILE (their figures)")
    command = "python tools/bench/calibrate.py " + " ".join(sys.argv[1:])
    sources = {"command": f"{_now()}: {command}"}

    engine, records, bare = None, None, None
    if "engine" in phases:
        engine, src, _, records, bare = engine_curve(cfg, args.quick, log)
        sources.update(src)
    elif base is not None:
        engine = {k: v for k, v in base["engine"].items() if k not in ("per_group_s", "per_sample_s", "devices")}
    from async_dapo.device import resolve_device

    pair_cfg = None
    if "pair" in phases and resolve_device(cfg.rollout.engine.device) == "cpu":
        pair_cfg = common.load(args, [*sets, f"model.path={cfg.model.path}", "model.bootstrap=null", *ROLE_SETS,
                                      *pair_sets(cfg)])
    got = roles(role_cfg, phases, args.quick, args.run_timeout, engine, log, records, bare, pair_cfg)
    sources.update(got["sources"])
    if bare is None and base is not None and "per_group_s" in got:
        split_as_base(got, base, cfg.rollout.n, sources, args.base)
    if "ranks" in phases:
        got["learner"] = learner_against_ranks(cfg, got, args.quick, sources, log)

    if "run" in phases:
        got = {**got, **run_phase(args, cfg, sources, log)}

    def pick(part: str, measured, neutral=None):
        if measured is not None:
            return measured
        if base is not None:
            sources.setdefault(part, f"from {args.base}")
            return base[part]
        sources.setdefault(part, "not measured (phase skipped): neutral value")
        return neutral

    nbytes = param_bytes(cfg)
    prof = {
        "name": args.name or args.out.stem,
        "hardware": f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
                    f"engine device {cfg.rollout.engine.device}, {cfg.placement.num_engines} engine(s) x "
                    f"{cfg.placement.engine_cpus} CPU, {cfg.placement.learner_ranks} learner rank(s) x "
                    f"{cfg.placement.learner_cpus} CPU; model {cfg.model.path}",
        "sources": sources,
        "engine": {**(engine or {}), **engine_costs(got, base)},
        "learner": pick("learner", got.get("learner")),
        "push": pick("push", got.get("push"), {"base_s": 0.0, "bytes": nbytes, "bandwidth_bytes_per_s": 1e12,
                                               "engine_pause_s": 0.0, "learner_stall_s": 0.0}),
        "contention": {**pick("contention", got.get("contention"), {"engine_slowdown": 1.0, "learner_slowdown": 1.0}),
                       **got.get("sharing", {})},
        "workload": pick("workload", got.get("workload")),
    }
    if "pair_ratio" in got and prof["contention"].get("cores"):
        c = prof["contention"]
        c["cores"], sources["cores"] = effective_cores(got["pair_ratio"], c.get("background_cores", 0.0), c["cores"])
    if "loop_per_sample_s" in got:
        prof["learner"] = {**prof["learner"], "loop_per_step_s": got["loop_per_step_s"],
                           "loop_per_sample_s": got["loop_per_sample_s"]}
    if "learner_stall_s" in got and prof["push"] is not None:  # the push call in a run, not with idle engines
        prof["push"] = {**prof["push"], "learner_stall_s": got["learner_stall_s"]}
    if "per_group_s" not in got:
        for key in ("per_group_s", "per_sample_s"):
            sources.setdefault(key, f"from {args.base}" if base else "not measured: 0")
    if got.get("push") is not None:
        sources["push_bytes"] = f"parameter bytes in the engine dtype: {nbytes:.0f}; pushed bytes {prof['push']['bytes']:.0f}"
    from async_dapo.planning import predict, profile_from_dict, Shape
    from async_dapo.planning.workload import keep_rate

    profile = profile_from_dict(prof, str(args.out))  # validate before writing
    if "weight_load_s" in got:
        profile = pause_part(profile, cfg, got, sources)
        run_check(profile, cfg, got, sources)
        if "small" in got:
            run_check(profile, got["small"]["cfg"], got["small"], sources, "run_check_small", "second run")
        profile = profile.model_copy(update={"sources": sources})
    for part in ("engine", "learner", "push", "contention"):
        for k, v in getattr(profile, part).model_dump().items():
            if v is not None:  # contention.cores: None when the roles do not share cores
                _finite(float(v))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    class Dumper(yaml.SafeDumper):  # lists (the response lengths) on one line
        pass

    Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    text = yaml.dump(profile.model_dump(), Dumper=Dumper, sort_keys=False, width=120)
    how = "roles alone, then a run" if "run" in phases else "roles alone"
    args.out.write_text(f"# Planner profile measured by {command} on {_now()} ({how}).\n" + text)
    shown = profile.model_dump()
    lengths = profile.workload.all_lengths()
    for key in ("response_lengths", "prompts"):
        if shown["workload"].get(key):
            shown["workload"][key] = f"[{len(shown['workload'][key])} entries, mean length {statistics.mean(lengths):.2f}]"
    print(yaml.safe_dump(shown, sort_keys=False, width=120), flush=True)
    pred = predict(profile, Shape.from_config(cfg), steps=20, warmup=4)
    e, lr = profile.engine, profile.learner
    print(f"calibrated {args.out} in {time.perf_counter() - started:.0f} s: decode a {e.decode_base_s:.2e} "
          f"b {e.decode_per_seq_s:.2e} c {e.decode_per_ctx_token_s:.2e} s, prefill {e.prefill_per_token_s:.2e} s/token, "
          f"per_group {e.per_group_s:.4f} s, per_sample {e.per_sample_s:.5f} s, cores {profile.contention.cores}, "
          f"learner {lr.step_base_s:.3f} + {lr.per_token_s:.2e} s/token, push "
          f"{profile.push.base_s:.3f} s, slowdowns {profile.contention.engine_slowdown:.2f}/"
          f"{profile.contention.learner_slowdown:.2f}, keep {keep_rate(profile.workload, cfg.rollout.n):.2f}; config's plan: "
          f"{pred.steps_per_s:.3f} steps/s (speedup {pred.speedup:.2f})", flush=True)


if __name__ == "__main__":
    main()
