"""Rollout actor: one SGLang engine that keeps many prompts in flight and streams scored groups.

Threads and loops (why it looks like this): the engine must be created on the actor's main thread
(SGLang installs signal handlers), and in-flight weight updates must use the engine's *async*
tokenizer-manager API inside the engine's own event loop. So ``__init__`` builds the engine on the main
thread, then runs the engine's loop forever on one background thread; every Ray method (called on Ray's
thread pool, ``max_concurrency`` > 1) submits a coroutine to that loop and waits for its result.

Producer loop: ask the replay queue for admission (it blocks while the staleness bound is reached, and
hands out prompt indices from its epoch-aware cursor), request G samples per admitted prompt as one
batch, score the G together in a reward worker (math reward + soft overlong penalty), and send them as one
:class:`~async_dapo.stream.wire.Group` over zmq.

Weight updates, three modes (``rollout.update_mode``), all exact about per-token policy versions:
* ``inflight``: pause with ``retract`` (running requests keep their tokens, their KV cache is dropped),
  load, continue; the rest of each sample is generated, and its cache recomputed, with the new weights.
  Per-token versions come from SGLang's ``weight_versions`` spans.
* ``drain``: stop admitting, wait until every running sample finished, load, admit again.
* ``abort``: abort running requests and wait (10 ms checks) until the engine dropped them, load, resample
  the aborted ones from scratch, or with ``rollout.partial_rollout`` continue each from prompt + the tokens
  it had (their log-probs and versions kept, as an in-flight update keeps them).
The load itself (and joining or leaving the weight-update group) is ``async_dapo.weights.sync``'s engine
end; a refused load raises here, and the caller fails the sender rather than leaving it hanging.

Progress reports (``rollout.partial_every_s`` > 0): a training request is then streamed, so that the engine
hands each running sample's tokens over every ``rollout.partial_every_tokens`` with their log-probs; every
``partial_every_s`` each group in flight whose tokens moved is reported to the replay queue as a
:class:`~async_dapo.stream.wire.Partial`. SGLang tells a request's per-token versions only when it finishes
(an abort finishes it too), so no request may run across a load: with reports on, an ``inflight`` update
aborts the running requests and continues each from prompt + its tokens after the load, as ``abort`` with
``partial_rollout`` does. That is the same work as SGLang's retract (whose KV cache is dropped and
recomputed too), and every request then runs on the one version it began on. If this engine leaves the
fleet, the queue hands the last report with the prompt's next ticket to another engine, which continues each unfinished sample from its tokens (their
log-probs and versions kept, as an abort with ``rollout.partial_rollout`` does) and takes the finished ones
as they are.

Failures never lose a prompt: a group whose sampling, scoring, encoding or sending fails (engine error,
exception in the reward function, oversized or unsendable message, request aborted by the engine more than
``rollout.max_abort_retries`` times, or unanswered for ``rollout.request_timeout_s``) is reported to the
replay queue with :meth:`~async_dapo.replay.queue.ReplayQueue.abandon` and a reason; the queue frees
its admission slot and gives the prompt back to the cursor. ``health`` is the supervisor's heartbeat: one
1-token request through the engine, and the state of the producer task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_dapo.weights import sync as weight_sync
from async_dapo.config import Config
from async_dapo.data.rows import PromptRow, encode_prompt, train_rows
from async_dapo.device import engine_dtype, pin_threads, resolve_device, seed_everything
from async_dapo.data.reward import RewardResult, overlong_penalty
from async_dapo.data.scoring import Scorer, ScoringFailed
from async_dapo.stream.wire import Group, OversizedMessage, Partial, Progress, Sample, WireError

log = logging.getLogger(__name__)


OCCUPANCY_EVERY_S = 0.05  # the engine's running sequences are sampled this often (a dict length: cheap)
ADMIT_WAIT_S = 5.0  # one admit call waits at most this long in the queue: the producer stays responsive
CANCEL_GRACE_S = 10.0  # after a timeout, how long a cancelled call may take to abort its engine requests


class GroupFailed(RuntimeError):
    """A group cannot be completed; ``reason`` is the ``replay/abandoned/<reason>`` it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def failure_reason(exc: BaseException) -> str:
    """The abandon reason of an exception raised while producing one group."""
    if isinstance(exc, (GroupFailed, ScoringFailed)):
        return exc.reason
    if isinstance(exc, OversizedMessage):
        return "oversized"
    if isinstance(exc, TimeoutError):
        return "send_timeout"
    return "engine_error"


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
class Prefix:
    """The tokens an abort-mode update cut short, kept to be continued on the new weights
    (``rollout.partial_rollout``): ids, the behaviour log-probs and per-token versions they were sampled
    with, and the engine seconds they took."""

    ids: list[int]
    logprobs: list[float]
    versions: np.ndarray
    seconds: float
    carried: int = 0  # how many of the leading tokens another engine made (a carried progress report)

    @staticmethod
    def carried_from(progress: Progress) -> "Prefix | None":
        """The tokens another engine reported for one sample before it left (None: it had none)."""
        if not progress.num_tokens:
            return None
        return Prefix(progress.response_ids.tolist(), progress.logprobs.tolist(), np.asarray(progress.versions),
                      progress.gen_seconds, progress.num_tokens)

    @staticmethod
    def of(out: dict[str, Any], start_version: int, seconds: float, before: "Prefix | None" = None) -> "Prefix":
        """``before`` (if any) extended by the tokens of the aborted request ``out``."""
        meta = out["meta_info"]
        ids = list(out.get("output_ids") or ())
        logprobs = [lp for lp, *_ in meta.get("output_token_logprobs") or ()]
        if len(logprobs) != len(ids):  # the engine returned an incomplete record: nothing to continue from
            raise ValueError(f"aborted request: {len(ids)} tokens but {len(logprobs)} log-probs")
        versions = token_versions(meta.get("weight_versions"), len(ids), start_version)
        if before is None:
            return Prefix(ids, logprobs, versions, seconds)
        return Prefix(before.ids + ids, before.logprobs + logprobs, np.concatenate([before.versions, versions]),
                      before.seconds + seconds, before.carried)

    def joined(self, out: dict[str, Any], start_version: int, seconds: float) -> dict[str, Any]:
        """The finished continuation ``out`` with this prefix in front: one completion as the engine would
        have returned it uninterrupted, its per-token versions in ``_versions``."""
        meta = out["meta_info"]
        tail = list(out["output_ids"])
        return {**out, "output_ids": self.ids + tail,
                "meta_info": {**meta, "output_token_logprobs": [(lp, None, None) for lp in self.logprobs]
                              + list(meta["output_token_logprobs"])},
                "_versions": np.concatenate([self.versions, token_versions(meta.get("weight_versions"), len(tail),
                                                                           start_version)]),
                "_start_version": start_version, "_seconds": self.seconds + seconds}


