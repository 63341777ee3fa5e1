"""Throughput of the real system (Ray, SGLang, zmq, FSDP2) in each overlap mode, and of its two roles alone,
measured side by side in one invocation.

    python tools/bench/throughput.py [--preset default balanced] [--quick] [--steps 60 --warmup 10]

Modes: synchronous (eta = 0), one-step overlap (eta = 1), asynchronous eta = 2 and 4. Each is a normal
``async-dapo train`` run of ``--steps`` steps (no validation, no checkpoint) on the same model, placement and
config; only ``replay.max_staleness`` changes, with ``rollout.max_inflight_prompts`` and
``replay.capacity_groups`` set to (eta + 1) x B so that admission, not a cap, bounds each mode. Steady state:
the first ``--warmup`` steps are discarded (first-call overheads, the queue filling up).

Roles alone, in the same invocation, with the same placement (one Ray instance, engines and learners placed
as a run places them):
* g = seconds to generate one batch of B mixed groups with no learner running, per mode: the engines
  generate into the replay queue with the mode's (eta + 1) x B prompts in flight (admission never binds,
  dynamic sampling on) and nobody trains; g = elapsed time / batches over ``--steps - 2 x --warmup`` batches
  after ``--warmup`` batches (the mode's concurrency matters: sync has only B prompts in flight);
* t = seconds to train one batch with no generation running: on sync's g placement, once its engines are
  shut down, the batches of that g phase are replayed into its learner ranks (the measured runs record
  nothing: recording would slow them).

Per mode: steps/s, samples/s (B x G per step), generated tokens/s (engine counters), trained tokens/s
(response tokens per step / step time), learner and rollout idle ratios, mean/max staleness, weight-push
seconds (the sender's) and the learner's stall per push (loop time in the push call / pushes), speedup over
sync, the ideal speedup (g_sync + t) / max(g, t) and the overlap efficiency = steps/s x max(g, t) (1.0 = the
slower role never waits), g being the mode's own. Rates and ratios are time-weighted over the steady-state
steps (sum over steps, not a mean of per-step ratios). Writes OUT/<preset>/throughput.{md,csv,png}; prints
the tables.

Per mode also: its ``update_mode`` (rollout.update_mode), ``occupancy`` (time-weighted
``perf/rollout_occupancy``: running sequences / (max_inflight_prompts x n)) and ``tail_share`` (time-weighted
``perf/rollout_tail_ratio``: share of time the engine runs some but fewer than half of them). The CSV's
mode, eta, update_mode, batch_order (replay.batch_order resolved) and measured columns are what
``async-dapo plan --validate TABLE.csv`` reads.

Presets: ``default`` is configs/tiny_cpu.yaml as shipped (generation-bound on 2 cores); ``balanced`` makes the
learner step heavier (``learner.epochs=2``: each batch is trained twice) so that g and t are close and the
overlap gain is visible. ``longtail`` is configs/longtail_cpu.yaml with models/longtail_cpu (its own config
and model, not --config/--model): sync plus eta 1, 2, 4 x update mode inflight, drain, abort (``eta2-drain``);
g is measured per eta, not per update mode (nothing is updated with no learner); its ``--quick`` runs sync,
eta2-inflight and eta2-abort. ``--quick``: eta 0 and 2 only, B = 16, 6 steps (2 discarded): a CI-size smoke whose
numbers are not results.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
from common import (  # noqa: E402
    check_reusable, finished, load_config, parser, queue_rates, records, run_train, step_records, write_table,
)

MODES = {"sync": (0, "inflight"), "eta1": (1, "inflight"), "eta2": (2, "inflight"), "eta4": (4, "inflight")}
QUICK_MODES = {"sync": (0, "inflight"), "eta2": (2, "inflight")}
# longtail: every eta x update mode (the long tail is where the update modes differ)
LONGTAIL_MODES = {"sync": (0, "inflight")} | {f"eta{eta}-{mode}": (eta, mode) for eta in (1, 2, 4)
                                              for mode in ("inflight", "drain", "abort")}
LONGTAIL_QUICK = {"sync": (0, "inflight"), "eta2-inflight": (2, "inflight"), "eta2-abort": (2, "abort")}
# name -> (config (None: --config), model (None: --model), sets)
PRESETS = {
    "default": (None, None, []),
    "balanced": (None, None, ["learner.epochs=2"]),
    "longtail": ("configs/longtail_cpu.yaml", "models/longtail_cpu", []),
}
PRESET_MODES = {"longtail": (LONGTAIL_MODES, LONGTAIL_QUICK)}
QUICK = ["algorithm.train_batch_groups=16", "learner.mini_batch_groups=8"]
COMMON = ["logging.val_every_steps=0", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
          "model.bootstrap=null"]
COLUMNS = ["mode", "eta", "update_mode", "batch_order", "steps_per_s", "samples_per_s", "gen_tokens_per_s",
           "trained_tokens_per_s", "learner_idle", "rollout_idle", "staleness_mean", "staleness_max", "push_s", "stall_per_push_s",
           "speedup", "ideal_speedup", "overlap_efficiency", "g_s", "t_s", "occupancy", "tail_share", "keep_rate",
           "received_acc"]
TEXT = ("mode", "eta", "update_mode", "batch_order")
FMT = {c: ".3f" for c in COLUMNS if c not in TEXT} | {"samples_per_s": ".1f", "gen_tokens_per_s": ".0f",
                                                                  "trained_tokens_per_s": ".0f"}


def mode_sets(cfg, eta: int, run_dir: Path, steps: int, update_mode: str = "inflight") -> list[str]:
    window = (eta + 1) * cfg.algorithm.train_batch_groups
    drain = []  # the config's rule: a drain must end before the learner's side of the push times out
    if update_mode == "drain" and cfg.rollout.drain_timeout_s >= cfg.weight_sync.timeout_s:
        drain = [f"rollout.drain_timeout_s={cfg.weight_sync.timeout_s / 2:g}"]
    return [*drain, f"replay.max_staleness={eta}", f"rollout.update_mode={update_mode}", f"rollout.max_inflight_prompts={window}",
            f"replay.capacity_groups={max(window, cfg.replay.capacity_groups)}", f"learner.total_steps={steps}",
            f"logging.run_dir={run_dir}"]


def summarize(run_dir: Path, cfg, warmup: int) -> dict:
    """Steady-state figures of one mode's run (the steps after ``warmup``), time-weighted."""
    steps = step_records(records(run_dir))[warmup:]
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: fewer than 2 steps after the warm-up: raise --steps")
    per_s = (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"])  # step records are written as steps end
    groups, n = cfg.algorithm.train_batch_groups, cfg.rollout.n
    wall = sum(r["perf/time_per_step"] for r in steps)
    weighted = lambda key: sum(r[key] * r["perf/time_per_step"] for r in steps) / wall  # noqa: E731
    pushes = [r["perf/weight_push_stall_s"] for r in steps if r["step"] % cfg.weight_sync.every_k_steps == 0]
    rates = queue_rates(steps[0], steps[-1])  # keep: of the groups received, the share dynamic sampling kept
    return {"steps_per_s": per_s, "samples_per_s": per_s * groups * n, "gen_tokens_per_s": weighted("perf/gen_tokens_per_s"),
            "trained_tokens_per_s": per_s * groups * n * statistics.mean(r["response_length/mean"] for r in steps),
            "learner_idle": sum(r["perf/wait_data_s"] for r in steps) / wall,
            "rollout_idle": weighted("perf/rollout_idle_ratio"),
            "staleness_mean": statistics.mean(r["staleness/mean"] for r in steps),
            "staleness_max": max(r["staleness/max"] for r in steps),
            "push_s": statistics.mean(r["perf/weight_push_s"] for r in steps),
            "occupancy": weighted("perf/rollout_occupancy"), "tail_share": weighted("perf/rollout_tail_ratio"),
            "stall_per_push_s": statistics.mean(pushes), "keep_rate": rates["keep"], "received_acc": rates["acc"]}


def collect_batches(placed, warmup: int, count: int, timeout_s: float, what: str, mark=time.perf_counter):
    """Start the placed rollouts and take ``warmup + count`` batches from the replay queue (with nobody
    training); ``mark()`` is called when the warm-up batches are out, where the measured window starts.
    Returns (the batches, mark()'s value at the window's start)."""
    placed.start_rollouts()
    batches, start, deadline = [], mark(), time.monotonic() + timeout_s
    while len(batches) < warmup + count:
        got = placed.get(placed.replay.get_batch.remote(None, 5.0), "replay get_batch", 60)
        if got["batch"] is None:
            if got["problem"] or time.monotonic() > deadline:
                raise SystemExit(f"{what}: no batch ({got['problem'] or f'{timeout_s:.0f} s'})")
            continue
        batches.append(got["batch"])
        if len(batches) == warmup:
            start = mark()
    return batches, start


def generate_only(cfg, warmup: int, count: int, timeout_s: float, then_train: bool = False) -> tuple[float, float | None]:
    """(g, t): g is seconds per batch of B mixed groups with only the engines working (see the module doc).
    With ``then_train``, the same placement then measures t: its engines are shut down (nothing generates
    any more) and the learners, placed with them but never called until now, train on those batches, the
    first ``warmup`` discarded; else t is None. One placement for both saves a whole start of the stack.
    Each train_step is bounded by placement.call_timeout_s (Placed.on_learners)."""
    import ray

    from async_dapo.fleet.placement import place

    ray.init(address=cfg.placement.ray_address, include_dashboard=False, log_to_driver=False)
    placed = None
    try:
        placed = place(cfg)
        batches, t0 = collect_batches(placed, warmup, count, timeout_s, "generation-only phase")
        g = (time.perf_counter() - t0) / count
        if not then_train:
            return g, None
        placed.get([e.shutdown.remote() for e in placed.serving()], "engine shutdown before training alone",
                   cfg.placement.health_check_timeout_s)
        return g, train_only(placed, batches, warmup)
    finally:
        if placed is not None:
            placed.shutdown()
        ray.shutdown()


def train_only(placed, batches: list, warmup: int) -> float:
    """t: seconds per batch with only the learners working."""
    for i, batch in enumerate(batches):
        if i == warmup:
            t0 = time.perf_counter()
        placed.on_learners("train_step", batch)
    return (time.perf_counter() - t0) / (len(batches) - warmup)


def plot(rows: list[dict], g: float, t: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["mode"] for r in rows]
    ax1.bar(names, [r["steps_per_s"] for r in rows], color="tab:blue")
    ax1.plot(names, [1 / max(r["g_s"], t) for r in rows], "g_", ms=40, mew=2, label="1 / max(g, t): perfect overlap")
    ax1.axhline(1 / (g + t), color="tab:red", ls=":", label="1 / (g_sync + t): no overlap")
    ax1.set_ylabel("steps / s (steady state)")
    ax1.legend(fontsize=8)
    width = 0.4
    xs = range(len(rows))
    ax2.bar([x - width / 2 for x in xs], [r["learner_idle"] for r in rows], width, label="learner idle")
    ax2.bar([x + width / 2 for x in xs], [r["rollout_idle"] for r in rows], width, label="rollout idle")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("idle ratio")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def measure_roles(args, config, cfg, sets: list[str], modes: dict) -> tuple[dict[int, float], float]:
    """({eta: g}, t): each eta's generation alone at its own concurrency (one per eta, not per update mode:
    with no learner there is no update); the smallest eta's (the synchronous window, B in flight) then
    measures training alone on its own batches."""
    count = max(2, args.steps - 2 * args.warmup)
    g, t = {}, None
    etas = sorted({eta for eta, _ in modes.values()})
    for eta in etas:
        window = (eta + 1) * cfg.algorithm.train_batch_groups
        role_cfg = load_config(config, sets + ["replay.max_staleness=1000", "replay.capacity_groups=1000000",
                                                    f"rollout.max_inflight_prompts={window}"])
        g[eta], took = generate_only(role_cfg, args.warmup, count, args.run_timeout, then_train=eta == etas[0])
        t = t if took is None else took
    return g, t


def preset_paths(args, preset: str) -> tuple[str, Path]:
    """The preset's config and model: its own where it names them, else --config and --model."""
    config, model, _ = PRESETS[preset]
    model = Path(model) if model is not None else args.model
    if not (model / "config.json").exists():
        raise SystemExit(f"preset {preset}: no model at {model}; build it with `async-dapo bootstrap --config "
                         f"{config or args.config}`")
    return config or args.config, model


def bench_preset(args, preset: str) -> list[dict]:
    from async_dapo.config import resolved_batch_order

    out = args.out / preset
    config, model = preset_paths(args, preset)
    sets = [*COMMON, f"model.path={model.resolve()}", *PRESETS[preset][2], *(QUICK if args.quick else []),
            *args.overrides]
    cfg = load_config(config, sets)
    full, quick = PRESET_MODES.get(preset, (MODES, QUICK_MODES))
    modes = quick if args.quick else full
    rows = []
    for name, (eta, update_mode) in modes.items():
        run_dir = (out / name).resolve()
        run_sets = sets + mode_sets(cfg, eta, run_dir, args.steps, update_mode)
        if args.resume and finished(run_dir, args.steps):
            check_reusable(run_dir, config, run_sets)
        else:
            rc = run_train(config, run_sets, out / f"{name}.log", args.run_timeout)
            if rc != 0:
                raise SystemExit(f"{preset}/{name}: exit {rc} (see {out / f'{name}.log'})")
        run_cfg = load_config(config, run_sets)
        order = resolved_batch_order(run_cfg.replay.batch_order, update_mode, run_cfg.rollout.partial_rollout)
        rows.append({"mode": name, "eta": eta, "update_mode": update_mode, "batch_order": order,
                     **summarize(run_dir, cfg, args.warmup)})
        print(f"{preset}/{name}: {rows[-1]['steps_per_s']:.3f} steps/s", flush=True)
    g, t = measure_roles(args, config, cfg, sets, modes)
    sync = rows[0]["steps_per_s"]
    for r in rows:
        gm = g[r["eta"]]
        r.update(speedup=r["steps_per_s"] / sync, ideal_speedup=(g[rows[0]["eta"]] + t) / max(gm, t),
                 overlap_efficiency=r["steps_per_s"] * max(gm, t), g_s=gm, t_s=t)
    bad = [(r["mode"], c) for r in rows for c in COLUMNS if c not in TEXT and not math.isfinite(r[c])]
    if bad:
        raise SystemExit(f"non-finite figures: {bad}")
    head = (f"preset {preset}: B={cfg.algorithm.train_batch_groups} groups x G={cfg.rollout.n}, {args.steps} steps "
            f"per mode, first {args.warmup} discarded; g = " + ", ".join(
                f"{'sync' if k == 0 else f'eta{k}'} {v:.3f}" for k, v in g.items())
            + f" s; t = {t:.3f} s")
    table = write_table(rows, COLUMNS, out / "throughput.md", out / "throughput.csv", FMT)
    (out / "throughput.md").write_text(head + "\n\n" + table)
    plot(rows, g[rows[0]["eta"]], t, out / "throughput.png", head)
    print(f"\n{head}\n\n{table}", flush=True)
    return rows


def main() -> None:
    ap = parser(__file__, __doc__, config="configs/tiny_cpu.yaml")
    ap.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["default"])
    ap.add_argument("--quick", action="store_true", help="CI-size smoke: eta 0 and 2, B = 16, 6 steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode (default 60; quick 6)")
    ap.add_argument("--warmup", type=int, default=None, help="steps (and role batches) discarded (10; quick 2)")
    ap.add_argument("--model", type=Path, default=Path("models/tiny_cpu"),
                    help="the shipped warm start, or one built by `async-dapo bootstrap`")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_throughput"))
    ap.add_argument("--resume", action="store_true", help="reuse modes whose run finished earlier")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds one run (or role phase) may take")
    args = ap.parse_args()
    args.steps = args.steps or (6 if args.quick else 60)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    for preset in args.preset:
        preset_paths(args, preset)  # every preset's model is there before the first run starts
    for preset in args.preset:
        bench_preset(args, preset)


if __name__ == "__main__":
    main()
