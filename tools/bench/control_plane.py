"""What the control plane sustains at cluster rates: many producers (simulated engines) against ONE real
replay-queue actor, over the real path, with a consumer taking batches as the learner does.

    python tools/bench/control_plane.py [--quick] [--engines 16,32,64] [--sizes tiny,32b] [--seconds 15]
                                        [--hosts 2] [--batch-groups-32b 64] [--eta 1]
                                        [--max-concurrency run[,N...]] [--out DIR]
    python tools/bench/control_plane.py --wakeups [--engines 16,32,64]

One local Ray session (2 CPUs). Per configuration (message size x number of engines):
* the queue: ``replay_queue.replay_actor_class(cfg).remote(cfg, 0)``, cfg = configs/tiny_cpu.yaml with
  placement.num_engines = E (so transport.max_peers = 2E, as in a run), and the admission parameters of
  configs/dapo_qwen2.5_32b_16x8_async.yaml (B = algorithm.train_batch_groups 512, eta = replay.max_staleness
  1; rollout.max_inflight_prompts 64 per producer). The 32b size runs with B = --batch-groups-32b (64): the
  queue holds up to (eta + 1) x B groups, 1,024 x 3.9 MB = 4 GB at B = 512, more than this machine can lend;
* E producers, each one simulated engine: asyncio tasks spread over ``--hosts`` Ray actor processes (64
  processes would not fit 2 cores). Each runs the rollout actor's producer loop (``EngineSession.produce``):
  ``register_producer``, then ``admit.remote(rank, cap - inflight, 5 s, incarnation)`` while fewer than cap
  groups are in flight; for each ticket it builds a real ``wire.Group`` at once (no generation: the load is
  the control plane's ceiling, not an engine's) and sends it with its own ``transport.GroupSender`` (its
  own zmq connection, signed with the queue's ``producer_secret``, from a one-thread pool, as the rollout
  actor does). Samples are half correct (mixed groups: dynamic sampling stays on and accepts them); every
  token carries the ticket's version;
* the consumer, this process (the learner's part): ``get_batch(v)`` in a loop, then ``set_version(v + 1)``
  (training and the push take no time), so the admission window keeps moving. Staleness never blocks (a
  stale group is dropped and frees its slot), but with steps this short the version moves every second or
  so while a group spends about as long in transit at saturation, so 10-25 % of the arrivals are dropped as
  stale (reported; every arrival is the queue's work all the same). In a run a step is a minute or more.
Sizes: ``tiny`` = configs/tiny_cpu.yaml's group (G = rollout.n, rollout.max_response_length tokens,
data.max_prompt_length prompt); ``32b`` = configs/dapo_qwen2.5_32b_16x8.yaml's at full length (G = 16,
20,480 response tokens, 2,048 prompt tokens): the largest message the recipe can produce.

Measured after a warm-up (every producer has sent a group and two batches were taken; at most 90 s, 30 s
with --quick: ``connected`` says how many had), over
``--seconds``: groups/s arriving at the queue (its ``received`` counter) and handed out, MB/s (encoded size
+ HMAC tag), admission calls/s, admit latency (every call that returned tickets: it includes waiting for
room in the window), send time (from the group's hand-off to its producer's send thread: queueing there,
encode, sign, zmq), end-to-end latency (group built -> handed out by get_batch; split by Little's law into
admission -> arrival and the wait in the queue for a batch), the CPU of the queue actor, the producers and
this consumer (psutil over the window) and the queue's RSS with all peers connected. On a machine whose
cores the producers share, the rates are the box's; the queue's CPU milliseconds per group, and from it its
ceiling (one core / that), are the queue's own. Prints one JSON line per configuration and a table (also written to --out as
control_plane.md / .csv / .jsonl when given).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

BASE_CONFIG = "configs/tiny_cpu.yaml"
RECIPE = "configs/dapo_qwen2.5_32b_16x8.yaml"  # message size (n, lengths)
RECIPE_ASYNC = "configs/dapo_qwen2.5_32b_16x8_async.yaml"  # admission (B, eta, max_inflight_prompts)
ADMIT_WAIT_S = 5.0  # = rollout.ADMIT_WAIT_S (importing rollout would import torch into every producer)
SIZE_CONFIGS = {"tiny": BASE_CONFIG, "32b": RECIPE}
COLUMNS = ["size", "engines", "max_concurrency", "B", "msg_MB", "groups_per_s", "handed_per_s", "MB_per_s", "admits_per_s",
           "admit_ms_p50", "admit_ms_p99", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99", "queue_cpu_pct",
           "queue_cpu_ms_per_group", "queue_ceiling_groups_per_s", "queue_rss_MB", "producers_cpu_pct",
           "consumer_cpu_pct"]


# ------------------------------------------------------------------------------------------ messages
def message_shape(size: str) -> dict:
    """G, response tokens, prompt tokens and vocabulary of one group of ``size``, read from its config."""
    cfg = common.load_config(SIZE_CONFIGS[size])
    vocab = 152_064 if size == "32b" else 288  # Qwen2.5-32B's; the tiny model's (models/tiny_cpu)
    return {"G": cfg.rollout.n, "response": cfg.rollout.max_response_length, "prompt": cfg.data.max_prompt_length,
            "vocab": vocab}


CALL_TIMEOUT_S = 300.0  # bound on every call to the queue or a producer host: a stuck actor ends the tool


class GroupMaker:
    """Real ``wire.Group`` objects of one shape: fixed random tokens, per-token versions = the ticket's version
    (one Sample tuple per version, built once), half the samples correct."""

    def __init__(self, shape: dict, seed: int) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        g, n = shape["G"], shape["response"]
        self.ids = rng.integers(3, shape["vocab"], size=(g, n)).astype(np.int32)
        self.logprobs = (-rng.random((g, n)) * 3).astype(np.float32)
        self.prompt = rng.integers(3, shape["vocab"], size=shape["prompt"]).astype(np.int32)
        self._samples: dict[int, tuple] = {}

    def samples(self, version: int) -> tuple:
        import numpy as np

        from async_dapo.stream.wire import Sample

        if version not in self._samples:
            for old in [v for v in self._samples if v < version - 4]:
                del self._samples[old]
            self._samples[version] = tuple(
                Sample(response_ids=ids, logprobs=lp, versions=np.full(len(ids), version, np.int32),
                       reward=1.0 if j % 2 else -1.0, score=1.0 if j % 2 else -1.0, acc=bool(j % 2),
                       truncated=False, finish_reason="stop", gen_seconds=1.0)
                for j, (ids, lp) in enumerate(zip(self.ids, self.logprobs)))
        return self._samples[version]

    def group(self, group_id: str, epoch: int, index: int, version: int, rank: int):
        from async_dapo.stream.wire import Group

        return Group(group_id=group_id, prompt_index=index, epoch=epoch, engine_rank=rank, prompt_ids=self.prompt,
                     ground_truth="42", data_source="bench", samples=self.samples(version), created_at=time.time(),
                     admitted_version=version)


def encoded_bytes(shape: dict) -> int:
    """Bytes on the wire for one group: the msgpack encoding + the 32-byte HMAC tag."""
    from async_dapo.stream.transport import TAG_BYTES
    from async_dapo.stream.wire import encode_group

    return len(encode_group(GroupMaker(shape, 0).group("size-0-0", 0, 0, 0, 0))) + TAG_BYTES


# ------------------------------------------------------------------------------------------ producers
class ProducerHost:
    """One process hosting several simulated engines, each an asyncio task running the rollout actor's
    producer loop with its own GroupSender and one send thread (see the module docstring)."""

    def __init__(self, ranks: list[int], shape: dict, address: str, secret: bytes, max_message_bytes: int,
                 cap: int, seed: int) -> None:
        self.ranks, self.address, self.secret, self.max_bytes, self.cap = ranks, address, secret, max_message_bytes, cap
        self.maker = GroupMaker(shape, seed)
        self.admits: list[tuple[float, float, int]] = []  # (end time, seconds, tickets)
        self.sends: list[tuple[float, float]] = []  # (end time, seconds)
        self.failures: list[str] = []
        self.sent_by_rank: dict[int, int] = dict.fromkeys(ranks, 0)
        self.stopping = False
        self.tasks: list = []

    async def start(self, queue) -> int:
        import asyncio

        self.tasks = [asyncio.ensure_future(self._produce(queue, r)) for r in self.ranks]
        return os.getpid()

    async def progress(self) -> int:
        """Producers that have sent at least one group (so their connection is up)."""
        return sum(1 for n in self.sent_by_rank.values() if n)

    async def stop(self) -> dict:
        import asyncio

        self.stopping = True
        for t in self.tasks:  # an admit still parked in the queue would hold us up to ADMIT_WAIT_S
            t.cancel()
        await asyncio.wait(self.tasks, timeout=5)
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                self.failures.append(repr(t.exception()))
        # Copies, taken on the event loop: the _emit tasks still running append to these lists, and Ray
        # serialises the returned value outside the loop.
        return {"admits": list(self.admits), "sends": list(self.sends), "failures": self.failures[:5],
                "n_failures": len(self.failures)}

    async def _produce(self, queue, rank: int) -> None:
        import asyncio
        import uuid
        from concurrent.futures import ThreadPoolExecutor

        from async_dapo.stream.transport import GroupSender

        incarnation = uuid.uuid4().hex
        await queue.register_producer.remote(rank, incarnation)
        sender = GroupSender(self.address, secret=self.secret, max_message_bytes=self.max_bytes)
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"send-{rank}")
        inflight: set = set()
        try:
            while not self.stopping:
                if len(inflight) >= self.cap:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                t0 = time.perf_counter()
                tickets = await queue.admit.remote(rank, self.cap - len(inflight), ADMIT_WAIT_S, incarnation)
                if tickets:
                    self.admits.append((time.time(), time.perf_counter() - t0, len(tickets)))
                for group_id, epoch, index, version, _carried in tickets:  # (this bench never leaves: none carried)
                    task = asyncio.ensure_future(self._emit(sender, pool, rank, group_id, epoch, index, version))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
            if inflight:
                await asyncio.wait(inflight, timeout=30)
        finally:
            pool.shutdown(wait=False)
            sender.close()

    async def _emit(self, sender, pool, rank: int, group_id: str, epoch: int, index: int, version: int) -> None:
        import asyncio

        try:
            group = self.maker.group(group_id, epoch, index, version, rank)
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(pool, lambda: sender.send(group, timeout_ms=60_000))
            self.sends.append((time.time(), time.perf_counter() - t0))
            self.sent_by_rank[rank] += 1
        except Exception as exc:  # counted; the ticket expires in the queue
            self.failures.append(repr(exc))


# ------------------------------------------------------------------------------------------ one configuration
def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p = np.percentile(np.asarray(values) * scale, [50, 90, 99])
    return {"p50": round(float(p[0]), 2), "p90": round(float(p[1]), 2), "p99": round(float(p[2]), 2)}


def cpu_seconds(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def queue_class(cfg, max_concurrency: int | None):
    """The run's queue actor class (``replay_actor_class``), or the same class and options with another
    ``max_concurrency`` (to measure a change of it without editing the package)."""
    from async_dapo.replay.queue import ReplayQueue, replay_actor_class

    if max_concurrency is None:
        return replay_actor_class(cfg)
    import ray

    return ray.remote(ReplayQueue).options(num_cpus=cfg.placement.queue_cpus, max_concurrency=max_concurrency)


def run_config(size: str, engines: int, seconds: float, hosts: int, batch_groups: int, eta: int, cap: int,
               max_concurrency: int | None = None, warmup_timeout_s: float = 90.0) -> dict:
    import psutil
    import ray

    shape = message_shape(size)
    msg_bytes = encoded_bytes(shape)
    capacity = max(256, (eta + 1) * batch_groups)
    cfg = common.load_config(BASE_CONFIG, [f"placement.num_engines={engines}", f"algorithm.train_batch_groups={batch_groups}",
                                           f"replay.max_staleness={eta}", f"replay.capacity_groups={capacity}",
                                           "algorithm.dynamic_sampling.enable=true"])
    queue = queue_class(cfg, max_concurrency).remote(cfg, 0)
    host_actors: list = []
    try:
        address, secret, queue_pid = ray.get([queue.address.remote(), queue.producer_secret.remote(),
                                              queue.pid.remote()], timeout=CALL_TIMEOUT_S)
        split = [list(range(engines))[i::hosts] for i in range(hosts)]
        host_cls = ray.remote(ProducerHost).options(num_cpus=0)
        host_actors = [host_cls.remote(r, shape, address, secret, cfg.transport.max_message_bytes, cap, seed=i)
                       for i, r in enumerate(split) if r]
        host_pids = ray.get([h.start.remote(queue) for h in host_actors], timeout=CALL_TIMEOUT_S)

        version, handed, t0 = 0, [], None  # handed: (time, e2e seconds) per group
        start = time.time()
        last_check = 0.0
        procs = {"queue": psutil.Process(queue_pid), "consumer": psutil.Process(os.getpid()),
                 **{f"host{i}": psutil.Process(p) for i, p in enumerate(host_pids)}}
        cpu0 = stats0 = None
        samples: list[dict] = []  # the queue's running / depth every 0.25 s (Little's law, see little())
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.25):
                s = ray.get(queue.stats.remote(), timeout=CALL_TIMEOUT_S)
                samples.append({"running": s["running"], "depth": s["depth"]})

        sampler = threading.Thread(target=sample, daemon=True)
        while True:
            now = time.time()
            if t0 is None and now - last_check > 0.5:  # warm-up: every producer connected, two batches taken
                last_check = now
                connected = sum(ray.get([h.progress.remote() for h in host_actors], timeout=CALL_TIMEOUT_S))
                if (connected == engines and version >= 2) or now - start > warmup_timeout_s:
                    t0, warm_s, connected_at_start = now, now - start, connected
                    cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
                    stats0 = ray.get(queue.stats.remote(), timeout=CALL_TIMEOUT_S)
                    sampler.start()
            if t0 is not None and now - t0 >= seconds:
                break
            got = ray.get(queue.get_batch.remote(version, 2.0), timeout=CALL_TIMEOUT_S)
            if got["batch"]:
                at = time.time()
                handed += [(at, at - g.created_at) for g in got["batch"]]
                del got
                version += 1
                ray.get(queue.set_version.remote(version), timeout=CALL_TIMEOUT_S)
            elif got.get("problem"):
                raise RuntimeError(f"get_batch: {got['problem']}")
        t1 = time.time()
        window = t1 - t0
        cpu1 = {k: cpu_seconds(p) for k, p in procs.items()}
        sampling.set()
        sampler.join(timeout=10)
        rss = procs["queue"].memory_info().rss
        stats1 = ray.get(queue.stats.remote(), timeout=CALL_TIMEOUT_S)
        records = ray.get([h.stop.remote() for h in host_actors], timeout=CALL_TIMEOUT_S)
    finally:
        for h in host_actors:
            ray.kill(h)
        try:
            ray.get(queue.close.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(queue)

    def pct(key: str) -> float:
        return round(100 * (cpu1[key] - cpu0[key]) / window, 1)

    admits = [(s, n) for rec in records for (t, s, n) in rec["admits"] if t0 <= t <= t1]
    sends = [s for rec in records for (t, s) in rec["sends"] if t0 <= t <= t1]
    e2e = [lat for at, lat in handed if t0 <= at <= t1]
    received = stats1["received"] - stats0["received"]
    groups_per_s = received / window
    queue_cpu = (cpu1["queue"] - cpu0["queue"]) / window
    result = {
        "size": size, "engines": engines, "hosts": len(host_actors), "max_concurrency": max_concurrency or "run's", "B": batch_groups, "eta": eta, "cap": cap,
        "G": shape["G"], "response_tokens": shape["response"], "prompt_tokens": shape["prompt"],
        "msg_bytes": msg_bytes, "msg_MB": round(msg_bytes / 1e6, 4),
        "warmup_s": round(warm_s, 1), "connected": connected_at_start, "window_s": round(window, 2),
        "groups_per_s": round(groups_per_s, 1), "handed_per_s": round(len(e2e) / window, 1),
        "sent_per_s": round(len(sends) / window, 1), "MB_per_s": round(groups_per_s * msg_bytes / 1e6, 2),
        "admits_per_s": round(len(admits) / window, 1),
        "tickets_per_admit": round(sum(n for _, n in admits) / max(1, len(admits)), 2),
        "admit_ms": percentiles([s for s, _ in admits]), "send_ms": percentiles(sends), "e2e_ms": percentiles(e2e),
        "queue_cpu_pct": pct("queue"), "queue_rss_MB": round(rss / 1e6, 1),
        "queue_cpu_ms_per_group": round(1000 * queue_cpu / max(groups_per_s, 1e-9), 3),
        "queue_ceiling_groups_per_s": round(1 / (queue_cpu / groups_per_s), 1) if queue_cpu and groups_per_s else None,
        "producers_cpu_pct": round(sum(pct(k) for k in cpu1 if k.startswith("host")), 1),
        "consumer_cpu_pct": pct("consumer"),
        **little(samples, groups_per_s, stats1, stats0, window),
        "batches": stats1["batches"] - stats0["batches"],
        "dropped_stale": sum(stats1[k] - stats0[k] for k in ("dropped_stale", "dropped_stale_at_handout")),
        "dropped_other": sum(stats1[k] - stats0[k] for k in ("dropped_all_correct", "dropped_all_wrong",
                                                             "dropped_capacity")),
        "rejected": {k: v for k, v in stats1.items() if k.startswith("rejected_") and v},
        "abandoned": {k: v for k, v in stats1.items() if k.startswith("abandoned/") and v},
        "producer_failures": sum(r["n_failures"] for r in records),
        "producer_failure_examples": [f for r in records for f in r["failures"]][:3],
    }
    return result


def little(samples: list[dict], arrivals_per_s: float, stats1: dict, stats0: dict, window: float) -> dict:
    """The end-to-end latency split by Little's law (mean in system = rate x mean time): mean admission ->
    arrival = mean running tickets / arrival rate (transit: the group is built and sent at once); mean wait
    in the queue = mean depth / accept rate (waiting for its batch: (eta + 1) x B / rate, set by admission)."""
    if not samples or not arrivals_per_s:
        return {}
    accepted_per_s = (stats1["accepted"] - stats0["accepted"]) / window
    running = sum(s["running"] for s in samples) / len(samples)
    depth = sum(s["depth"] for s in samples) / len(samples)
    return {"accepted_per_s": round(accepted_per_s, 1), "mean_running": round(running, 1), "mean_depth": round(depth, 1),
            "admit_to_arrival_ms_mean": round(1000 * running / arrivals_per_s, 2),
            "queue_wait_ms_mean": round(1000 * depth / accepted_per_s, 2) if accepted_per_s else None}


def wakeup_cost(parked_counts: list[int], batch_groups: int, eta: int, chunks: int = 21, notifies: int = 30) -> list[dict]:
    """What one arrival costs the queue's event loop per producer whose admit call is parked (the window
    full): the ReplayQueue class driven directly in this process (no Ray, no zmq). Each arrival ends in a
    notify of the queue's one condition, which wakes every parked admit to re-check its predicate;
    ``set_version`` to the current version does exactly that notify. Per notify the loop then runs E + 2
    iterations (every woken admit parks again); chunks of notifies alternate with chunks of the same
    iterations without a notify, and the median difference is the cost (robust to a busy machine)."""
    import asyncio
    import statistics

    from async_dapo.replay.queue import ReplayQueue

    async def spin(q, n: int, spins: int, notify: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            if notify:
                await q.set_version(0)
            for _ in range(spins):
                await asyncio.sleep(0)
        return time.perf_counter() - t0

    async def per_notify(parked: int) -> float:
        cfg = common.load_config(BASE_CONFIG, [f"placement.num_engines={parked}",
                                               f"algorithm.train_batch_groups={batch_groups}",
                                               f"replay.max_staleness={eta}",
                                               f"replay.capacity_groups={max(256, (eta + 1) * batch_groups)}"])
        q = ReplayQueue(cfg, 0)
        for r in range(parked):
            await q.register_producer(r, "bench")
        await q.admit(0, (eta + 1) * batch_groups, 1.0)  # fill the window
        waiting = [asyncio.ensure_future(q.admit(r, 64, 600.0, "bench")) for r in range(parked)]
        await asyncio.sleep(0.1)
        diffs = []
        for _ in range(chunks):
            with_notify = await spin(q, notifies, parked + 2, True)
            diffs.append((with_notify - await spin(q, notifies, parked + 2, False)) / notifies)
        for w in waiting:
            w.cancel()
        await asyncio.wait(waiting, timeout=5)
        await q.close()
        return statistics.median(diffs)

    rows = []
    for e in parked_counts:
        cost = asyncio.run(per_notify(e))
        rows.append({"parked_admits": e, "us_per_arrival": round(1e6 * cost, 1),
                     "us_per_parked_admit": round(1e6 * cost / e, 2)})
    return rows


def table_row(r: dict) -> dict:
    return {**{k: r[k] for k in COLUMNS if k in r}, "admit_ms_p50": r["admit_ms"]["p50"], "admit_ms_p99": r["admit_ms"]["p99"],
            "e2e_ms_p50": r["e2e_ms"]["p50"], "e2e_ms_p90": r["e2e_ms"]["p90"], "e2e_ms_p99": r["e2e_ms"]["p99"]}


def main() -> None:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--quick", action="store_true",
                    help="engines 16,64, 8 s windows, warm-up at most 30 s (about 3 minutes)")
    ap.add_argument("--engines", default=None, help="comma-separated producer counts (default 16,32,64)")
    ap.add_argument("--sizes", default="tiny,32b", help="comma-separated: tiny, 32b (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=None, help="measured window per configuration (default 15)")
    ap.add_argument("--hosts", type=int, default=2, help="producer processes (Ray actors); default %(default)s")
    ap.add_argument("--batch-groups-32b", type=int, default=64,
                    help="B for the 32b size (the recipe's 512 would hold ~4 GB in the queue); default %(default)s")
    ap.add_argument("--eta", type=int, default=None,
                    help="replay.max_staleness of the queue (default: the async recipe's, 1)")
    ap.add_argument("--max-concurrency", default="run",
                    help="the queue actor's Ray max_concurrency, comma-separated to compare side by side: 'run' = as "
                    "replay_actor_class sets it (default), or a number, e.g. run,192")
    ap.add_argument("--wakeups", action="store_true",
                    help="instead: the queue loop's cost per arrival per parked admit call, in this process "
                    "(16, 32, 64 parked; no Ray), then exit")
    ap.add_argument("--out", type=Path, default=None, help="also write control_plane.{md,csv,jsonl} here")
    args = ap.parse_args()
    engines = [int(e) for e in (args.engines or ("16,64" if args.quick else "16,32,64")).split(",")]
    seconds = args.seconds or (8.0 if args.quick else 15.0)
    sizes = [s for s in args.sizes.split(",") if s]
    try:
        concurrency = [None if c == "run" else int(c) for c in args.max_concurrency.split(",")]
    except ValueError:
        ap.error(f"--max-concurrency: 'run' or integers, got {args.max_concurrency!r}")
    for s in sizes:
        if s not in SIZE_CONFIGS:
            ap.error(f"--sizes: unknown size {s!r} (choose from {sorted(SIZE_CONFIGS)})")

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if args.wakeups:
        recipe = common.load_config(RECIPE_ASYNC)
        rows = wakeup_cost(engines if args.engines else [16, 32, 64], recipe.algorithm.train_batch_groups,
                           recipe.replay.max_staleness if args.eta is None else args.eta)
        for r in rows:
            print(json.dumps(r))
        print(common.write_table(rows, ["parked_admits", "us_per_arrival", "us_per_parked_admit"], None, None))
        return
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), os.environ.get("PYTHONPATH")) if p)
    import ray

    recipe = common.load_config(RECIPE_ASYNC)
    eta = recipe.replay.max_staleness if args.eta is None else args.eta
    cap = recipe.rollout.max_inflight_prompts
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for size in sizes:
            b = args.batch_groups_32b if size == "32b" else recipe.algorithm.train_batch_groups
            for e in engines:
                for mc in concurrency:
                    r = run_config(size, e, seconds, args.hosts, b, eta, cap, mc, 30.0 if args.quick else 90.0)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    finally:
        ray.shutdown()
    rows = [table_row(r) for r in results]
    print(common.save_results("control_plane", results, rows, COLUMNS, args.out))


if __name__ == "__main__":
    main()