def sampling_params(cfg: Config) -> dict[str, Any]:
    """SGLang sampling parameters of a training sample (rollout.temperature, top_p, top_k, max_response_length)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_response_length}


def _remaining(params: dict[str, Any], prefix: Prefix | None) -> dict[str, Any]:
    """``params`` for the rest of a sample after ``prefix``: the response budget less the kept tokens."""
    if prefix is None:
        return params
    return {**params, "max_new_tokens": params["max_new_tokens"] - len(prefix.ids)}


def _finished_as(reason: str) -> dict[str, Any]:
    """An empty completion that ends a prefix with ``reason``: the prefix is the whole sample."""
    return {"output_ids": [], "meta_info": {"finish_reason": {"type": reason}, "output_token_logprobs": []}}


# A prefix already at the response budget (an abort that raced the request's own finish) is complete.
_AT_BUDGET = _finished_as("length")


@dataclass
class _Slot:
    """One sample of a group in flight, for the progress reports: the engine request running it now and its
    latest streamed output, the prefix that request continues, and the finished completion once there is one."""

    rid: str | None = None
    start: tuple[int, int] = (0, 0)  # (updates started, version) when its request began
    prefix: Prefix | None = None
    latest: dict[str, Any] | None = None
    known: tuple | None = None  # the last progress of this request known exactly
    done: dict[str, Any] | None = None

    def begin(self, rid: str | None, start: tuple[int, int], prefix: Prefix | None) -> None:
        self.rid, self.start, self.prefix, self.latest, self.known = rid, start, prefix, None, None


@dataclass
class _Track:
    """A group in flight: its ticket and its samples' slots, and the tokens its last report held."""

    epoch: int
    index: int
    slots: list[_Slot]
    reported: int = 0
    sending: concurrent.futures.Future | None = None  # its last report, until the sender's thread took it


def _progress_of(slot: _Slot, now: tuple[int, int] | None) -> tuple[list[int], list[float], np.ndarray, str, float]:
    """(ids, logprobs, versions, finish reason or "", seconds) of one sample as far as the engine got, known
    exactly. ``now``: (updates started, version) of the engine, None while an update runs. An unfinished
    request's tokens are all of the version it began on if ``now`` is what it began with; otherwise an update
    may have changed the weights under them at a point SGLang does not tell until the request finishes, and
    what was last known exactly is reported again."""
    if slot.done is not None:
        out, meta = slot.done, slot.done["meta_info"]
        ids = list(out["output_ids"])
        versions = out["_versions"] if "_versions" in out else token_versions(
            meta.get("weight_versions"), len(ids), out["_start_version"])
        finish = (meta.get("finish_reason") or {}).get("type") or "stop"
        return ids, [lp for lp, *_ in meta["output_token_logprobs"]], versions, finish, out["_seconds"]
    head = slot.prefix or Prefix([], [], np.zeros(0, np.int32), 0.0)
    meta = slot.latest["meta_info"] if slot.latest is not None else {}
    finish = (meta.get("finish_reason") or {}).get("type") or ""
    settled = finish or now == slot.start  # a finished output carries its versions; else none changed since
    if slot.latest is None or finish == "abort" or not settled:  # (an aborted request's tokens: abort's own rules)
        return slot.known or (head.ids, head.logprobs, head.versions, "", head.seconds)
    logprobs = [lp for lp, *_ in meta.get("output_token_logprobs") or ()]
    n = len(logprobs)  # an unfinished output's ids are the engine's own growing list: cut to this chunk's length
    tail = token_versions(meta.get("weight_versions"), n, slot.start[1])
    slot.known = (head.ids + list(slot.latest["output_ids"][:n]), head.logprobs + logprobs,
                  np.concatenate([head.versions, tail]), finish, head.seconds)
    return slot.known


def fit_prompt(cfg: Config, prompt: list[int], index: int) -> list[int]:
    """Prompt ``index``'s token ids as sent to the engine. data.truncation 'left' keeps the last
    max_prompt_length tokens; 'error' rows were rejected at load, so a longer prompt here means the rows
    changed under us (GroupFailed prompt_too_long)."""
    limit = cfg.data.max_prompt_length
    if len(prompt) <= limit:
        return prompt
    if cfg.data.truncation == "left":
        return prompt[-limit:]
    raise GroupFailed("prompt_too_long", f"prompt {index}: {len(prompt)} tokens > data.max_prompt_length {limit}")


