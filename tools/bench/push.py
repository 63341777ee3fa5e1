"""Weight push from a learner rank to a real SGLang engine versus a raw gloo broadcast of the same bytes,
the learner's stall per push, and learner tokens/s, measured in one run.

    python tools/bench/push.py --config configs/tiny_cpu.yaml [--set a.b=c ...] [--size tiny|medium]
                               [--pushes 5] [--steps 5]

``--size tiny`` uses the configured (bootstrapped) tiny model. ``--size medium`` builds once, under
runs/bench_medium_model, a randomly initialised Qwen2 with the tiny model's tokenizer and a larger shape
(hidden 512, 8 layers, 8 heads, MLP 1536: ~25M parameters, ~100 MB fp32), big enough that bytes/second
means something; the tiny model's 1.5 MB push is all overhead.

One Ray session (2 CPUs): one rollout actor (real SGLang CPU engine) and one learner rank (world 1).
1. ``--steps`` training steps on synthetic groups (B groups x G samples as configured, real chat prompts,
   random responses of 8..max_response_length tokens): learner tokens/s = train_tokens / train_s (loss-
   bearing tokens), median over steps.
2. ``--pushes`` pushes: ``push_weights`` (its wall time is the learner's stall: the time before it could
   start its next step), then ``wait_push``, then ``last_push`` -> push_s (sender thread: flatten +
   broadcast + until the engine has loaded) and the engine's own seconds.
3. The same number of bytes as ONE flat uint8 buffer, broadcast ``--pushes`` times (after one warm-up)
   from this process (rank 0, ``weight_sync.open_update_group``) to a plain gloo rank 1 in a small Ray
   actor (no SGLang), timed at the sender like push_s; plus the time to flatten the model's parameters.
Prints one JSON line; ratio_push_over_raw = push GB/s / raw GB/s is the comparable number.
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

MEDIUM_DIR = Path("runs/bench_medium_model")
MEDIUM_SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
                "intermediate_size": 1536}
RAW_GROUP = "bench_push_raw"


def build_medium_model(tiny: Path, out: Path = MEDIUM_DIR) -> Path:
    """A randomly initialised Qwen2 of MEDIUM_SHAPE with the tiny model's tokenizer (cached in ``out``)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    marker = out / "bench_medium.json"
    spec = {"tokenizer_from": str(tiny.resolve()), "seed": 0, **MEDIUM_SHAPE}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    base = AutoConfig.from_pretrained(tiny)
    config = Qwen2Config(vocab_size=base.vocab_size, max_position_embeddings=base.max_position_embeddings,
                         rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=True, pad_token_id=base.pad_token_id,
                         bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, **MEDIUM_SHAPE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    marker.write_text(json.dumps(spec))  # last: a half-written directory is rebuilt next time
    return out


def synthetic_groups(cfg, tokenizer, vocab_size: int, seed: int, min_response: int = 8):
    """B groups x G samples: real chat-templated prompts, random response ids (< vocab_size) of
    min_response..max_response_length tokens (the longest ones truncated), half of each group correct."""
    import numpy as np

    from async_dapo.data.rows import encode_prompt
    from async_dapo.data.rows import train_rows
    from async_dapo.stream.wire import Group, Sample

    rng = np.random.default_rng(seed)
    max_len = cfg.rollout.max_response_length
    rows = train_rows(cfg)
    groups = []
    for i in range(cfg.algorithm.train_batch_groups):
        row = rows[int(rng.integers(len(rows)))]
        samples = []
        for j in range(cfg.rollout.n):
            length = int(rng.integers(min(min_response, max_len), max_len + 1))
            acc = bool(j % 2)
            samples.append(Sample(
                response_ids=rng.integers(3, vocab_size, size=length).astype(np.int32),
                logprobs=(-rng.random(length) * 3).astype(np.float32), versions=np.zeros(length, np.int32),
                reward=1.0 if acc else -1.0, score=1.0 if acc else -1.0, acc=acc, truncated=length == max_len,
                finish_reason="length" if length == max_len else "stop", gen_seconds=0.1))
        groups.append(Group(group_id=f"bench-{seed}-{i}", prompt_index=i, epoch=0, engine_rank=0,
                            prompt_ids=np.asarray(encode_prompt(tokenizer, row), np.int32),
                            ground_truth=row.ground_truth,
                            data_source=row.data_source, samples=tuple(samples), created_at=time.time(),
                            admitted_version=0))
    return groups


class GlooPeer:
    """Rank 1 of a plain gloo side group, built exactly like SGLang's side of the weight-update group
    (TCP rendezvous + PrefixStore(group_name) + torch's process-group helper), without SGLang."""

    def __init__(self) -> None:
        from async_dapo.device import pin_threads

        pin_threads(1)
        self.pg = None

    def join(self, addr: str, port: int, group_name: str, timeout_s: float) -> None:
        import datetime

        from torch.distributed.distributed_c10d import (
            Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
        )

        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(rendezvous(f"tcp://{addr}:{port}", 1, 2, timeout=timeout))
        store.set_timeout(timeout)
        self.pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), PrefixStore(group_name, store),
                                               group_name=group_name, backend_options=None, timeout=timeout)
        _world.pg_group_ranks[self.pg] = {i: i for i in range(world)}

    def receive(self, nbytes: int, times: int) -> list[int]:
        """Receive ``times`` broadcasts into one buffer; returns the last buffer's final bytes (a check)."""
        import torch
        import torch.distributed as dist

        buf = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(times):
            dist.broadcast(buf, src=0, group=self.pg)
        return buf[-8:].tolist()


