"""The planner against published async-vs-sync speedups: each anchor of docs/results/planning_anchors.md is turned
into an async Shape and a sync Shape from its published *setup* (never from its published speedup), both are
predicted with the anchor's profile (async_dapo.planning.predict), and the predicted speedup is compared with
the published one.

    python tools/study/plan_anchors.py [--quick] [--no-sweep] [--anchor verl-128 ...] [--steps 60 --warmup 10]

Anchors (``--list`` prints them): verl fully_async Qwen2.5-Math-7B DAPO on H20 at 128 (64:64), 64 (32:32) and
32 (16:16) GPUs against verl's colocated sync on the same GPUs; AReaL v0.3 R1-Distill-Qwen-1.5B on 128 H800
(96:32) against a colocated sync and against η = 0 on the same 96:32 split.

Unit of comparison: trained prompts per second (= samples/s / G). verl's async step trains 128 prompts and
its sync step 512; the published speedups are total-time ratios for the same 512 × 400 prompts, so the
prompt rate (equivalently seconds per 512 prompts) is what matches them. AReaL trains 512 prompts per step in
both runs and reports hours for the same 1,000 steps, so there the prompt rate equals the step rate ratio.

How each anchor is modelled (the choices are the script's, stated in docs/results/planning_validation.md "The anchors";
the learner's per-update, per-micro-batch and FSDP collective costs are the profiles', each with its source):
* verl async: B = 128 (require_batches 4 × ppo_mini_batch 32), G = 16, every_k_steps = 4
  (trigger_parameter_sync_step), η = (1 + staleness_threshold) · k − 1 = 5 learner steps, so that the
  admission window holds (1 + 0.5) · 512 prompts per version, update mode inflight (partial rollout:
  interrupt, push, resume; the planner re-prefills the resumed contexts), E = rollout GPUs / TP4,
  R = train GPUs, 4 optimizer updates (mini-batches of 32 prompts) over micro-batches of 61,440 tokens per
  rank (use_dynamic_bsz), no log-prob recompute (use_rollout_log_probs).
* verl sync (colocated): B = 512, η = 0, k = 1, E = all GPUs / 4, R = all GPUs, 16 updates,
  learner per_token_s × 4/3 (the old_log_prob forward; ASSUMPTION forward = 1/3 of fwd+bwd), and the
  phase switch as the push: base_s = engine_pause_s = SWITCH (5 s, ASSUMPTION), bytes 0, no learner stall.
* AReaL async: B = 512, G = 16, η = 4, k = 1, inflight (interrupt + KV recompute), E = 96 (TP1), R = 32,
  4 updates (ppo_n_minibatches), per_token_s × 4/3 (recompute_logprob), per-engine cap
  ⌈512 / 96⌉ = 6 prompts (max_concurrent_rollouts 512). Sync colocated: E = R = 128, SWITCH 3 s (ASSUMPTION);
  sync η = 0: the async shape at η = 0 with the profile's push.

``--sweep`` (default on; off with ``--no-sweep``) moves one assumption at a time for every anchor whose
prediction misses ±20 % and prints how the speedup moves: the response-length median (×0.5, ×2; the
profile's max_running_seqs and the attention part of per_token_s are rescaled with it), the sync switch cost,
re-prefill after an inflight update (the planner has no keep-KV switch: "no re-prefill" is approximated by
prefill_per_token_s = 0 on the async run, which also drops the 150-token prompt prefill, a few ms per group),
drain instead of inflight, keep_rate 0.5, the MFU (per_token_s × 1/1.5 and × 1.5), the decode cost
(decode_base_s × 3; a, b, c × 2; decode × 2 with MFU × 1.5), a longer tail (lognormal σ + 0.3), and for
AReaL the concurrency cap. The main table simulates async 60/10 steps and sync 20/3 (every sync step is
alike: nothing carries over at η = 0); the sweep uses the quick steps. ``--quick``: async 32/6 and sync
10/2 everywhere (the speedups move by about 1 %). The whole default run takes about 2 minutes on one core.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

if TYPE_CHECKING:  # the planner (numpy, pydantic) is imported when a plan runs, not for --help
    from async_dapo.planning import Profile, Shape

REPO = common.REPO
VERL_PROFILE = REPO / "configs/profiles/verl_fully_async_7b_h20.yaml"
AREAL_PROFILE = REPO / "configs/profiles/areal_v03_r1distill1.5b_h800.yaml"

# Model shapes (from the profiles' model_shape sources) for rescaling with the response length:
# per_token_s ∝ 6P + 6·layers·hidden·L_eff, max_running_seqs ∝ 1 / (prompt + L_eff / 2).
MODELS = {"7b": {"P": 7.62e9, "layers": 28, "hidden": 3584, "max_num_seqs": 1024},
          "1.5b": {"P": 1.78e9, "layers": 28, "hidden": 1536, "max_num_seqs": 10 ** 6}}

# Published speedups, quoted from docs/results/planning_anchors.md: compared with, never fed to the planner.
# point = the first column (100 steps for verl); band = min..max over the published columns.
PUBLISHED = {
    "verl-128": {"point": 2.67, "band": (2.35, 2.67), "quote": "2.67 / 2.65 / 2.67 / 2.35x at 100-400 steps"},
    "verl-64": {"point": 2.09, "band": (1.83, 2.09), "quote": "2.09 / 2.03 / 1.83 / 1.92x at 100-400 steps"},
    "verl-32": {"point": 1.72, "band": (1.70, 2.66), "quote": "1.72 / 1.70 / 2.31 / 2.66x at 100-400 steps"},
    "areal-1.5b-colocated": {"point": 2.77, "band": (2.77, 2.77), "quote": "41.0 h / 14.8 h = 2.77x"},
    "areal-1.5b-eta0": {"point": 2.77, "band": (2.77, 2.77), "quote": "41.0 h / 14.8 h = 2.77x"},
}
TOL = 0.20


@dataclass(frozen=True)
class Anchor:
    name: str
    setup: str  # one line: what the source ran
    profile: Path
    model: str
    gpus: int
    family: str  # verl | areal
    sync: str  # colocated | eta0


ANCHORS = [
    Anchor("verl-128", "verl fully_async 7B, 64:64 H20 vs colocated sync on 128", VERL_PROFILE, "7b", 128, "verl",
           "colocated"),
    Anchor("verl-64", "verl fully_async 7B, 32:32 H20 vs colocated sync on 64", VERL_PROFILE, "7b", 64, "verl",
           "colocated"),
    Anchor("verl-32", "verl fully_async 7B, 16:16 H20 vs colocated sync on 32", VERL_PROFILE, "7b", 32, "verl",
           "colocated"),
    Anchor("areal-1.5b-colocated", "AReaL v0.3 1.5B, 96:32 H800 vs colocated sync on 128", AREAL_PROFILE, "1.5b",
           128, "areal", "colocated"),
    Anchor("areal-1.5b-eta0", "AReaL v0.3 1.5B, 96:32 H800 vs eta=0 on the same 96:32", AREAL_PROFILE, "1.5b",
           128, "areal", "eta0"),
]
BASE = {"median_x": 1.0, "switch_s": None, "reprefill": True, "mode": "inflight", "keep_rate": None,
        "mfu_x": 1.0, "cap": True, "decode_a_x": 1.0, "decode_x": 1.0, "sigma_add": 0.0}


def tweak(p: Profile, **dotted) -> Profile:
    """A copy of ``p`` with ``part__field=value`` changes (``learner__step_base_s=2.0``)."""
    parts: dict[str, dict] = {}
    for key, value in dotted.items():
        part, name = key.split("__")
        parts.setdefault(part, {})[name] = value
    update = {}
    for part, fields in parts.items():
        if part == "lognormal":
            w = p.workload
            update["workload"] = w.model_copy(update={"lognormal": w.lognormal.model_copy(update=fields)})
        else:
            update[part] = getattr(p, part).model_copy(update=fields)
    return p.model_copy(update=update)


def rescale_length(p: Profile, model: str, x: float) -> Profile:
    """The profile with the lognormal median × x; KV-bounded concurrency and attention FLOPs follow."""
    if x == 1.0:
        return p
    m, ln, w = MODELS[model], p.workload.lognormal, p.workload
    l_eff = ln.median * math.exp(1.5 * ln.sigma ** 2)
    held, held2 = w.prompt_tokens + l_eff / 2, w.prompt_tokens + x * l_eff / 2
    flops = lambda le: 6 * m["P"] + 6 * m["layers"] * m["hidden"] * le  # noqa: E731
    seqs = max(1, min(m["max_num_seqs"], round(p.engine.max_running_seqs * held / held2)))
    return tweak(p, lognormal__median=ln.median * x, engine__max_running_seqs=seqs,
                 learner__per_token_s=p.learner.per_token_s * flops(x * l_eff) / flops(l_eff))


def build(a: Anchor, base: Profile, o: dict) -> tuple[Profile, Shape, Profile, Shape]:
    """(async profile, async shape, sync profile, sync shape) of anchor ``a`` under options ``o``."""
    from async_dapo.planning import Shape

    p = rescale_length(base, a.model, o["median_x"])
    p = tweak(p, learner__per_token_s=p.learner.per_token_s * o["mfu_x"])
    if o["keep_rate"] is not None:
        p = tweak(p, workload__keep_rate=o["keep_rate"])
    if o["sigma_add"]:  # a longer tail at the same median (concurrency and FLOPs not rescaled)
        p = tweak(p, lognormal__sigma=p.workload.lognormal.sigma + o["sigma_add"])
    e = p.engine
    p = tweak(p, engine__decode_base_s=e.decode_base_s * o["decode_a_x"] * o["decode_x"],
              engine__decode_per_seq_s=e.decode_per_seq_s * o["decode_x"],
              engine__decode_per_ctx_token_s=e.decode_per_ctx_token_s * o["decode_x"])
    maxlen = 28672 if a.family == "verl" else 31 * 1024
    if a.family == "verl":
        E, R = a.gpus // 2 // p.engine.devices, a.gpus // 2
        k, eta = 4, round((1 + 0.5) * 4) - 1
        ap = p
        # ppo_mini_batch 32 prompts per optimizer update; dynamic bsz: (2048 + 28672) x 2 tokens per rank
        ash = Shape(B=128, G=16, eta=eta, max_inflight_prompts=math.ceil((eta + 1) * 128 / E),
                    update_mode=o["mode"], max_response_length=maxlen, every_k_steps=k, num_engines=E,
                    learner_ranks=R, mini_batch_groups=32, micro_batch_tokens=61440)
        switch = 5.0 if o["switch_s"] is None else o["switch_s"]
        sp = tweak(p, learner__per_token_s=p.learner.per_token_s * 4 / 3,
                   push__base_s=switch, push__bytes=0.0, push__engine_pause_s=switch, push__learner_stall_s=0.0)
        Es = a.gpus // p.engine.devices
        ssh = Shape(B=512, G=16, eta=0, max_inflight_prompts=math.ceil(512 / Es), max_response_length=maxlen,
                    num_engines=Es, learner_ranks=a.gpus, mini_batch_groups=32, micro_batch_tokens=61440)
    else:
        E, R = a.gpus * 3 // 4, a.gpus // 4
        ap = tweak(p, learner__per_token_s=p.learner.per_token_s * 4 / 3)  # recompute_logprob
        cap = math.ceil(512 / E) if o["cap"] else math.ceil(5 * 512 / E)
        ash = Shape(B=512, G=16, eta=4, max_inflight_prompts=cap, update_mode=o["mode"],
                    max_response_length=maxlen, every_k_steps=1, num_engines=E, learner_ranks=R,
                    mini_batch_groups=512 // 4)  # ppo_n_minibatches 4
        if a.sync == "colocated":
            switch = 3.0 if o["switch_s"] is None else o["switch_s"]
            sp = tweak(ap, push__base_s=switch, push__bytes=0.0, push__engine_pause_s=switch,
                       push__learner_stall_s=0.0)
            ssh = Shape(B=512, G=16, eta=0, max_inflight_prompts=math.ceil(512 / a.gpus),
                        max_response_length=maxlen, num_engines=a.gpus, learner_ranks=a.gpus,
                        mini_batch_groups=512 // 4)
        else:
            sp, ssh = ap, ash.with_(eta=0, every_k_steps=1)
    if not o["reprefill"]:  # no keep-KV switch in the planner: approximate by free prefill on the async run
        ap = tweak(ap, engine__prefill_per_token_s=0.0)
    return ap, ash, sp, ssh


def shape_str(s: Shape) -> str:
    return f"E={s.num_engines} R={s.learner_ranks} B={s.B} G={s.G} η={s.eta} k={s.every_k_steps} {s.update_mode}"


def evaluate(a: Anchor, base: Profile, o: dict, steps: tuple[int, int, int, int]) -> dict:
    from async_dapo.planning import predict

    ap, ash, sp, ssh = build(a, base, o)
    pa = predict(ap, ash, steps[0], steps[1], sync_baseline=False)
    ps = predict(sp, ssh, steps[2], steps[3], sync_baseline=False)
    a_pps, s_pps = pa.samples_per_s / ash.G, ps.samples_per_s / ssh.G
    pub = PUBLISHED[a.name]
    speed = a_pps / s_pps
    err = speed / pub["point"] - 1
    return {"anchor": a.name, "async_shape": shape_str(ash), "sync_shape": shape_str(ssh),
            "async_steps_per_s": pa.steps_per_s, "sync_steps_per_s": ps.steps_per_s,
            "async_prompts_per_s": a_pps, "sync_prompts_per_s": s_pps,
            "async_s_per_512": 512 / a_pps, "sync_s_per_512": 512 / s_pps,
            "pred_speedup": speed, "published": pub["point"],
            "band": f"{pub['band'][0]:.2f}-{pub['band'][1]:.2f}", "error": f"{err:+.0%}",
            "within_20pct": abs(err) <= TOL,
            "err": err, "a_learner_idle": pa.learner_idle, "a_rollout_idle": pa.rollout_idle,
            "a_staleness": pa.staleness_mean, "s_learner_idle": ps.learner_idle}


def sweep_variants(a: Anchor) -> list[tuple[str, dict]]:
    out = [("median x0.5", {"median_x": 0.5}), ("median x2", {"median_x": 2.0}),
           ("sync switch 0 s", {"switch_s": 0.0}), ("sync switch 10 s", {"switch_s": 10.0}),
           ("sync switch 20 s", {"switch_s": 20.0}),
           ("no re-prefill after update (approx.)", {"reprefill": False}),
           ("drain instead of inflight", {"mode": "drain"}), ("keep_rate 0.5", {"keep_rate": 0.5}),
           ("MFU x1.5 (per_token_s / 1.5)", {"mfu_x": 1 / 1.5}), ("MFU x0.67 (per_token_s x 1.5)", {"mfu_x": 1.5}),
           ("decode_base_s x3 (host/all-reduce overhead)", {"decode_a_x": 3.0}),
           ("decode a, b, c x2", {"decode_x": 2.0}), ("lognormal sigma +0.3 (longer tail)", {"sigma_add": 0.3}),
           ("decode x2 and MFU x1.5 together", {"decode_x": 2.0, "mfu_x": 1 / 1.5})]
    if a.sync == "eta0":
        out = [v for v in out if "switch" not in v[0]]
    if a.family == "areal":
        out.append(("no concurrency cap (max_concurrent_rollouts off)", {"cap": False}))
    return out


def main() -> None:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true", help="fewer simulated steps (async 32/6, sync 10/2)")
    ap.add_argument("--steps", type=int, default=None, help="async steps simulated (default 60; sync: a third)")
    ap.add_argument("--warmup", type=int, default=None, help="async warm-up steps (default 10)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the sensitivity sweep")
    ap.add_argument("--sweep-all", action="store_true", help="sweep every anchor, not only the misses")
    ap.add_argument("--anchor", action="append", default=None, help="anchor name (repeatable; default all)")
    ap.add_argument("--list", action="store_true", help="print the anchors and exit")
    args = ap.parse_args()
    from async_dapo.planning import load_profile, markdown

    if args.list:
        for a in ANCHORS:
            print(f"{a.name}: {a.setup} (published {PUBLISHED[a.name]['quote']})")
        return
    # A sync step trains 4x the prompts of a verl async step and every sync step is alike (no carry-over at
    # η = 0), so a third of the async steps suffices for it.
    st, wu = (32, 6) if args.quick else (60, 10)
    st, wu = args.steps or st, args.warmup if args.warmup is not None else wu
    steps = (st, wu, max(8, st // 3), max(2, wu // 3))
    sweep_steps = (32, 6, 10, 2) if st > 32 else steps  # the sweep compares variants: the quick steps suffice
    chosen = [a for a in ANCHORS if args.anchor is None or a.name in args.anchor]
    profiles = {p: load_profile(p) for p in {a.profile for a in chosen}}
    t0 = time.perf_counter()
    rows = [evaluate(a, profiles[a.profile], BASE, steps) for a in chosen]
    print(f"## anchors: predicted vs published speedup (prompts/s ratio; async {steps[0]}/{steps[1]} steps, "
          f"sync {steps[2]}/{steps[3]}; {time.perf_counter() - t0:.0f} s)\n")
    print(markdown(rows, ["anchor", "async_shape", "sync_shape", "async_steps_per_s", "sync_steps_per_s",
                          "async_prompts_per_s", "sync_prompts_per_s", "async_s_per_512", "sync_s_per_512",
                          "pred_speedup", "published", "band", "error", "within_20pct"],
                   {"async_steps_per_s": ".4f", "sync_steps_per_s": ".5f", "async_prompts_per_s": ".3f",
                    "sync_prompts_per_s": ".3f", "async_s_per_512": ".0f", "sync_s_per_512": ".0f",
                    "pred_speedup": ".2f", "published": ".2f"}))
    print("\n## diagnostics (async learner idle, rollout idle, mean staleness; sync learner idle)\n")
    print(markdown(rows, ["anchor", "a_learner_idle", "a_rollout_idle", "a_staleness", "s_learner_idle"],
                   {k: ".2f" for k in ("a_learner_idle", "a_rollout_idle", "a_staleness", "s_learner_idle")}))
    if not args.sweep:
        return
    for a, row in zip(chosen, rows):
        if row["within_20pct"] and not args.sweep_all:
            continue
        t1 = time.perf_counter()
        out = []
        for label, change in [("as modelled", {}), *sweep_variants(a)]:
            r = evaluate(a, profiles[a.profile], {**BASE, **change}, sweep_steps)
            out.append({"variant": label, "pred_speedup": r["pred_speedup"], "error": r["error"],
                        "async_prompts_per_s": r["async_prompts_per_s"], "sync_prompts_per_s": r["sync_prompts_per_s"]})
        print(f"\n## sweep: {a.name} (published {PUBLISHED[a.name]['point']:.2f}x; async {sweep_steps[0]}/"
              f"{sweep_steps[1]} steps, sync {sweep_steps[2]}/{sweep_steps[3]}; {time.perf_counter() - t1:.0f} s)\n")
        print(markdown(out, ["variant", "async_prompts_per_s", "sync_prompts_per_s", "pred_speedup", "error"],
                       {"async_prompts_per_s": ".3f", "sync_prompts_per_s": ".3f", "pred_speedup": ".2f"}))


if __name__ == "__main__":
    main()