async def _last_chunks(outputs, slots: list[_Slot], n: int | None) -> Any:
    """A streamed request's result, as a plain request returns it (one completion, or with ``n`` a list):
    each completion's last output; every output is kept in its completion's slot meanwhile."""
    final: list[dict[str, Any] | None] = [None] * len(slots)
    async for out in outputs:
        i = out.get("index", 0)
        slots[i].latest = out
        if out["meta_info"].get("finish_reason") is not None:
            final[i] = out
    return final if n else final[0]


async def gather_all(coros) -> list:
    """``asyncio.gather`` that, when it is cancelled or one of its calls fails, cancels the others and waits
    (bounded) for their cleanup before raising (the first error itself, not a group): a plain gather
    returns at once and leaves its children aborting their engine requests behind the caller's back."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            if not task.cancelling():  # one cancel each: a second would cut short the cleanup of the first
                task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_GRACE_S)
        raise


@dataclass
class _Stats:
    groups_sent: int = 0
    samples: int = 0
    gen_tokens: int = 0
    resampled: int = 0
    aborted_tokens: int = 0  # tokens of requests aborted (by an abort-mode update or the engine): never trained
    continued_tokens: int = 0  # tokens an abort cut short, kept and continued (rollout.partial_rollout)
    carried_tokens: int = 0  # tokens another engine made before it left, continued here (or taken as finished)
    carried_stale_tokens: int = 0  # of those, thrown away: older than replay.max_staleness when they arrived
    partials_sent: int = 0  # progress reports queued for sending (rollout.partial_every_s)
    partials_unsent: int = 0  # reports not sent: oversized, or the stream was backed up for a whole cadence
    failed_groups: int = 0
    updates: int = 0
    update_seconds: float = 0.0
    idle_seconds: float = 0.0  # time the producer waited for admission with nothing in flight
    # Occupancy, sampled every OCCUPANCY_EVERY_S from the engine's request table: running sequences x seconds,
    # and seconds during which the engine ran some but fewer than half of the max_inflight_prompts x n it may.
    seq_seconds: float = 0.0
    tail_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)


class EngineSession:
    """One engine's sampling, scoring, producing and weight updates: everything that runs on the engine's
    event loop (all coroutines live here, not on :class:`RolloutWorker`: a Ray actor class with any
    ``async def`` becomes an asyncio actor, which is not what the engine needs)."""

    def __init__(self, cfg: Config, rank: int, version: int, tokenizer, rows: list[PromptRow], tm) -> None:
        self.cfg, self.rank, self.version = cfg, rank, version
        self.tokenizer, self.rows, self.tm = tokenizer, rows, tm
        self.stats = _Stats()
        self.admitting = asyncio.Event()  # cleared while a drain-mode update waits for idle
        self.weights_ready = asyncio.Event()  # cleared during an update: new requests wait
        self.admitting.set()
        self.weights_ready.set()
        self.inflight: set[asyncio.Task] = set()
        self.tracks: dict[str, _Track] = {}  # group id -> its samples' progress (rollout.partial_every_s)
        self._prompt_ids: dict[int, list[int]] = {}
        self.sender = None
        self.queue = None
        self._scorer: Scorer | None = None  # worker processes, started at the first score
        self.updates_started = 0  # a request aborted while this moved was aborted by our own update
        # whether the tokens of a request our own update aborts are kept and continued (see update())
        self.keep_aborted = cfg.rollout.partial_rollout
        self.closing = False  # set by the actor's shutdown: no more progress reports
        self.update_started_at: float | None = None  # monotonic time of the running update, if any
        self.loading_since: float | None = None  # the same, less a drain: since when it waits for the weights
        # zmq sockets are not thread-safe and a send may block on the high-water mark: one sender thread.
        self._send_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="group-send")

    # ------------------------------------------------------------------ sampling
    async def _request(self, prompt_ids: list[int], params: dict[str, Any], n: int | None = None, *,
                       rid: str | None = None, slots: list[_Slot] | None = None, prefix: Prefix | None = None) -> Any:
        """One engine request, bounded by ``rollout.request_timeout_s`` (aborted on expiry): one completion,
        or with ``n`` a list of n completions of the same prompt sent as ONE batch (one message through the
        tokenizer manager and the scheduler instead of n: that per-request overhead is what a CPU engine
        with ~5-token answers spends its time on). ``slots`` (one per completion; the ``prefix`` the request
        continues): with progress reports on, the request is streamed and each slot holds its completion's
        latest output."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        rids = [uuid.uuid4().hex for _ in range(n)] if n else [rid or uuid.uuid4().hex]
        for slot, r in zip(slots or (), rids):
            slot.begin(r, (self.updates_started, self.version), prefix)
        stream = bool(slots) and self.cfg.rollout.partial_every_s > 0
        if stream:
            params = {**params, "stream_interval": self.cfg.rollout.partial_every_tokens}
        obj = GenerateReqInput(input_ids=[list(prompt_ids)] * n if n else list(prompt_ids), stream=stream,
                               sampling_params=dict(params), return_logprob=True, rid=rids if n else rids[0])
        timeout = self.cfg.rollout.request_timeout_s
        try:
            outputs = self.tm.generate_request(obj, None)
            return await asyncio.wait_for(_last_chunks(outputs, slots, n) if stream else outputs.__anext__(), timeout)
        except asyncio.TimeoutError:
            self._abort(rids)
            raise GroupFailed("timeout", f"no result from the engine in {timeout:.0f} s "
                              "(rollout.request_timeout_s)") from None
        except asyncio.CancelledError:
            # the caller gave up (a timed-out validation, a shutdown): the engine must not go on with it
            self._abort(rids)
            await self._until_gone(rids)
            raise

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.tm.abort_request(rid)

    async def _until_gone(self, rids: list[str], timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the engine dropped aborted requests from its table, so that "cancelled"
        means "the engine is no longer working on them"."""
        deadline = time.monotonic() + timeout_s
        table = getattr(self.tm, "rid_to_state", {})
        while any(rid in table for rid in rids) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def sample_n(self, prompt_ids: list[int], params: dict[str, Any], n: int,
                       slots: list[_Slot] | None = None) -> list[dict[str, Any]]:
        """``n`` completions of one prompt, requested as one batch. A completion the batch lost to an abort is
        drawn again alone by :meth:`sample_once`, under its rules (an abort we did not cause counts as its
        first try). ``slots``: the group's, for its progress reports."""
        # Bounded by the update that cleared it: update() sets it again in its finally, and the load inside is
        # bounded by weight_sync.timeout_s (a stuck update gets the actor replaced by the supervisor).
        await self.weights_ready.wait()
        start_version, updates = self.version, self.updates_started
        t0 = time.perf_counter()
        outs = await self._request(prompt_ids, params, n, slots=slots)
        seconds = time.perf_counter() - t0
        redraw = []
        for i, out in enumerate(outs):
            slot = slots[i] if slots else None
            if (out["meta_info"].get("finish_reason") or {}).get("type") == "abort":
                ours = updates != self.updates_started
                prefix = self._after_abort(out, start_version, seconds, ours, None, slot)
                redraw.append((i, self.sample_once(prompt_ids, params, int(not ours), prefix, slot)))
            else:
                out["_start_version"], out["_seconds"] = start_version, seconds
                if slot is not None:
                    slot.done = out
        for i, out in zip([i for i, _ in redraw], await gather_all(c for _, c in redraw)):
            outs[i] = out
        return outs

    async def sample_once(self, prompt_ids: list[int], params: dict[str, Any], foreign_aborts: int = 0,
                          prefix: Prefix | None = None, slot: _Slot | None = None) -> dict[str, Any]:
        """One completion, continued from ``prefix`` if given. If an abort-mode update aborts it, it is drawn
        again from scratch, or with ``rollout.partial_rollout`` continued from the tokens it had. An abort we
        did not cause (e.g. the engine refused the request) is retried, from scratch or from the prefix it
        started from, at most ``rollout.max_abort_retries`` times. ``slot``: its group's, for the reports."""
        while True:
            await self.weights_ready.wait()  # bounded as in sample_n
            start_version, updates = self.version, self.updates_started
            prefix = self._still_fresh(prefix, start_version)
            if prefix is not None and len(prefix.ids) >= params["max_new_tokens"]:
                return self._finish(slot, prefix.joined(_AT_BUDGET, start_version, 0.0), prefix)
            t0 = time.perf_counter()
            out = await self._request(prompt_ids + (prefix.ids if prefix else []), _remaining(params, prefix),
                                      slots=[slot] if slot else None, prefix=prefix)
            seconds = time.perf_counter() - t0
            finish = (out["meta_info"].get("finish_reason") or {}).get("type")
            if finish != "abort":
                if prefix is not None:
                    return self._finish(slot, prefix.joined(out, start_version, seconds), prefix)
                out["_start_version"], out["_seconds"] = start_version, seconds
                return self._finish(slot, out, None)
            ours = updates != self.updates_started
            prefix = self._after_abort(out, start_version, seconds, ours, prefix, slot)
            if not ours:
                foreign_aborts += 1
                if foreign_aborts > self.cfg.rollout.max_abort_retries:
                    self.stats.aborted_tokens += len(prefix.ids) if prefix is not None else 0  # lost with the group
                    raise GroupFailed("aborted", f"the engine aborted the request {foreign_aborts} times: "
                                      f"{out['meta_info'].get('finish_reason')}")

    def _finish(self, slot: _Slot | None, out: dict[str, Any], prefix: Prefix | None) -> dict[str, Any]:
        """A finished completion: counted by where its prefix came from, and recorded in its slot."""
        if prefix is not None:
            self.stats.continued_tokens += len(prefix.ids) - prefix.carried
            self.stats.carried_tokens += prefix.carried
        if slot is not None:
            slot.done = out
        return out

    def _after_abort(self, out: dict[str, Any], start_version: int, seconds: float, ours: bool,
                     prefix: Prefix | None, slot: _Slot | None) -> Prefix | None:
        """What is kept of an aborted request: when our updates keep aborted work (``rollout.partial_rollout``,
        or an in-flight update with progress reports), an abort by our own update extends the prefix it
        continued from (None before: a new one), and an abort we did not cause keeps that prefix as it was;
        otherwise nothing is kept and the sample is drawn again from scratch. The tokens not kept are counted
        as aborted (never trained), and ``slot``'s reports hold what is kept from now on: a report sent before
        the sample is drawn again must not carry the aborted tokens to another engine as well."""
        kept = self._kept_after_abort(out, start_version, seconds, ours, prefix)
        if slot is not None:
            slot.begin(None, slot.start, kept)
        return kept

    def _kept_after_abort(self, out: dict[str, Any], start_version: int, seconds: float, ours: bool,
                          prefix: Prefix | None) -> Prefix | None:
        self.stats.resampled += 1
        new = len(out.get("output_ids") or ())
        if self.keep_aborted:
            if not ours:
                self.stats.aborted_tokens += new
                return prefix
            try:
                return Prefix.of(out, start_version, seconds, prefix)
            except ValueError as exc:
                log.warning("partial rollout: %s; this sample is drawn again from scratch", exc)
        self.stats.aborted_tokens += new + (len(prefix.ids) if prefix is not None else 0)
        return None

    def _still_fresh(self, prefix: Prefix | None, version: int) -> Prefix | None:
        """``prefix``, unless its oldest token is more than ``replay.max_staleness`` versions behind the
        weights it would continue on: the finished sample would be dropped as stale by the queue (whose
        version is at least the engine's), so its tokens are counted as aborted and it starts again."""
        if prefix is None or not prefix.ids or version - int(prefix.versions.min()) <= self.cfg.replay.max_staleness:
            return prefix
        self.stats.aborted_tokens += len(prefix.ids) - prefix.carried
        self.stats.carried_stale_tokens += prefix.carried
        return None

    @property
    def scorer(self) -> Scorer:
        if self._scorer is None:
            self._scorer = Scorer(self.cfg.reward, seed=self.cfg.logging.seed + 2000 + self.rank)
        return self._scorer

    async def _score_texts(self, row: PromptRow, texts: list[str]) -> list[RewardResult]:
        """``texts`` (responses to ``row``) scored by the run's reward function in a worker process, bounded
        by reward.timeout_s (ScoringFailed: score_timeout / score_error)."""
        return await self.scorer.score([(row.data_source, t, row.ground_truth, row.extra_info) for t in texts])

    def _texts(self, outs: list[dict[str, Any]]) -> list[str]:
        return [self.tokenizer.decode(o["output_ids"], skip_special_tokens=True) for o in outs]

    def _sample(self, out: dict[str, Any], result: RewardResult) -> Sample:
        meta = out["meta_info"]
        ids = np.asarray(out["output_ids"], dtype=np.int32)
        logprobs = np.asarray([lp for lp, *_ in meta["output_token_logprobs"]], dtype=np.float32)
        rw = self.cfg.reward
        penalty = (overlong_penalty(len(ids), self.cfg.rollout.max_response_length,
                                    rw.overlong_buffer_length, rw.overlong_penalty_factor)
                   if rw.overlong_buffer_enable else 0.0)
        finish = (meta.get("finish_reason") or {}).get("type", "")
        return Sample(
            response_ids=ids, logprobs=logprobs,
            versions=(out["_versions"] if "_versions" in out
                      else token_versions(meta.get("weight_versions"), len(ids), out["_start_version"])),
            reward=result.score + penalty, score=result.score, acc=result.acc,
            truncated=finish == "length", finish_reason=finish, gen_seconds=out["_seconds"],
        )

    async def sample_group(self, group_id: str, epoch: int, index: int, admitted_version: int,
                           carried: Partial | None = None) -> Group:
        """G scored samples of prompt ``index`` as one group; with ``carried`` (the progress an engine that
        left made on it), its finished samples are taken as they are and the others continued."""
        row = self.rows[index]
        if index not in self._prompt_ids:  # a prompt comes back every epoch: tokenize it once
            self._prompt_ids[index] = fit_prompt(self.cfg, encode_prompt(self.tokenizer, row), index)
        prompt = self._prompt_ids[index]
        params = sampling_params(self.cfg)
        n = self.cfg.rollout.n
        track = self.tracks[group_id] = _Track(epoch, index, [_Slot() for _ in range(n)])
        try:
            if carried is not None and len(carried.samples) == n:
                outs = await gather_all(self._carry_on(prompt, params, p, slot)
                                        for p, slot in zip(carried.samples, track.slots))
            else:
                if carried is not None:  # another group size: a resume that changed rollout.n
                    self.stats.carried_stale_tokens += carried.num_tokens
                    log.warning("group %s: the carried report holds %d samples, rollout.n is %d: drawn afresh "
                                "(%d tokens counted as carried_stale)", group_id, len(carried.samples), n,
                                carried.num_tokens)
                outs = await self.sample_n(prompt, params, n, track.slots)
        finally:
            self.tracks.pop(group_id, None)
        results = await self._score_texts(row, self._texts(outs))
        samples = tuple(self._sample(o, r) for o, r in zip(outs, results))
        self.stats.samples += len(samples)
        self.stats.gen_tokens += sum(len(s.response_ids) for s in samples)
        return Group(
            group_id=group_id, prompt_index=index, epoch=epoch,
            engine_rank=self.rank, prompt_ids=np.asarray(prompt, dtype=np.int32),
            ground_truth=row.ground_truth, data_source=row.data_source, samples=samples,
            created_at=time.time(), admitted_version=admitted_version,
        )

    async def _carry_on(self, prompt: list[int], params: dict[str, Any], progress: Progress,
                        slot: _Slot) -> dict[str, Any]:
        """One sample another engine reported before it left: as it is if it had finished, else continued
        from its tokens (drawn afresh if it had none, or if they are past replay.max_staleness: the group
        would be dropped as stale)."""
        prefix = self._still_fresh(Prefix.carried_from(progress), self.version)
        if progress.finished and prefix is not None:
            self.stats.carried_tokens += prefix.carried
            slot.done = prefix.joined(_finished_as(progress.finish_reason), self.version, 0.0)
            return slot.done
        return await self.sample_once(prompt, params, prefix=prefix, slot=slot)

    async def validate(self, rows: list[PromptRow], k: int, params: dict[str, Any]) -> dict[str, Any]:
        """``k`` samples of each row by the same path as training groups (:meth:`sample_n`), scored by the
        run's reward function: per-row (avg, pass, maj) scores (``evaluate.result_scores``), the generated
        tokens, and the lowest and highest policy version any sampled token came from (weights may be
        pushed while a validation runs: the learner does not wait for it)."""
        from async_dapo.rollout.evaluate import result_scores

        prompts = [fit_prompt(self.cfg, encode_prompt(self.tokenizer, r), i) for i, r in enumerate(rows)]
        groups = await gather_all(self.sample_n(p, params, k) for p in prompts)
        texts = [self._texts(g) for g in groups]
        results = await gather_all(self._score_texts(r, t) for r, t in zip(rows, texts))
        versions = [token_versions(o["meta_info"].get("weight_versions"), len(o["output_ids"]), o["_start_version"])
                    for g in groups for o in g]
        low = min((int(v.min()) for v in versions if len(v)), default=self.version)
        high = max((int(v.max()) for v in versions if len(v)), default=self.version)
        return {"scores": result_scores(results), "version_min": low, "version_max": high,
                "gen_tokens": sum(len(v) for v in versions)}

    # ------------------------------------------------------------------ producer
    async def _emit(self, group_id: str, epoch: int, index: int, version: int,
                    carried: Partial | None = None) -> None:
        try:
            group = await self.sample_group(group_id, epoch, index, version, carried)
            timeout_ms = int(self.cfg.rollout.request_timeout_s * 1000)
            await asyncio.get_running_loop().run_in_executor(
                self._send_pool, lambda: self.sender.send(group, timeout_ms=timeout_ms))
            self.stats.groups_sent += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.failed_groups += 1
            reason = failure_reason(exc)
            log.warning("group %s abandoned (%s): %r", group_id, reason, exc)
            try:
                await self._queue_call(self.queue.abandon.remote(group_id, reason), f"abandon {group_id}")
            except TimeoutError as err:  # the queue expires the ticket after replay.ticket_ttl_s: nothing lost
                log.error("%s; the queue will expire its ticket", err)

    async def _queue_call(self, ref, what: str, extra_s: float = 0.0) -> Any:
        """Await a call to the replay queue, bounded by placement.call_timeout_s (+ ``extra_s``, the wait the
        call itself is allowed); TimeoutError naming what it waited for."""
        timeout = self.cfg.placement.call_timeout_s + extra_s
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"rollout actor {self.rank}: {what}: no answer from the replay queue in "
                               f"{timeout:.0f} s (placement.call_timeout_s)") from None

    async def _sample_occupancy(self) -> None:
        """Integrate the engine's running sequences over time (rollout/<rank>/occupancy and tail_ratio): how
        full the engine's batch is, and how long it runs a tail of a few long responses."""
        cap = self.cfg.rollout.max_inflight_prompts * self.cfg.rollout.n
        last = time.perf_counter()
        while True:
            await asyncio.sleep(OCCUPANCY_EVERY_S)
            now, running = time.perf_counter(), len(self.tm.rid_to_state)
            self.stats.seq_seconds += running * (now - last)
            if 0 < running < cap / 2:
                self.stats.tail_seconds += now - last
            last = now

    async def produce(self, queue) -> None:
        """Admit prompts while the queue allows, keep up to max_inflight_prompts groups running."""
        self.queue = queue
        helpers = [asyncio.ensure_future(self._sample_occupancy())]
        if self.cfg.rollout.partial_every_s > 0:
            helpers.append(asyncio.ensure_future(self._report_progress()))
        try:
            await self._produce(queue)
        finally:
            for helper in helpers:
                helper.cancel()

    async def _report_progress(self) -> None:
        """Every rollout.partial_every_s, report each group in flight whose tokens moved since its last
        report (read here, on the engine's loop; encoded and sent on the sender's thread, at most one per group
        waiting for it). A report the stream cannot take within one cadence is skipped: the next one carries
        its tokens too."""
        every = self.cfg.rollout.partial_every_s
        while True:
            await asyncio.sleep(every)
            try:
                self._report_moved()
            except Exception:  # a bug here must not silently end the reports (nobody awaits this task)
                log.exception("progress reports: this round failed")

    def _report_moved(self) -> None:
        """One round of reports (see :meth:`_report_progress`)."""
        every = self.cfg.rollout.partial_every_s
        now = None if self.update_started_at is not None else (self.updates_started, self.version)
        for group_id, track in list(self.tracks.items()) if not self.closing else ():
            if track.sending is not None and not track.sending.done():
                continue
            samples = [_progress_of(slot, now) for slot in track.slots]
            tokens = sum(len(ids) for ids, *_ in samples)
            if tokens <= track.reported:
                continue
            track.reported = tokens
            track.sending = self._send_pool.submit(self._send_report, group_id, track.epoch, track.index, samples,
                                                   every)

    def _send_report(self, group_id: str, epoch: int, index: int, samples: list, every: float) -> None:
        """On the sender's thread: build, encode and send one report, within one cadence."""
        try:
            partial = Partial(group_id=group_id, prompt_index=index, epoch=epoch, engine_rank=self.rank,
                              samples=tuple(Progress(np.asarray(ids, np.int32), np.asarray(lps, np.float32), versions,
                                                     finish, seconds) for ids, lps, versions, finish, seconds in samples),
                              sent_at=time.time())
            self.sender.send(partial, timeout_ms=int(every * 1000))
            self.stats.partials_sent += 1
        except (WireError, TimeoutError) as exc:  # oversized, or the stream backed up for a whole cadence
            self.stats.partials_unsent += 1
            log.debug("progress report of %s not sent: %s", group_id, exc)
        except Exception as exc:  # a report is never worth the sender thread (the groups share it)
            self.stats.partials_unsent += 1
            log.warning("progress report of %s not sent: %r", group_id, exc)

    async def _produce(self, queue) -> None:
        incarnation = uuid.uuid4().hex  # this process: a replacement of the same rank registers anew
        await self._queue_call(queue.register_producer.remote(self.rank, incarnation), "register")
        cap = self.cfg.rollout.max_inflight_prompts
        while True:
            await self.admitting.wait()
            if len(self.inflight) >= cap:
                await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            t0 = time.perf_counter()
            # [] after a bounded wait: the loop stays responsive to cancellation and updates
            tickets = await self._queue_call(queue.admit.remote(self.rank, cap - len(self.inflight), ADMIT_WAIT_S,
                                                                incarnation), "admit", ADMIT_WAIT_S)
            if not self.inflight:
                self.stats.idle_seconds += time.perf_counter() - t0
            for group_id, epoch, index, version, carried in tickets:
                task = asyncio.ensure_future(self._emit(group_id, epoch, index, version, carried))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)

    async def probe(self, timeout_s: float) -> None:
        """Heartbeat, as SGLang's /health_generate: send a 1-token request; the engine is alive if that
        request finishes or ANY output reaches the tokenizer manager within ``timeout_s`` (a loaded engine
        queues the probe behind its own work, but keeps producing). While a weight update holds requests
        back the scheduler is legitimately busy loading: the engine then counts as hung only once the update
        has run past weight_sync.timeout_s, its own bound."""
        if self.update_started_at is not None:
            age = time.monotonic() - self.update_started_at
            if age > self.cfg.weight_sync.timeout_s:
                raise RuntimeError(f"weight update stuck for {age:.0f} s (weight_sync.timeout_s)")
            return
        t0, rid = time.time(), f"probe-{uuid.uuid4().hex}"
        task = asyncio.ensure_future(self._request([self.tokenizer.eos_token_id or 0],
                                                   {"max_new_tokens": 1, "temperature": 0.0}, rid=rid))
        try:
            while time.time() - t0 < timeout_s:
                if task.done():
                    task.result()
                    return
                if self.tm.last_receive_tstamp > t0:
                    return
                await asyncio.sleep(0.1)
            raise RuntimeError(f"no output from the engine in {timeout_s:.0f} s (hung)")
        finally:
            if not task.done():  # a probe must not linger in the request table (drain waits on it)
                task.cancel()  # its request is aborted by _request's cancellation handler
                await asyncio.wait({task}, timeout=1.0)

    # ------------------------------------------------------------------ weights
    async def _until_idle(self, mode: str) -> None:
        """Wait until the engine has no running request (drain: they finish; abort: they were aborted).
        SGLang offers no completion event for "all requests done", so this polls its request table every
        10 ms."""
        timeout_s = self.cfg.rollout.drain_timeout_s
        deadline = time.monotonic() + timeout_s
        while self.tm.rid_to_state:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: {len(self.tm.rid_to_state)} requests still running after "
                                   f"{timeout_s:.0f} s (rollout.drain_timeout_s)")
            await asyncio.sleep(0.01)

    async def _abort_running(self) -> None:
        """Abort mode: abort every running request, then wait until the engine dropped them. SGLang's own
        pause_generation(mode="abort") re-checks at 1 s intervals, which cost every abort-mode update at
        least a second whenever a request was running; this checks every 10 ms."""
        self.tm.abort_request(abort_all=True)
        await self._until_idle("abort")

    async def update(self, buckets, group_name: str, version: int, mode: str) -> float:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        t0 = time.perf_counter()
        # New requests (and aborted ones, which resample) wait for the new weights.
        self.weights_ready.clear()
        self.updates_started += 1
        self.update_started_at = time.monotonic()
        self.loading_since = None if mode == "drain" else self.update_started_at  # draining is not loading
        try:  # everything after the clear: a failed drain or pause must not leave the engine refusing work
            if mode == "drain":
                self.admitting.clear()
                await self._until_idle("drain")
                self.loading_since = time.monotonic()
            else:
                # with progress reports no request may run across a load (see the module doc): an in-flight
                # update aborts them too, and keeps their tokens
                if mode == "abort" or (mode == "inflight" and self.cfg.rollout.partial_every_s > 0):
                    self.keep_aborted = mode == "inflight" or self.cfg.rollout.partial_rollout
                    await self._abort_running()
                # retract: a request that slipped in after the abort resumes on the new weights (as inflight)
                await self.tm.pause_generation(PauseGenerationReqInput(mode="retract"))
            await weight_sync.load(self.tm, buckets, group_name, version)
            self.version = version
        finally:
            try:
                if mode != "drain":  # also after a failed pause: continuing an engine that is not paused is a no-op
                    await self.tm.continue_generation(ContinueGenerationReqInput())
            finally:
                self.weights_ready.set()
                self.admitting.set()
                self.update_started_at = self.loading_since = None
        seconds = time.perf_counter() - t0
        self.stats.updates += 1
        self.stats.update_seconds += seconds
        return seconds


