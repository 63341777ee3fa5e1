"""One CPU rollout actor (Ray + SGLang + scoring + zmq + replay queue) versus the bare SGLang engine on
the same prompts, both continuously batched, measured in one run; then the weight-update time of the actor.

    python tools/bench/rollout.py --config configs/tiny_cpu.yaml [--groups 32 --repeats 3 --window 10 --pushes 5]

Both generation phases keep exactly ``--groups`` prompts in flight, each prompt being one batch request of
G = rollout.n (``input_ids``, the actor's sampling parameters, token logprobs on), and start the next
prompt as soon as a group's G samples are done. Both draw prompts in the order the replay queue's cursor
hands them out (``PromptCursor`` over ``train_rows(cfg)`` with ``data.shuffle_seed``, prompts encoded with
``encode_prompt`` and cut to ``data.max_prompt_length`` as the actor does). Both warm up until ``--groups``
groups have completed (every in-flight slot turned over once, first-call overheads out), then count the
groups and generated tokens completed inside ``--repeats`` windows of ``--window`` seconds each.

Phase 1 (bare): the in-process ``sglang.Engine`` driven by an asyncio loop on the engine's own event loop
(``engine.async_generate``), nothing else: no scoring, no zmq, no queue, no Ray.
Phase 2 (actor): a rollout actor and a replay queue (dynamic sampling off and a large eta, so every group
counts and admission never binds; ``rollout.max_inflight_prompts`` = ``--groups``); the actor admits
prompts, samples, scores, and sends each group over zmq, and the queue is drained between windows.
Phase 3: pushes the current weights ``--pushes`` times over gloo while the actor keeps generating
(inflight mode).

Prints one JSON line. The ratios actor/bare (groups/s and tokens/s) measure the actor's overhead over
the bare engine at equal concurrency and batching style (1.0 = none); they are the comparable numbers on
a noisy machine, the absolute rates are not.
"""

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402


def prompt_stream(cfg, tok):
    """Prompt token ids in the replay queue's order (its cursor over train_rows), each cut as the actor
    cuts it (``rollout.fit_prompt``)."""
    from async_dapo.data.rows import PromptCursor, encode_prompt, train_rows
    from async_dapo.rollout.actor import fit_prompt

    rows = train_rows(cfg)
    cursor = PromptCursor(len(rows), seed=cfg.data.shuffle_seed)
    cache = {}
    while True:
        (_, i), = cursor.take(1)
        if i not in cache:
            cache[i] = fit_prompt(cfg, encode_prompt(tok, rows[i]), i)
        yield cache[i]


