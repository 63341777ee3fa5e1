"""Weight push fan-out: seconds per push versus the number of receiving engines, over gloo on CPU.

    python tools/bench/push_fanout.py [--quick] [--receivers 1,2,4,8] [--sizes tiny,medium] [--rounds 3]
                                      [--pushes 3] [--bucket-mb 64] [--out DIR]

The sender is this process, rank 0 of a weight-update group made by ``weight_sync.open_update_group``; the
receivers are plain processes (no SGLang: 8 engines do not fit 2 cores), max(E) of them started once, and
one group per receiver count E (ranks 1..E). Each receiver does what an engine's side of ``weight_sync.load`` does with the bytes: per bucket, allocate the flat
buffer (``Bucket.nbytes``) and receive its broadcast. A push is what ``WeightSender._gather_and_broadcast``
does on a single learner rank: buckets from ``weight_sync.plan_buckets`` (one dtype each, at most
``--bucket-mb``), each ``weight_sync.flatten``-ed and broadcast asynchronously, at most two in flight. It
ends when every receiver has all its bytes (a 1-element all-reduce after the last bucket stands in for
the engines' "loaded" answer, which the real push gets over Ray). Timed at the sender: ``send_s`` until
the last broadcast's ``wait`` returned, ``push_s`` until the acknowledgement. ``--rounds`` rounds over every
(E, size), E's order reversed every other round, each a warm-up push and ``--pushes`` timed ones: on a shared
machine the ratios compare pushes made side by side.

Sizes: ``tiny`` = the tiny model's real parameters (models/tiny_cpu, fp32 as configs/tiny_cpu.yaml's engine
holds them, ~1.5 MB); ``medium`` = random fp32 tensors in the shapes of tools/bench/push.py's medium Qwen2
(hidden 512, 8 layers, MLP 1536, the tiny vocabulary: ~110 MB). Reports per (size, E): push seconds
(median over the rounds), GB/s per receiver (bytes / push_s), aggregate GB/s (E x bytes / push_s) and
t(E) / t(1). Prints one JSON line per configuration and a table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

TINY_MODEL = common.REPO / "models" / "tiny_cpu" / "model.safetensors"
MEDIUM_VOCAB = 288  # the tiny model's vocabulary (push.py's medium model keeps its tokenizer)
GROUP = "bench_push_fanout"
COLUMNS = ["size", "receivers", "MB", "buckets", "push_s", "send_s", "GBps_per_receiver", "GBps_aggregate",
           "t_over_t1"]


def parameters(size: str) -> dict:
    """name -> tensor of one size (see the module docstring)."""
    import torch

    if size == "tiny":
        from safetensors.torch import load_file

        return load_file(str(TINY_MODEL))
    from push import MEDIUM_SHAPE  # tools/bench/push.py: the medium model's shape

    h, layers, mlp = MEDIUM_SHAPE["hidden_size"], MEDIUM_SHAPE["num_hidden_layers"], MEDIUM_SHAPE["intermediate_size"]
    kv = h * MEDIUM_SHAPE["num_key_value_heads"] // MEDIUM_SHAPE["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (MEDIUM_VOCAB, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (mlp, h),
                       p + "mlp.up_proj.weight": (mlp, h), p + "mlp.down_proj.weight": (h, mlp),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def plan(params: dict, bucket_mb: int):
    from async_dapo.weights.sync import plan_buckets

    return plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in params.items()], bucket_mb << 20)


# ------------------------------------------------------------------------------------------ receivers
def receiver(rank: int, plans: list[list[int]], timeout_s: float, commands, out) -> None:
    """Receiving rank ``rank`` (one process, alive for the whole run). Commands: ("join", E, port): become
    rank ``rank`` of the group of E receivers; ("push", E, size, times): receive ``times`` pushes of size
    index ``size`` (``plans[size]``: its bucket byte counts) in group E, then report the last bucket's
    final bytes (a check that it got what was sent); ("exit",)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from async_dapo.weights.sync import close_update_group, open_update_group

    torch.set_num_threads(1)
    groups = {}
    try:
        while (cmd := commands.get(timeout=timeout_s))[0] != "exit":
            if cmd[0] == "join":
                _, e, port = cmd
                groups[e] = open_update_group("127.0.0.1", port, e + 1, f"{GROUP}_{e}", "gloo", timeout_s, rank=rank)
                continue
            _, e, size, times = cmd
            for _ in range(times):
                for nbytes in plans[size]:  # as an engine loads a flattened bucket: allocate, receive
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                    dist.broadcast(buf, src=0, group=groups[e])
                dist.all_reduce(torch.ones(1), group=groups[e])  # "loaded"
            out.put((rank, buf[-8:].tolist()))
        for pg in groups.values():
            close_update_group(pg)
    except Exception as exc:  # reported to the parent, which fails loudly
        out.put((rank, repr(exc)))


# ------------------------------------------------------------------------------------------ sender
def push_once(pg, buckets, params: dict) -> tuple[float, float]:
    """One push as WeightSender._gather_and_broadcast on one rank: (send_s, push_s)."""
    import torch
    import torch.distributed as dist

    from async_dapo.weights.sync import flatten

    t0 = time.perf_counter()
    pending = None
    for b in buckets:
        flat = flatten([params[n] for n in b.names])
        if pending is not None:
            pending[0].wait()
        pending = (dist.broadcast(flat, src=0, group=pg, async_op=True), flat)
    pending[0].wait()
    sent = time.perf_counter() - t0
    dist.all_reduce(torch.ones(1), group=pg)
    return sent, time.perf_counter() - t0


