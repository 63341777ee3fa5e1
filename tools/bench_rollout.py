"""One CPU rollout actor (Ray + SGLang + scoring + zmq + replay queue) versus the bare SGLang engine on
the same prompts, measured in one run; then the weight-update time of the actor.

    python tools/bench_rollout.py --config configs/tiny_cpu.yaml [--groups 32 --repeats 3 --pushes 5]

Phase 1 samples ``--groups`` prompts x G with the in-process engine (one batched call, the
generate-a-batch-then-wait pattern). Phase 2 starts a rollout actor and a replay queue (dynamic sampling
off and a large eta, so every group counts and admission never binds; ``--groups`` prompts in flight)
and measures its steady-state rate over ``--window``-second windows. Phase 3 pushes the
current weights ``--pushes`` times over gloo while the actor keeps generating (inflight mode).
Prints one JSON line; the ratio actor/bare is the comparable number on a noisy machine.
"""

import argparse
import json
import statistics
import time


def _bare(cfg, prompts, params, repeats):
    from async_dapo.engine import sample_groups, start_engine

    engine = start_engine(cfg.rollout.engine, cfg.model.path)
    try:
        sample_groups(engine, prompts[:2], 1, params)  # first-call overheads out of the timing
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            groups = sample_groups(engine, prompts, cfg.rollout.n, params)
            runs.append((time.perf_counter() - t, len(groups), sum(len(s.output_ids) for g in groups for s in g)))
    finally:
        engine.shutdown()
    return runs


def _actor(cfg, repeats, pushes, window_s):
    import ray

    from async_dapo.replay_service import replay_actor_class
    from async_dapo.rollout import rollout_actor_class
    from async_dapo.weight_sync import broadcast_bucket, free_port, open_update_group, plan_buckets

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        queue = replay_actor_class(cfg).remote(cfg)
        actor = rollout_actor_class(cfg).remote(cfg, 0)
        ray.get(actor.get_stats.remote(), timeout=600)
        ray.get(actor.start.remote(queue, ray.get(queue.address.remote())))
        ray.get(queue.get_batch.remote())  # warm-up batch
        runs = []
        for _ in range(repeats):
            # Steady-state rate over a window: the actor streams continuously (it does not wait for a
            # batch to finish), so batch hand-out times would count groups generated earlier.
            before, t = ray.get(actor.get_stats.remote()), time.perf_counter()
            time.sleep(window_s)
            after, dt = ray.get(actor.get_stats.remote()), time.perf_counter() - t
            runs.append((dt, after["groups_sent"] - before["groups_sent"], after["gen_tokens"] - before["gen_tokens"]))
            ray.get(queue.get_batch.remote())  # keep the queue from filling up
        port = free_port()
        joined = actor.join_weight_group.remote("127.0.0.1", port, 2, 1, "bench", "gloo")
        pg = open_update_group("127.0.0.1", port, 2, "bench", "gloo", timeout_s=120)
        ray.get(joined)
        from transformers import AutoModelForCausalLM

        named = list(AutoModelForCausalLM.from_pretrained(cfg.model.path).named_parameters())
        named = [(n, p.detach()) for n, p in named]
        buckets = plan_buckets([(n, p.dtype, tuple(p.shape)) for n, p in named], cfg.weight_sync.bucket_mb << 20)
        push = []
        for v in range(1, pushes + 1):
            t = time.perf_counter()
            ref = actor.update_weights.remote(buckets, "bench", v, "inflight")
            for b in buckets:
                broadcast_bucket(pg, [dict(named)[n] for n in b.names])
            actor_s = ray.get(ref)
            push.append((time.perf_counter() - t, actor_s))
        nbytes = sum(p.numel() * p.element_size() for _, p in named)
        ray.get(actor.shutdown.remote())
        return runs, push, nbytes
    finally:
        ray.shutdown()


def main() -> None:
    from async_dapo.bootstrap import bootstrap, encode_prompt
    from async_dapo.config import load_config
    from async_dapo.data import train_rows
    from async_dapo.device import pin_threads

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per actor measurement window")
    args = ap.parse_args()
    k = args.groups
    cfg = load_config(args.config, args.overrides + [
        f"algorithm.train_batch_groups={k}", f"learner.mini_batch_groups={k}", "replay.max_staleness=100",
        f"replay.capacity_groups={101 * k}", "algorithm.dynamic_sampling.enable=false",
        f"rollout.max_inflight_prompts={k}",
    ])
    if cfg.model.bootstrap is not None:
        bootstrap(cfg)
    pin_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = [encode_prompt(tok, r) for r in train_rows(cfg)[:k]]
    r = cfg.rollout
    params = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_response_length}
    bare = _bare(cfg, prompts, params, args.repeats)
    actor, push, nbytes = _actor(cfg, args.repeats, args.pushes, args.window)

    def rates(runs):
        return (statistics.median(g / s for s, g, _ in runs), statistics.median(t / s for s, _, t in runs))

    bare_gps, bare_tps = rates(bare)
    act_gps, act_tps = rates(actor)
    print(json.dumps({
        "groups": k, "G": r.n, "bare_groups_per_s": round(bare_gps, 2), "bare_tok_per_s": round(bare_tps),
        "actor_groups_per_s": round(act_gps, 2), "actor_tok_per_s": round(act_tps),
        "ratio_actor_over_bare_groups": round(act_gps / bare_gps, 3),
        "ratio_actor_over_bare_tokens": round(act_tps / bare_tps, 3),
        "weight_bytes": nbytes,
        "push_wall_s_median": round(statistics.median(w for w, _ in push), 4),
        "push_actor_s_median": round(statistics.median(a for _, a in push), 4),
    }))


if __name__ == "__main__":
    main()