async def bare_loop(engine, prompts, n, params, inflight, warmup_groups, repeats, window_s):
    """Keep ``inflight`` groups of ``n`` requests running; after ``warmup_groups`` completed groups, count
    (groups, tokens) completed in each of ``repeats`` windows of ``window_s`` seconds."""
    done = {"groups": 0, "tokens": 0}
    warm = asyncio.Event()

    async def group(prompt):
        # One batch request of n, as the actor sends a group (async_dapo.rollout.actor.EngineSession.sample_n).
        outs = await engine.async_generate(input_ids=[list(prompt)] * n, sampling_params=dict(params),
                                           return_logprob=True)
        done["groups"] += 1
        done["tokens"] += sum(len(o["output_ids"]) for o in outs)
        if done["groups"] >= warmup_groups:
            warm.set()

    running: set[asyncio.Task] = set()

    async def feed():
        while True:
            while len(running) < inflight:
                task = asyncio.ensure_future(group(next(prompts)))
                running.add(task)
                task.add_done_callback(running.discard)
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # an engine error ends the benchmark

    feeder = asyncio.ensure_future(feed())
    warmed = asyncio.ensure_future(warm.wait())
    try:
        await asyncio.wait({feeder, warmed}, timeout=600, return_when=asyncio.FIRST_COMPLETED)
        if not (feeder.done() or warmed.done()):
            raise TimeoutError(f"bare engine: {warmup_groups} warm-up groups not done in 600 s")
        if feeder.done():
            feeder.result()
        runs = []
        for _ in range(repeats):
            g0, k0, t = done["groups"], done["tokens"], time.perf_counter()
            await asyncio.sleep(window_s)
            runs.append((time.perf_counter() - t, done["groups"] - g0, done["tokens"] - k0))
            if feeder.done():
                feeder.result()
        return runs
    finally:
        tasks = [feeder, warmed, *running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _bare(cfg, prompts, params, inflight, repeats, window_s):
    from async_dapo.rollout.engine import start_engine

    engine = start_engine(cfg.rollout.engine, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    try:
        # Engine.generate runs async_generate with engine.loop.run_until_complete: drive our loop the same way.
        return engine.loop.run_until_complete(
            bare_loop(engine, prompts, cfg.rollout.n, params, inflight, inflight, repeats, window_s))
    finally:
        engine.shutdown()


def _actor(cfg, inflight, repeats, pushes, window_s):
    import ray

    from async_dapo.replay.queue import replay_actor_class
    from async_dapo.rollout.actor import rollout_actor_class
    from async_dapo.weights.sync import broadcast_bucket, free_port, open_update_group, plan_buckets

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        queue = replay_actor_class(cfg).remote(cfg)
        actor = rollout_actor_class(cfg).remote(cfg, 0)
        ray.get(actor.get_stats.remote(), timeout=600)
        address, secret = ray.get([queue.address.remote(), queue.producer_secret.remote()], timeout=60)
        ray.get(actor.start.remote(queue, address, secret), timeout=120)
        # Warm-up as in the bare phase: until ``inflight`` groups have completed.
        deadline = time.monotonic() + 600
        while ray.get(actor.get_stats.remote(), timeout=60)["groups_sent"] < inflight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the actor sent fewer than {inflight} groups in 600 s")
            time.sleep(0.1)
        runs = []
        for _ in range(repeats):
            # Steady-state rate over a window: the actor streams continuously (it does not wait for a
            # batch to finish), so batch hand-out times would count groups generated earlier.
            before, t = ray.get(actor.get_stats.remote(), timeout=60), time.perf_counter()
            time.sleep(window_s)
            after, dt = ray.get(actor.get_stats.remote(), timeout=60), time.perf_counter() - t
            if after["failed_groups"] != before["failed_groups"]:
                raise RuntimeError(f"groups failed during the window: {after}")
            runs.append((dt, after["groups_sent"] - before["groups_sent"], after["gen_tokens"] - before["gen_tokens"]))
            ray.get(queue.get_batch.remote(None, 0.5), timeout=60)  # keep the queue from filling up
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
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--groups", type=int, default=32, help="prompts in flight in both phases")
    ap.add_argument("--repeats", type=int, default=3, help="measurement windows per phase")
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per measurement window (both phases)")
    args = ap.parse_args()
    k = args.groups
    cfg = common.load_model(args, [
        f"algorithm.train_batch_groups={k}", f"learner.mini_batch_groups={k}", "replay.max_staleness=100",
        f"replay.capacity_groups={101 * k}", "algorithm.dynamic_sampling.enable=false",
        f"rollout.max_inflight_prompts={k}",
    ])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    from async_dapo.rollout.actor import sampling_params

    r = cfg.rollout
    params = sampling_params(cfg)  # the actor's
    bare = _bare(cfg, prompt_stream(cfg, tok), params, k, args.repeats, args.window)
    actor, push, nbytes = _actor(cfg, k, args.repeats, args.pushes, args.window)

    def rates(runs):
        return (statistics.median(g / s for s, g, _ in runs), statistics.median(t / s for s, _, t in runs))

    bare_gps, bare_tps = rates(bare)
    act_gps, act_tps = rates(actor)
    print(json.dumps({
        "groups": k, "G": r.n, "bare_mode": "continuous", "inflight_prompts": k,
        "window_s": args.window, "repeats": args.repeats, "warmup_groups": k,
        "bare_groups_per_s": round(bare_gps, 2), "bare_tok_per_s": round(bare_tps),
        "actor_groups_per_s": round(act_gps, 2), "actor_tok_per_s": round(act_tps),
        "ratio_actor_over_bare_groups": round(act_gps / bare_gps, 3),
        "ratio_actor_over_bare_tokens": round(act_tps / bare_tps, 3),
        "weight_bytes": nbytes,
        "push_wall_s_median": round(statistics.median(w for w, _ in push), 4),
        "push_actor_s_median": round(statistics.median(a for _, a in push), 4),
    }))


if __name__ == "__main__":
    main()
