"""Rollout actor: one SGLang engine that keeps many prompts in flight and streams scored groups.

Threads and loops (why it looks like this): the engine must be created on the actor's main thread
(SGLang installs signal handlers), and in-flight weight updates must use the engine's *async*
tokenizer-manager API inside the engine's own event loop. So ``__init__`` builds the engine on the main
thread, then runs the engine's loop forever on one background thread; every Ray method (called on Ray's
thread pool, ``max_concurrency`` > 1) submits a coroutine to that loop and waits for its result.

Producer loop: ask the replay queue for admission (it blocks while the staleness bound is reached, and
hands out prompt indices from its epoch-aware cursor), start G samples per admitted prompt, score each
finished sample (math reward + soft overlong penalty), and when all G are done send one
:class:`~async_dapo.wire.Group` over zmq.

Weight updates, three modes (``rollout.update_mode``), all exact about per-token policy versions:
* ``inflight``: pause with ``retract`` (running requests keep their tokens, their KV cache is dropped),
  load, continue; the rest of each sample is generated, and its cache recomputed, with the new weights.
  Per-token versions come from SGLang's ``weight_versions`` spans.
* ``drain``: stop admitting, wait until every running sample finished, load, admit again.
* ``abort``: abort running requests, load, resample the aborted ones from scratch.
Every load is wrapped in ``begin_weight_update``/``end_weight_update`` (SGLang 0.5.23 refuses otherwise);
a refused load raises here, and the caller fails the sender rather than leaving it hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_dapo.config import Config
from async_dapo.data import PromptRow, train_rows
from async_dapo.device import pin_threads, resolve_device
from async_dapo.reward import dapo_math_score, overlong_penalty
from async_dapo.wire import Group, Sample

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """SGLang refused a weight update (the message says why)."""


def token_versions(spans: list[dict] | None, length: int, fallback: int) -> np.ndarray:
    """Per-token policy versions from SGLang's ``weight_versions`` spans ({version, start, end});
    tokens no span covers get ``fallback`` (the version at the request's start)."""
    out = np.full(length, fallback, dtype=np.int32)
    for span in spans or []:
        try:
            version = int(span["version"])
        except ValueError:  # the engine's initial "default" label
            version = fallback
        out[span["start"] : span["end"]] = version
    return out


@dataclass
class _Stats:
    groups_sent: int = 0
    samples: int = 0
    gen_tokens: int = 0
    resampled: int = 0
    updates: int = 0
    update_seconds: float = 0.0
    idle_seconds: float = 0.0  # time the producer waited for admission with nothing in flight
    started_at: float = field(default_factory=time.time)


class _Session:
    """Everything that runs on the engine's event loop (all coroutines live here: a Ray actor class with
    any ``async def`` becomes an asyncio actor, which is not what the engine needs)."""

    def __init__(self, cfg: Config, rank: int, version: int, tokenizer, rows: list[PromptRow], tm) -> None:
        self.cfg, self.rank, self.version = cfg, rank, version
        self.tokenizer, self.rows, self.tm = tokenizer, rows, tm
        self.stats = _Stats()
        self.admitting = asyncio.Event()  # cleared while a drain-mode update waits for idle
        self.weights_ready = asyncio.Event()  # cleared during an update: new requests wait
        self.admitting.set()
        self.weights_ready.set()
        self.inflight: set[asyncio.Task] = set()
        self.sender = None

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                "max_new_tokens": r.max_response_length}

    async def sample_once(self, prompt_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """One completion; resampled from scratch if an abort-mode update aborted it."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        while True:
            await self.weights_ready.wait()
            start_version = self.version
            obj = GenerateReqInput(input_ids=list(prompt_ids), sampling_params=dict(params),
                                   return_logprob=True, rid=uuid.uuid4().hex)
            t0 = time.perf_counter()
            out = await self.tm.generate_request(obj, None).__anext__()
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            if finish != "abort":
                out["_start_version"] = start_version
                out["_seconds"] = time.perf_counter() - t0
                return out
            self.stats.resampled += 1

    def _score(self, row: PromptRow, out: dict[str, Any]) -> Sample:
        meta = out["meta_info"]
        ids = np.asarray(out["output_ids"], dtype=np.int32)
        logprobs = np.asarray([lp for lp, *_ in meta["output_token_logprobs"]], dtype=np.float32)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        result = dapo_math_score(text, row.ground_truth)
        rw = self.cfg.reward
        penalty = (overlong_penalty(len(ids), self.cfg.rollout.max_response_length,
                                    rw.overlong_buffer_length, rw.overlong_penalty_factor)
                   if rw.overlong_buffer_enable else 0.0)
        finish = (meta.get("finish_reason") or {}).get("type", "")
        return Sample(
            response_ids=ids, logprobs=logprobs,
            versions=token_versions(meta.get("weight_versions"), len(ids), out["_start_version"]),
            reward=result.score + penalty, score=result.score, acc=result.acc,
            truncated=finish == "length", finish_reason=finish, gen_seconds=out["_seconds"],
        )

    async def sample_group(self, epoch: int, index: int, admitted_version: int) -> Group:
        """G scored samples of prompt ``index`` as one group."""
        from async_dapo.bootstrap import encode_prompt

        row = self.rows[index]
        prompt = encode_prompt(self.tokenizer, row)
        params = self._sampling_params()
        outs = await asyncio.gather(*[self.sample_once(prompt, params) for _ in range(self.cfg.rollout.n)])
        samples = tuple(self._score(row, o) for o in outs)
        self.stats.samples += len(samples)
        self.stats.gen_tokens += sum(len(s.response_ids) for s in samples)
        return Group(
            group_id=f"{epoch}-{index}-{uuid.uuid4().hex[:8]}", prompt_index=index, epoch=epoch,
            engine_rank=self.rank, prompt_ids=np.asarray(prompt, dtype=np.int32),
            ground_truth=row.ground_truth, data_source=row.data_source, samples=samples,
            created_at=time.time(), admitted_version=admitted_version,
        )

    async def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*[self.sample_once(p, params) for p in prompts]))

    async def validate(self, rows: list[PromptRow], k: int, params: dict[str, Any]) -> dict[str, float]:
        """avg@k / pass@k / maj@k of ``rows`` under the weights the engine runs now."""
        from async_dapo.bootstrap import encode_prompt
        from async_dapo.evaluate import val_metrics

        version = self.version
        prompts = [encode_prompt(self.tokenizer, r) for r in rows]
        outs = await self.generate([p for p in prompts for _ in range(k)], params)
        texts = [[self.tokenizer.decode(o["output_ids"], skip_special_tokens=True) for o in outs[i * k:(i + 1) * k]]
                 for i in range(len(rows))]
        return {**val_metrics(texts, rows), "val/version": float(version)}

    # ------------------------------------------------------------------ producer
    async def _emit(self, epoch: int, index: int, version: int) -> None:
        group = await self.sample_group(epoch, index, version)
        self.sender.send(group)
        self.stats.groups_sent += 1

    async def produce(self, queue) -> None:
        """Admit prompts while the queue allows, keep up to max_inflight_prompts groups running."""
        cap = self.cfg.rollout.max_inflight_prompts
        while True:
            await self.admitting.wait()
            if len(self.inflight) >= cap:
                await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            t0 = time.perf_counter()
            tickets = await queue.admit.remote(self.rank, cap - len(self.inflight))
            if not self.inflight:
                self.stats.idle_seconds += time.perf_counter() - t0
            for epoch, index, version in tickets:
                task = asyncio.ensure_future(self._emit(epoch, index, version))
                self.inflight.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("group failed: %r", task.exception())

    # ------------------------------------------------------------------ weights
    async def join(self, obj) -> None:
        ok, msg = await self.tm.init_weights_update_group(obj, None)
        if not ok:
            raise WeightUpdateError(f"init_weights_update_group refused: {msg}")

    async def _until_idle(self, timeout_s: float = 3600.0) -> None:
        """Wait until the engine has no running request (drain mode). SGLang offers no completion event
        for "all requests done", so this polls its request table every 10 ms."""
        deadline = time.monotonic() + timeout_s
        while self.tm.rid_to_state:
            if time.monotonic() > deadline:
                raise TimeoutError("drain: requests still running after the timeout")
            await asyncio.sleep(0.01)

    async def _load(self, buckets, group_name: str, version: int) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput, EndWeightUpdateReqInput, UpdateWeightsFromDistributedReqInput,
        )

        ok, msg = await self.tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise WeightUpdateError(f"begin_weight_update refused: {msg}")
        try:
            for bucket in buckets:  # the learner broadcasts them in this order
                ok, msg = await self.tm.update_weights_from_distributed(
                    UpdateWeightsFromDistributedReqInput(
                        names=list(bucket.names), dtypes=list(bucket.dtypes),
                        shapes=[list(x) for x in bucket.shapes], group_name=group_name,
                        weight_version=str(version), load_format="flattened_bucket", flush_cache=True),
                    None,
                )
                if not ok:
                    break
        finally:
            end_ok, end_msg = await self.tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok or not end_ok:
            raise WeightUpdateError(f"weight update to version {version} refused: {msg if not ok else end_msg}")

    async def update(self, buckets, group_name: str, version: int, mode: str) -> float:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        t0 = time.perf_counter()
        # New requests (and aborted ones, which resample) wait for the new weights.
        self.weights_ready.clear()
        if mode == "drain":
            self.admitting.clear()
            await self._until_idle()
        else:
            await self.tm.pause_generation(PauseGenerationReqInput(mode="retract" if mode == "inflight" else "abort"))
        try:
            await self._load(buckets, group_name, version)
            self.version = version
        finally:
            if mode != "drain":
                await self.tm.continue_generation(ContinueGenerationReqInput())
            self.weights_ready.set()
            self.admitting.set()
        seconds = time.perf_counter() - t0
        self.stats.updates += 1
        self.stats.update_seconds += seconds
        return seconds


class RolloutWorker:
    """The actor body: a synchronous facade (wrapped by :func:`rollout_actor_class` for Ray)."""

    def __init__(self, cfg: Config, engine_rank: int, initial_version: int = 0) -> None:
        from transformers import AutoTokenizer

        from async_dapo.engine import start_engine

        pin_threads(1)
        ec = cfg.rollout.engine.model_copy(
            update={"extra_args": {"weight_version": str(initial_version), **cfg.rollout.engine.extra_args}}
        )
        self.engine = start_engine(ec, cfg.model.path)
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        self.session = _Session(cfg, engine_rank, initial_version, AutoTokenizer.from_pretrained(cfg.model.path),
                                train_rows(cfg), self.engine.tokenizer_manager)
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()
        self._producer = None

    def _call(self, coro, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop from any thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, queue, address: str) -> None:
        """Connect to the queue's zmq address and start producing groups."""
        from async_dapo.transport import GroupSender

        self.session.sender = GroupSender(address)
        self._producer = asyncio.run_coroutine_threadsafe(self.session.produce(queue), self.loop)

    def join_weight_group(self, master_addr: str, master_port: int, world_size: int, rank_offset: int,
                          group_name: str, backend: str) -> None:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        self._call(self.session.join(InitWeightsUpdateGroupReqInput(
            master_address=master_addr, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)))

    def update_weights(self, buckets: list, group_name: str, version: int, mode: str | None = None) -> float:
        """Receive one pushed version — ``buckets`` (weight_sync.Bucket) describe the flat broadcasts the
        learner sends meanwhile, in order — and run it. ``mode`` overrides rollout.update_mode. Returns
        seconds spent. Raises WeightUpdateError if SGLang refused."""
        mode = mode or self.session.cfg.rollout.update_mode
        if mode not in ("inflight", "drain", "abort"):
            raise ValueError(f"mode: unknown update mode {mode!r}")
        return self._call(self.session.update(buckets, group_name, version, mode))

    def generate(self, prompts: list[list[int]], params: dict[str, Any]) -> list[dict[str, Any]]:
        """Plain sampling for validation and tests (not admitted through the queue)."""
        return self._call(self.session.generate(prompts, params))

    def validate(self, rows: list[PromptRow], k: int, params: dict[str, Any]) -> dict[str, float]:
        """Held-out avg@k / pass@k / maj@k with the validation sampling parameters."""
        return self._call(self.session.validate(rows, k, params))

    def num_running_requests(self) -> int:
        """Requests the engine is working on right now (tests use it to update mid-generation)."""
        return len(self.session.tm.rid_to_state)

    def get_stats(self) -> dict[str, float]:
        s = self.session.stats
        return {**s.__dict__, "version": self.session.version, "inflight": len(self.session.inflight),
                "wall_seconds": time.time() - s.started_at}

    def shutdown(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
        for task in list(self.session.inflight):
            self.loop.call_soon_threadsafe(task.cancel)
        if self.session.sender is not None:
            self.session.sender.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.engine.shutdown()


def rollout_actor_class(cfg: Config, **options):
    """``ray.remote`` wrapper with the resources and environment the config asks for (``options``: extra
    Ray actor options, e.g. a scheduling strategy)."""
    import ray

    from async_dapo.device import sglang_process_env

    p = cfg.placement
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           **sglang_process_env(resolve_device(cfg.rollout.engine.device))}
    return ray.remote(RolloutWorker).options(
        num_cpus=p.engine_cpus, num_gpus=p.engine_gpus, max_concurrency=8,
        runtime_env={"env_vars": env}, **options,
    )
