"""The weight path, learner → engines: the weight-update group and everything that travels over it.

One module, three small interfaces:

* **Learner** (every FSDP rank): :class:`WeightSender`. ``push`` copies this rank's shards, cast to the
  engines' dtype, into a snapshot (the only part the training loop waits for) and returns; a background
  thread gathers the snapshot bucket by bucket over a process group of its own (its own communicator; on
  CUDA its own stream), so the next training step runs while the push is under way. Rank 0 broadcasts each
  gathered bucket to the engines, at most two buckets in flight (one broadcasting, one gathered), waits
  until every engine reports the version loaded, then calls the push's ``on_loaded(version)`` (the run
  passes :class:`ActorCallback` to the replay queue's ``set_version``). The snapshot is a copy: the next
  optimizer step cannot change what is being sent.
* **Engine** (each rollout actor, on the engine's event loop): :func:`join_group`, :func:`leave_group` and
  :func:`load`, the SGLang tokenizer-manager calls that receive a push.
* **Placement**: :class:`WeightGroup`, the group's lifecycle. Learner rank 0 + every engine rank, named
  by generation; rebuilt under a new name and port when an engine is replaced.

SGLang's ``init_weights_update_group`` builds its side of the group with a TCP rendezvous, a
``PrefixStore(group_name, store)`` and torch's process-group helper; :func:`open_update_group` builds the
matching rank-0 side the same way without importing sglang. Parameters go out in buckets, one flat
broadcast per bucket, in exactly the order of the bucket metadata (names, dtypes, shapes) the engines were
given first over the control plane (Ray).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

from async_dapo.device import dist_backend, engine_dtype, learner_backend
from async_dapo.weights.shards import snapshot, unpad
from async_dapo.waits import RunFailed, engines_failed, fan_out

log = logging.getLogger("async_dapo")

WEIGHT_GROUP = "async_dapo_weights"  # + a generation suffix: the group is rebuilt when an engine is replaced
# Learner rank 0's Ray concurrency group for the weight group's lifecycle (endpoint, open, close, push_idle):
# these run on a thread of their own, beside train_step, so a regroup never waits for a training step and
# the learner trains while the group forms. Only those calls use it, and never two at once.
CONTROL = "control"
# Wrappers that FSDP2 / activation checkpointing / torch.compile may insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


# ---------------------------------------------------------------------------------------- what is sent
def sglang_name(name: str) -> str:
    """The name SGLang's loader expects for a learner parameter. SGLang loads HF checkpoint names (its
    Qwen2/Qwen3/Llama ``load_weights`` stacks q/k/v and gate/up itself), so the mapping is: strip the
    wrapper prefixes that training-side wrappers insert, keep the HF name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class Bucket:
    """One broadcast's worth of parameters: what an engine needs to allocate and split the flat buffer
    (SGLang's ``load_format="flattened_bucket"``: the tensors' bytes concatenated in this order)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names without the "torch." prefix, e.g. "float32"
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * getattr(torch, d).itemsize for d, s in zip(self.dtypes, self.shapes))


def plan_buckets(meta: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Group (name, dtype, shape) into buckets of at most ``bucket_bytes`` (a larger tensor gets its own),
    in order, one dtype per bucket so every tensor's byte offset stays aligned to its itemsize."""
    buckets: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    size = 0
    for name, dtype, shape in meta:
        nbytes = math.prod(shape) * dtype.itemsize
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][-1][1] != dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, dtype, tuple(shape)))
        size += nbytes
    return [
        Bucket(tuple(n for n, _, _ in b), tuple(str(d).removeprefix("torch.") for _, d, _ in b),
               tuple(s for _, _, s in b))
        for b in buckets
    ]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` back to back (uint8), the layout SGLang's flattened bucket expects."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


# ---------------------------------------------------------------------------------------- the group
def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_endpoint(bind_host: str) -> tuple[str, int]:
    """(host, free port) on this node for a TCP rendezvous: loopback unless transport.bind_host binds
    another interface (multi-node), then this node's IP as Ray knows it."""
    import ray

    host = "127.0.0.1" if bind_host in ("127.0.0.1", "localhost", "::1") else ray.util.get_node_ip_address()
    return host, free_port(host)


def open_update_group(
    master_addr: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float,
    rank: int = 0, join_timeout_s: float | None = None,
):
    """Rank 0 (the learner) of the weight-update group; blocks until every engine rank has joined (each
    engine calls ``init_weights_update_group(..., rank_offset=1)`` concurrently), at most ``join_timeout_s``
    (default ``timeout_s``, the bound of each collective on the group). Tests open a receiving rank the same
    way (``rank`` > 0)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    join = datetime.timedelta(seconds=join_timeout_s or timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{master_addr}:{master_port}", rank, world_size, timeout=join))
    store.set_timeout(join)
    pg, _ = _new_process_group_helper(
        world, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name,
        backend_options=None, timeout=timeout,
    )
    # Registered like SGLang's side, so dist.broadcast(group=pg) accepts it.
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def broadcast_bucket(pg, tensors: list[torch.Tensor]) -> int:
    """Send one bucket from rank 0 as a single flat broadcast; returns the bytes sent when the send has
    completed (the source tensors may then change again)."""
    flat = flatten(tensors)
    dist.broadcast(flat, src=0, group=pg)
    return flat.numel()


def close_update_group(pg) -> None:
    dist.destroy_process_group(pg)


def on_control(actor, method: str):
    """``actor.<method>`` run in the learner's :data:`CONTROL` concurrency group (beside training)."""
    return getattr(actor, method).options(concurrency_group=CONTROL)


def group_name(generation: int) -> str:
    return f"{WEIGHT_GROUP}_{generation}"


class WeightGroup:
    """Placement's side: the run's weight-update group (learner rank 0 + ``tp_size`` ranks per engine).
    ``get(refs, what, timeout_s)`` is a bounded ``ray.get`` naming what it waited for; ``endpoint()`` a fresh
    (host, port) for the rendezvous on learner rank 0's node."""

    def __init__(self, cfg, backend: str, get: Callable, endpoint: Callable[[], tuple[str, int]]) -> None:
        self.cfg, self.backend, self.get, self.endpoint = cfg, backend, get, endpoint
        self.generation = 0

    @property
    def name(self) -> str:
        return group_name(self.generation)

    def open(self, learner, engines: dict, bound: float | None = None) -> None:
        """Form the group: learner rank 0 and every engine (``engines``: rank -> actor, in group order) join
        at a fresh endpoint at once; the learner is told the engines' weight dtype (each resolves it where it
        runs). Every step is bounded by ``bound`` (default placement.health_check_timeout_s) for all engines
        together (a rendezvous takes seconds); EnginesFailed names the engines that failed or did not answer."""
        host, port = self.endpoint()
        tp, bound = self.cfg.rollout.engine.tp_size, bound or self.cfg.placement.health_check_timeout_s
        world = 1 + tp * len(engines)
        dtypes, failed, late = fan_out({r: e.weight_dtype.remote() for r, e in engines.items()}, timeout_s=bound)
        engines_failed("engines' weight dtype", failed, late, bound)
        if len(set(dtypes.values())) != 1:
            raise RunFailed(f"engines hold their weights in different dtypes {sorted(set(dtypes.values()))}: "
                            "set rollout.engine.dtype")
        joins = {r: e.join_weight_group.remote(host, port, world, 1 + i * tp, self.name, self.backend)
                 for i, (r, e) in enumerate(engines.items())}
        opened = on_control(learner, "open_weight_group").remote(host, port, world, self.name, dtypes.popitem()[1],
                                                                 bound)
        _, failed, late = fan_out(joins, timeout_s=bound + 5)  # the learner's rendezvous gives up after bound
        what = f"learner rank 0 opening {self.name}"
        if failed or late:  # the learner's side fails with them (within its bound): name the engines
            _quietly(lambda: self.get(opened, what, bound + 10))
            if late:  # the others' joins failed because those never came: only the hung ones are to blame
                failed = {r: why for r, why in failed.items() if why.startswith("process died")}
            engines_failed(f"engines joining {self.name}", failed, late, bound)
        self.get(opened, what, bound + 10)

    def rebuild(self, learner, engines: dict, bound: float | None = None) -> None:
        """A new group (new name, new port) with ``engines`` (rank -> actor, every serving one): the learner
        closes the old one first (on gloo that also fails any engine still blocked in it), then the engines
        leave it, all at once; one that does not answer in ``bound`` (default placement.health_check_timeout_s)
        is named (EnginesFailed) before the new group is formed without it."""
        old, ws, bound = self.name, self.cfg.weight_sync, bound or self.cfg.placement.health_check_timeout_s
        self.get(on_control(learner, "close_weight_group").remote(), "close weight group", 2 * ws.timeout_s)
        _, failed, late = fan_out({r: e.leave_weight_group.remote(old) for r, e in engines.items()}, timeout_s=bound)
        for rank, why in failed.items():  # a replacement never joined the old group: refused, harmlessly
            log.debug("rollout actor %d leaving %s: %s", rank, old, why)
        died = {r: why for r, why in failed.items() if why.startswith("process died")}
        self.generation += 1
        engines_failed(f"engines leaving {old}", died, late, bound)
        if engines:  # none serving (the only engine failed): no group until one comes up
            self.open(learner, engines, bound)


def _quietly(fn) -> None:
    """Run ``fn``, logging (not raising) its failure: used where a clearer error is raised next."""
    try:
        fn()
    except Exception as exc:
        log.info("%r", exc)


@dataclass(frozen=True)
class ActorCallback:
    """"The engines loaded version v", told to a Ray actor as ``actor.<method>.remote(v)`` and waited for at
    most ``timeout_s``. Picklable: it travels to learner rank 0 with the push call."""

    actor: Any
    method: str
    timeout_s: float

    def __call__(self, version: int) -> None:
        import ray

        ray.get(getattr(self.actor, self.method).remote(version), timeout=self.timeout_s)


# ---------------------------------------------------------------------------------------- learner end
class WeightSender:
    """Learner side of the push, one per rank (see the module docstring). Construct it at the same point
    of every rank's start-up: it creates the push's own process group, a collective. All waits are bounded:
    gathers by learner.collective_timeout_s, broadcasts and the engines' answer by weight_sync.timeout_s."""

    def __init__(self, cfg, rank: int, world: int, device: str, timeout: datetime.timedelta) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self._gather_pg = dist.new_group(backend=learner_backend(device), timeout=timeout)
        self._stream = torch.cuda.Stream() if device == "cuda" else None
        self._pg = None  # the weight-update group (rank 0 only)
        self._group_name = WEIGHT_GROUP
        self._dtype: torch.dtype | None = None  # the engines' weight dtype, told by open()
        # The push in flight: its thread and the dict only that thread writes; the last finished push.
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] = {}
        self._result: dict[str, Any] = {}

    def open(self, master_addr: str, master_port: int, world_size: int, name: str, dtype: str | None,
             join_timeout_s: float | None = None) -> None:
        """Rank 0: become rank 0 of group ``name`` (engines join concurrently, at most ``join_timeout_s``,
        default weight_sync.timeout_s) and push in ``dtype`` (None: rollout.engine.dtype as this rank's
        device resolves it). An earlier group is closed first."""
        self.close()
        ws = self.cfg.weight_sync
        self._pg = open_update_group(master_addr, master_port, world_size, name,
                                     dist_backend(self.device, ws.backend), ws.timeout_s, join_timeout_s=join_timeout_s)
        self._group_name = name
        self._dtype = getattr(torch, dtype) if dtype else None

    def close(self) -> None:
        """Abandon the current group (an engine of it died): join the sender, whatever its outcome, then
        destroy the group — never under a sender that is still using it."""
        if self._join(self.bound_s()) is not None:
            raise RuntimeError(f"weight push of version {self._state['version']}: sender still busy; "
                               "cannot rebuild the weight group")
        if self._pg is not None:
            try:
                close_update_group(self._pg)
            except Exception:  # a group whose peer died may refuse a clean destroy; it is dropped anyway
                pass
            self._pg = None

    def bound_s(self) -> float:
        """The sender's waits: its gathers (collective_timeout_s each, but they fail together), the
        broadcasts and the engines' answer (weight_sync.timeout_s each)."""
        return 2 * self.cfg.weight_sync.timeout_s

    def push(self, params: Iterable[tuple[str, torch.Tensor]], version: int, engines: list,
             on_loaded: Callable[[int], None] | None) -> dict[str, float]:
        """Snapshot ``params`` (the model's named parameters) and send them in the background to
        ``engines`` (rank 0; other ranks only gather); after the engines report ``version`` loaded, rank 0
        calls ``on_loaded(version)``. A failed previous push is not raised here: :meth:`wait` reports it,
        and the caller has already decided to push again (a replacement pushes after rebuilding the group)."""
        t0 = time.perf_counter()
        if (busy := self._join(self.bound_s())) is not None:  # never overlap two pushes
            raise RuntimeError(busy)  # only after the sender's own bounds failed: the groups are unusable
        stall = time.perf_counter() - t0
        buckets, by_name = self._plan(params)
        shards = self._snapshot(buckets, by_name)
        ready = None
        if self._stream is not None:  # the snapshot was written on the default stream
            ready = torch.cuda.Event()
            ready.record()
        if self.rank != 0:  # only rank 0 talks to the engines and the queue
            engines, on_loaded = [], None
        refs = [e.update_weights.remote(buckets, self._group_name, version) for e in engines]
        self._state = {"version": version}
        self._thread = threading.Thread(target=self._send, daemon=True,
                                        args=(buckets, shards, ready, refs, on_loaded, version, self._state))
        self._thread.start()
        return {"push_stall_s": stall, "push_blocking_s": time.perf_counter() - t0,
                "push_bytes": float(sum(b.nbytes for b in buckets)), "push_buckets": float(len(buckets))}

    def wait(self) -> float:
        """Block until the previous push finished, at most :meth:`bound_s`; returns the seconds waited.
        Raises if that push failed (once: a retried push starts clean) or is still running."""
        t0 = time.perf_counter()
        if (busy := self._join(self.bound_s())) is not None:
            raise TimeoutError(busy)
        if error := self._result.get("error"):
            self._result.update(error="", failed=error)
            raise RuntimeError(f"weight push of version {self._result['version']} failed on rank "
                               f"{self.rank}: {error}")
        return time.perf_counter() - t0

    def idle(self) -> bool:
        """No push in flight (the last one's result, if any, is there for :meth:`wait`); never waits."""
        return self._thread is None or not self._thread.is_alive()

    def last(self) -> dict[str, Any]:
        """The last finished push: version, push_s, bytes, engine_s, error."""
        return dict(self._result)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.bound_s())

    def _plan(self, params) -> tuple[list[Bucket], dict[str, torch.Tensor]]:
        """The buckets (engine names, dtype, full shapes) and each parameter by engine name."""
        dtype = self._dtype or getattr(torch, engine_dtype(self.device, self.cfg.rollout.engine.dtype))
        by_name = {sglang_name(n): p for n, p in params}
        meta = [(n, dtype, tuple(p.shape)) for n, p in by_name.items()]
        return plan_buckets(meta, self.cfg.weight_sync.bucket_mb << 20), by_name

    def _snapshot(self, buckets: list[Bucket], by_name: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's rows of every parameter, cast to the bucket's (engine) dtype before any gather: the
        gather then moves half the bytes of fp32 master weights, and the optimizer may move on."""
        shards = {}
        for b in buckets:
            for name in b.names:
                p = by_name[name]
                local = p.to_local() if hasattr(p, "to_local") else p
                shards[name] = snapshot(local, p.shape[0], self.world, getattr(torch, b.dtypes[0]))
        return shards

    def _send(self, buckets: list[Bucket], shards: dict[str, torch.Tensor], ready, refs: list, on_loaded,
              version: int, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            stream = self._stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if ready is not None:
                    stream.wait_event(ready)
                sent = self._gather_and_broadcast(buckets, shards)
                if stream is not None:
                    stream.synchronize()  # this thread only: the training stream never waits for it
            engine_s = self._engines_loaded(refs, on_loaded, version)
            state.update(push_s=time.perf_counter() - t0, bytes=sent, engine_s=engine_s, error="")
        except Exception as exc:  # surfaced by wait(): a failed push fails the run loudly
            state.update(error=repr(exc))

    def _gather_and_broadcast(self, buckets: list[Bucket], shards: dict[str, torch.Tensor]) -> int:
        """Gather each bucket's shards (one all_gather per bucket over the push's own group); rank 0
        broadcasts it to the engines asynchronously, waiting for the previous bucket's broadcast first:
        at most two buckets in flight. Returns the bytes broadcast."""
        sent, pending = 0, None
        for b in buckets:
            tensors = self._gather_bucket([shards[n] for n in b.names], b.shapes)
            if self.rank != 0 or self._pg is None:
                continue
            flat = flatten(tensors).to(self.device)
            if pending is not None:  # Work.wait is bounded by the weight group's timeout (weight_sync.timeout_s)
                pending[0].wait()
            pending = (dist.broadcast(flat, src=0, group=self._pg, async_op=True), flat)
            sent += flat.numel()
        if pending is not None:
            pending[0].wait()
        return sent

    def _gather_bucket(self, parts: list[torch.Tensor], shapes) -> list[torch.Tensor]:
        if self.world == 1:
            return [p[: s[0]] for p, s in zip(parts, shapes)]
        local = torch.cat([p.reshape(-1) for p in parts])
        gathered = local.new_empty(self.world * local.numel())  # rank after rank
        dist.all_gather_into_tensor(gathered, local, group=self._gather_pg)
        if self.rank != 0:  # only rank 0 sends: the others take part in the gather and need nothing back
            return []
        return unpad(gathered.view(self.world, -1), self.world, [tuple(s) for s in shapes])

    def _engines_loaded(self, refs: list, on_loaded, version: int) -> float:
        """Rank 0: wait until the engines report the new weights loaded, then tell ``on_loaded``."""
        engine_s, bound = {}, self.cfg.weight_sync.timeout_s
        if refs:  # an engine the supervisor took out under the push (it hung) dies: the others keep the weights
            engine_s, failed, late = fan_out(dict(enumerate(refs)), timeout_s=bound)
            died = [i for i, why in failed.items() if why.startswith("process died")]
            if late or len(died) < len(failed) or len(died) == len(refs):
                raise RuntimeError("engines loading version {}: {}".format(version, "; ".join(
                    [f"{i} {why}" for i, why in failed.items()] + [f"{i} no answer in {bound:.0f} s" for i in late])))
            if died:
                log.warning("push of version %d: engine(s) at %s died under it; the others loaded it", version, died)
        if on_loaded is not None:
            on_loaded(version)  # the engines run `version` now
        return max(engine_s.values()) if engine_s else 0.0

    def _join(self, timeout_s: float) -> str | None:
        """Join the push in flight (if any) and record its result; returns a message if it is still busy."""
        if self._thread is None:
            return None
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            return f"weight push of version {self._state['version']}: sender still busy after {timeout_s:.0f} s"
        self._thread, self._result = None, dict(self._state)
        return None


# ---------------------------------------------------------------------------------------- engine end
class WeightUpdateError(RuntimeError):
    """SGLang refused a weight update (the message says why)."""


async def join_group(tm, master_addr: str, master_port: int, world_size: int, rank_offset: int, name: str,
                     backend: str) -> None:
    """The engine's ranks join group ``name`` (SGLang's ``init_weights_update_group`` on tokenizer manager
    ``tm``); WeightUpdateError if refused."""
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    ok, msg = await tm.init_weights_update_group(InitWeightsUpdateGroupReqInput(
        master_address=master_addr, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
        group_name=name, backend=backend), None)
    if not ok:
        raise WeightUpdateError(f"init_weights_update_group refused: {msg}")


async def leave_group(tm, name: str) -> None:
    """Destroy the engine's side of group ``name`` (before joining its successor); a refusal is logged."""
    from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

    ok, msg = await tm.destroy_weights_update_group(DestroyWeightsUpdateGroupReqInput(group_name=name))
    if not ok:
        log.warning("destroy_weights_update_group(%s): %s", name, msg)


async def load(tm, buckets: list[Bucket], name: str, version: int) -> None:
    """Receive one push: each bucket's flat broadcast over group ``name``, in order, labelled ``version``.
    Wrapped in ``begin_weight_update``/``end_weight_update`` (SGLang 0.5.23 refuses otherwise); the caller
    pauses or drains generation around it. WeightUpdateError if SGLang refused any part."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput, EndWeightUpdateReqInput, UpdateWeightsFromDistributedReqInput,
    )

    ok, msg = await tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
    if not ok:
        raise WeightUpdateError(f"begin_weight_update refused: {msg}")
    try:
        for bucket in buckets:  # the learner broadcasts them in this order
            ok, msg = await tm.update_weights_from_distributed(
                UpdateWeightsFromDistributedReqInput(
                    names=list(bucket.names), dtypes=list(bucket.dtypes),
                    shapes=[list(x) for x in bucket.shapes], group_name=name,
                    weight_version=str(version), load_format="flattened_bucket",
                    flush_cache=bucket is buckets[-1]),  # once per update: the cache is stale only at the end
                None,
            )
            if not ok:
                break
    finally:
        end_ok, end_msg = await tm.end_weight_update(EndWeightUpdateReqInput(), None)
    if not ok or not end_ok:
        raise WeightUpdateError(f"weight update to version {version} refused: {msg if not ok else end_msg}")