def run(counts: list[int], sizes: list[str], rounds: int, pushes: int, bucket_mb: int, timeout_s: float) -> list[dict]:
    """max(counts) receivers, one group per receiver count; then ``rounds`` rounds over every (E, size),
    the order of E reversed every other round, ``pushes`` timed pushes each after one warm-up per round:
    every ratio compares pushes made side by side under the same background load."""
    import multiprocessing as mp

    import torch

    from async_dapo.weights.sync import close_update_group, flatten, free_port, open_update_group

    torch.set_num_threads(1)
    params = {s: parameters(s) for s in sizes}
    buckets = {s: plan(params[s], bucket_mb) for s in sizes}
    tails = {s: flatten([params[s][n] for n in buckets[s][-1].names])[-8:].tolist() for s in sizes}
    plans = [[b.nbytes for b in buckets[s]] for s in sizes]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    commands = {r: ctx.Queue() for r in range(1, max(counts) + 1)}
    procs = [ctx.Process(target=receiver, args=(r, plans, timeout_s, q, out), daemon=True) for r, q in commands.items()]
    for p in procs:
        p.start()

    def collect(e: int, size: str) -> None:
        for _ in range(e):
            rank, tail = out.get(timeout=timeout_s)
            if tail != tails[size]:
                raise RuntimeError(f"receiver {rank}, {size} push to {e} receivers: {tail}")

    runs: dict[tuple[int, str], list[tuple[float, float]]] = {(e, s): [] for e in counts for s in sizes}
    groups = {}
    try:
        for e in counts:
            port = free_port()
            for r in range(1, e + 1):
                commands[r].put(("join", e, port))
            groups[e] = open_update_group("127.0.0.1", port, e + 1, f"{GROUP}_{e}", "gloo", timeout_s)
        for k in range(rounds):
            for e in (counts if k % 2 == 0 else counts[::-1]):
                for i, s in enumerate(sizes):
                    for r in range(1, e + 1):
                        commands[r].put(("push", e, i, pushes + 1))
                    timed = [push_once(groups[e], buckets[s], params[s]) for _ in range(pushes + 1)]
                    runs[(e, s)] += timed[1:]  # after a warm-up
                    collect(e, s)
        for q in commands.values():
            q.put(("exit",))
        for pg in groups.values():
            close_update_group(pg)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # ours: started above
                p.kill()
    results = []
    for (e, s), timed in runs.items():
        nbytes = sum(b.nbytes for b in buckets[s])
        push_s = statistics.median(t[1] for t in timed)
        results.append({"size": s, "receivers": e, "bytes": nbytes, "MB": round(nbytes / 1e6, 2),
                        "buckets": len(buckets[s]), "bucket_mb": bucket_mb, "pushes": len(timed),
                        "push_s": round(push_s, 4), "send_s": round(statistics.median(t[0] for t in timed), 4),
                        "push_s_min": round(min(t[1] for t in timed), 4), "push_s_max": round(max(t[1] for t in timed), 4),
                        "GBps_per_receiver": round(nbytes / push_s / 1e9, 3),
                        "GBps_aggregate": round(e * nbytes / push_s / 1e9, 3)})
    return results


def main() -> None:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true", help="receivers 1,8, 2 rounds of 2 pushes")
    ap.add_argument("--receivers", default=None, help="comma-separated receiver counts (default 1,2,4,8)")
    ap.add_argument("--sizes", default="tiny,medium", help="comma-separated: tiny, medium (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds over every configuration (default 3)")
    ap.add_argument("--pushes", type=int, default=None, help="timed pushes per configuration and round (default 3)")
    ap.add_argument("--bucket-mb", type=int, default=64, help="weight_sync.bucket_mb (default %(default)s)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on every wait (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="also write push_fanout.{md,csv,jsonl} here")
    args = ap.parse_args()
    counts = [int(c) for c in (args.receivers or ("1,8" if args.quick else "1,2,4,8")).split(",")]
    pushes = args.pushes or (2 if args.quick else 3)
    rounds = args.rounds or (2 if args.quick else 3)
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in ("tiny", "medium"):
            ap.error(f"--sizes: unknown size {s!r} (tiny, medium)")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/bench/: push.py (MEDIUM_SHAPE)

    counts = sorted(set(counts))
    results = run(counts, sizes, rounds, pushes, args.bucket_mb, args.timeout_s)
    base = {r["size"]: r["push_s"] for r in results if r["receivers"] == min(counts)}
    for r in results:
        r["t_over_t1"] = round(r["push_s"] / base[r["size"]], 2)
        r["baseline_receivers"] = min(counts)
        print(json.dumps(r), flush=True)
    order = {s: i for i, s in enumerate(sizes)}
    rows = sorted(results, key=lambda r: (order[r["size"]], r["receivers"]))
    print(common.save_results("push_fanout", rows, rows, COLUMNS, args.out))


if __name__ == "__main__":
    main()