class RolloutWorker:
    """The actor body: a synchronous facade (wrapped by :func:`rollout_actor_class` for Ray)."""

    def __init__(self, cfg: Config, engine_rank: int, initial_version: int = 0) -> None:
        from transformers import AutoTokenizer

        from async_dapo.rollout.engine import start_engine

        pin_threads(1)
        ec = cfg.rollout.engine.model_copy(
            update={"extra_args": {"weight_version": str(initial_version), **cfg.rollout.engine.extra_args}}
        )
        self.engine = start_engine(ec, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        # Seeded only now: SGLang draws its ports with the global `random`, and a seeded draw gives two
        # runs on one host the same ports (EADDRINUSE). Sampling has its own seed (engine.random_seed).
        seed_everything(cfg.logging.seed + 1000 + engine_rank)
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        self.session = EngineSession(cfg, engine_rank, initial_version, tokenizer, train_rows(cfg),
                                self.engine.tokenizer_manager)
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()
        self._producer = None

    def _call(self, coro, timeout: float, what: str, grace_s: float = CANCEL_GRACE_S) -> Any:
        """Run ``coro`` on the engine loop from any thread and return its result. On expiry the coroutine is
        cancelled, which aborts the engine requests it started (``EngineSession._request``), and TimeoutError names
        ``what``: a timed-out call does not keep the engine busy behind the caller's back."""
        finished = threading.Event()

        async def run():
            try:
                return await coro
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            finished.wait(grace_s)  # its requests are aborted and gone from the engine's table
            raise TimeoutError(f"engine {self.session.rank}: {what}: no result in {timeout:.0f} s") from None

    def start(self, queue, address: str, secret: bytes) -> None:
        """Connect to the queue's zmq address (messages signed with the run's ``secret``) and start
        producing groups."""
        from async_dapo.stream.transport import GroupSender

        self.session.sender = GroupSender(address, secret=secret,
                                          max_message_bytes=self.session.cfg.transport.max_message_bytes)
        self._producer = asyncio.run_coroutine_threadsafe(self.session.produce(queue), self.loop)

    def health(self, timeout_s: float) -> dict[str, float]:
        """Raise if the producer task ended or the engine shows no sign of life in ``timeout_s`` (see
        ``EngineSession.probe``); else return the stats."""
        if self._producer is not None and self._producer.done():
            raise RuntimeError(f"engine {self.session.rank}: producer ended: {self._producer.exception()!r}")
        try:
            # no grace: the probe aborts its own request, and a stuck loop would not run the cancellation
            self._call(self.session.probe(timeout_s), timeout_s + 5, "heartbeat", grace_s=0)
        except TimeoutError:  # the engine's event loop itself is stuck
            raise RuntimeError(f"the engine's event loop did not answer in {timeout_s + 5:.0f} s (hung)") from None
        return self.get_stats()

    def leave_weight_group(self, group_name: str) -> None:
        self._call(weight_sync.leave_group(self.session.tm, group_name), self.session.cfg.weight_sync.timeout_s,
                   f"leave {group_name}")

    def join_weight_group(self, master_addr: str, master_port: int, world_size: int, rank_offset: int,
                          group_name: str, backend: str) -> None:
        self._call(weight_sync.join_group(self.session.tm, master_addr, master_port, world_size, rank_offset,
                                          group_name, backend),
                   self.session.cfg.weight_sync.timeout_s, f"join {group_name}")

    def weight_dtype(self) -> str:
        """The dtype this engine holds its weights in, resolved here (the driver may be a CPU-only head that
        cannot tell what 'auto' means on this node); the learner casts the pushed weights to it."""
        ec = self.session.cfg.rollout.engine
        return engine_dtype(resolve_device(ec.device), ec.dtype)

    def update_weights(self, buckets: list, group_name: str, version: int, mode: str | None = None) -> float:
        """Receive one pushed version — ``buckets`` (weight_sync.Bucket) describe the flat broadcasts the
        learner sends meanwhile, in order — and run it. ``mode`` overrides rollout.update_mode. Returns
        seconds spent. Raises weight_sync.WeightUpdateError if SGLang refused."""
        mode = mode or self.session.cfg.rollout.update_mode
        if mode not in ("inflight", "drain", "abort"):
            raise ValueError(f"mode: unknown update mode {mode!r}")
        cfg = self.session.cfg
        drain = cfg.rollout.drain_timeout_s if mode == "drain" else 0.0
        return self._call(self.session.update(buckets, group_name, version, mode), cfg.weight_sync.timeout_s + drain,
                          f"weight update to version {version} (weight_sync.timeout_s)")

    def validate(self, rows: list[PromptRow], k: int, params: dict[str, Any]) -> dict[str, Any]:
        """This engine's share of a validation (see ``EngineSession.validate``; ``evaluate.merge_parts`` joins
        the engines' shares)."""
        return self._call(self.session.validate(rows, k, params), self.session.cfg.logging.val_timeout_s,
                          "validation (logging.val_timeout_s)")

    def get_stats(self) -> dict[str, float]:
        s = self.session.stats
        return {**s.__dict__, "version": self.session.version, "inflight": len(self.session.inflight), "pid": os.getpid(),
                "wall_seconds": time.time() - s.started_at,
                "batch_seqs": self.session.cfg.rollout.max_inflight_prompts * self.session.cfg.rollout.n}

    def push_status(self) -> dict[str, float | None]:
        """The version this engine runs and how long it has been loading the next one (None: not loading, or
        still draining): the supervisor's view of a push in flight. Answered by the actor, not the engine,
        so it comes back even when the engine's processes hang."""
        since = self.session.loading_since
        return {"version": self.session.version, "loading_s": None if since is None else time.monotonic() - since,
                "stopped": _stopped_children()}

    def shutdown(self) -> None:
        self.session.closing = True  # before the sender's pool goes: a report round may still be due
        if self._producer is not None:
            self._producer.cancel()
        for task in list(self.session.inflight):
            self.loop.call_soon_threadsafe(task.cancel)
        self.session._send_pool.shutdown(wait=False, cancel_futures=True)
        if self.session._scorer is not None:
            self.session._scorer.close()
        if self.session.sender is not None:
            self.session.sender.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.engine.shutdown()


def _stopped_children() -> list[int]:
    """PIDs of this actor's child processes (the SGLang scheduler and detokenizer, reward workers) that are
    stopped (SIGSTOP, a debugger): they make no progress whatever they were doing. Another hang (a kernel
    that never returns) leaves its process running and is not seen here."""
    import psutil

    stopped = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                stopped.append(child.pid)
        except psutil.Error:  # it ended meanwhile
            continue
    return stopped


def rollout_actor_class(cfg: Config, worker: type = RolloutWorker, **options):
    """``ray.remote`` wrapper of ``worker`` (RolloutWorker or a subclass of it) with the resources and
    environment the config asks for (``options``: extra Ray actor options, e.g. a scheduling strategy)."""
    import ray

    p = cfg.placement
    # Nothing device-specific is decided here, on the driver: the actor resolves its own device and sets
    # up SGLang's environment itself (engine.start_engine -> device.activate_sglang_env).
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return ray.remote(worker).options(
        num_cpus=p.engine_cpus, num_gpus=p.engine_gpus, max_concurrency=8,
        runtime_env={"env_vars": env}, **options,
    )