def raw_gloo(ray, nbytes: int, repeats: int, timeout_s: float) -> list[float]:
    """Sender-side seconds of ``repeats`` broadcasts of one flat ``nbytes`` uint8 buffer, after a warm-up."""
    import torch
    import torch.distributed as dist

    from async_dapo.weights.sync import free_port, open_update_group

    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    peer = ray.remote(GlooPeer).options(num_cpus=0, runtime_env={"env_vars": env}).remote()
    try:
        port = free_port()
        joined = peer.join.remote("127.0.0.1", port, RAW_GROUP, timeout_s)
        pg = open_update_group("127.0.0.1", port, 2, RAW_GROUP, "gloo", timeout_s)
        ray.get(joined, timeout=timeout_s)
        buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        got = peer.receive.remote(nbytes, repeats + 1)
        seconds = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            dist.broadcast(buf, src=0, group=pg)
            seconds.append(time.perf_counter() - t)
        if ray.get(got, timeout=timeout_s) != buf[-8:].tolist():
            raise RuntimeError("raw gloo broadcast: the receiver got different bytes")
        return seconds[1:]
    finally:
        ray.kill(peer)


def flatten_seconds(model_path: Path, dtype: str, repeats: int) -> list[float]:
    """Time of weight_sync.flatten over the model's parameters (the sender's copy into a flat buffer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_dapo.weights.sync import flatten

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    params = [p.detach() for p in model.parameters()]
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        flatten(params)
        seconds.append(time.perf_counter() - t)
    return seconds


def run(cfg, steps: int, pushes: int) -> dict:
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from async_dapo.device import engine_dtype, resolve_device
    from async_dapo.learner.rank import learner_actor_class
    from async_dapo.rollout.actor import rollout_actor_class
    from async_dapo.weights.sync import WEIGHT_GROUP, free_port

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model_cfg = AutoConfig.from_pretrained(cfg.model.path)
    timeout = cfg.weight_sync.timeout_s
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = learner = None
    try:
        engine = rollout_actor_class(cfg).remote(cfg, 0)
        ray.get(engine.get_stats.remote(), timeout=600)  # the engine is up
        learner = learner_actor_class(cfg).remote(cfg, 0, 1, "127.0.0.1", free_port())

        train = [ray.get(learner.train_step.remote(synthetic_groups(cfg, tok, model_cfg.vocab_size, seed=s)),
                         timeout=timeout) for s in range(steps)]

        port = free_port()
        joined = engine.join_weight_group.remote("127.0.0.1", port, 2, 1, WEIGHT_GROUP, "gloo")
        ray.get(learner.open_weight_group.remote("127.0.0.1", port, 2, WEIGHT_GROUP), timeout=timeout)
        ray.get(joined, timeout=timeout)
        push = []
        for _ in range(pushes):
            started = ray.get(learner.push_weights.remote([engine], None), timeout=timeout)
            waited = ray.get(learner.wait_push.remote(), timeout=timeout)
            last = ray.get(learner.last_push.remote())
            if last.get("error"):
                raise RuntimeError(f"push failed: {last['error']}")
            push.append({**started, "wait_s": waited, **last})
        # As in a run: the push starts and the next training step runs while it is under way.
        overlap = []
        for s in range(pushes):
            started = ray.get(learner.push_weights.remote([engine], None), timeout=timeout)
            step = ray.get(learner.train_step.remote(synthetic_groups(cfg, tok, model_cfg.vocab_size, seed=100 + s)),
                           timeout=timeout)
            ray.get(learner.wait_push.remote(), timeout=timeout)
            overlap.append({**started, "train_s": step["train_s"], **ray.get(learner.last_push.remote())})
        nbytes = int(push[0]["push_bytes"])
        if any(p["bytes"] != nbytes for p in push):
            raise RuntimeError(f"sent bytes {[p['bytes'] for p in push]} != planned {nbytes}")

        raw = raw_gloo(ray, nbytes, pushes, timeout)
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.get(learner.shutdown.remote(), timeout=120)
    finally:
        for actor in (engine, learner):
            if actor is not None:
                ray.kill(actor)
        ray.shutdown()
    dtype = engine_dtype(resolve_device(cfg.rollout.engine.device), cfg.rollout.engine.dtype)
    flat = flatten_seconds(cfg.model.path, dtype, pushes)
    return {"train": train, "push": push, "overlap": overlap, "raw": raw, "flatten": flat, "bytes": nbytes,
            "dtype": dtype}


def main() -> None:
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--size", choices=["tiny", "medium"], default="tiny")
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = common.load_model(args)  # the tiny model, by its absolute path (every Ray worker finds it)
    if args.size == "medium":
        medium = build_medium_model(Path(cfg.model.path)).resolve()
        cfg = common.load(args, [f"model.path={medium}", "model.bootstrap=null"])
    r = run(cfg, args.steps, args.pushes)

    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(cfg.model.path).parameters())
    med = statistics.median
    push_s = med(p["push_s"] for p in r["push"])
    raw_s = med(r["raw"])
    push_gbps, raw_gbps = r["bytes"] / push_s / 1e9, r["bytes"] / raw_s / 1e9
    stall_s = med(p["push_blocking_s"] for p in r["push"])
    train_s = med(t["train_s"] for t in r["train"])
    print(json.dumps({
        "size": args.size, "params": params, "push_bytes": r["bytes"], "engine_dtype": r["dtype"],
        "bucket_mb": cfg.weight_sync.bucket_mb, "pushes": args.pushes,
        "push_s_median": round(push_s, 4), "push_s_runs": [round(p["push_s"], 4) for p in r["push"]],
        "push_GBps": round(push_gbps, 3), "raw_s_median": round(raw_s, 4), "raw_GBps": round(raw_gbps, 3),
        "ratio_push_over_raw": round(push_gbps / raw_gbps, 3),
        "flatten_s_median": round(med(r["flatten"]), 4),
        "learner_stall_s_median": round(stall_s, 4),
        "wait_push_s_median": round(med(p["wait_s"] for p in r["push"]), 4),
        "engine_load_s_median": round(med(p["engine_s"] for p in r["push"]), 4),
        "steps": args.steps, "train_groups": cfg.algorithm.train_batch_groups, "G": cfg.rollout.n,
        "train_tokens_per_step": round(med(t["train_tokens"] for t in r["train"])),
        "learner_tokens_per_s": round(med(t["train_tokens"] / t["train_s"] for t in r["train"]), 1),
        "train_s_median": round(train_s, 4), "stall_over_train_step": round(stall_s / train_s, 4),
        **overlap_summary(r["overlap"], train_s, cfg.weight_sync.bucket_mb),
    }))


def overlap_summary(overlap: list[dict], train_alone_s: float, bucket_mb: int) -> dict:
    """The push as a run sees it: the learner's stall (the push call), the engine's pause (its whole
    update: pause, load every bucket, continue) and the training step run beside the push, each over the
    median training step measured alone in the same run."""
    med = statistics.median
    stall = med(o["push_blocking_s"] for o in overlap)
    pause = med(o["engine_s"] for o in overlap)
    during = med(o["train_s"] for o in overlap)
    return {"overlap_pushes": len(overlap), "buckets": int(overlap[0]["push_buckets"]),
            "overlap_stall_s_median": round(stall, 4), "overlap_engine_pause_s_median": round(pause, 4),
            "overlap_train_s_median": round(during, 4),
            "stall_over_step": round(stall / train_alone_s, 4), "engine_pause_over_step": round(pause / train_alone_s, 4),
            "step_during_push_over_alone": round(during / train_alone_s, 4)}


if __name__ == "__main__":
    main()
