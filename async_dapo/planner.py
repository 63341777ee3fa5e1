"""The planner: a discrete-event model of the pipeline (engines -> replay queue -> learner -> weight push), to
predict a run's throughput, idle ratios and staleness from a measured hardware profile before renting a
cluster, and to search the rollout/train split, η, the push interval and the update mode.

Pure Python + numpy (no torch, Ray or SGLang): a 60-step plan runs in about a second. docs/planning.md states
the model, what it captures and what it ignores; the summary:

* E engines, each a continuous batcher. One decode iteration advances every running sequence by one token
  and takes ``a + b·n + c·K`` seconds (n running sequences, K their context tokens), times
  ``contention.engine_slowdown`` while the learner computes. Between events n is constant and K grows by n
  per iteration, so a whole segment up to the next finish is one closed-form jump.
* Admission is replay.py's rule, ``in_window + running < (η + v + 1)·B`` with v the version the engines have
  loaded (the queue's version, advanced when EVERY engine loaded a push), at most
  ``rollout.max_inflight_prompts`` groups in flight per engine, pulled by the engine with the most room.
* A finished group costs ``per_group_s`` of engine time, then arrives: stale (v − min_version > η) or
  filtered (kept with probability ``keep_rate``) groups give their slot back; kept ones queue FIFO.
* The learner takes the B oldest queued groups (dropping those stale at its own version), trains, version
  += 1, and every k steps pushes: it waits for the previous push, loses ``learner_stall_s``, the sender takes
  ``base_s + bytes/bandwidth``, then each engine applies the update by ``rollout.update_mode``.
"""

from __future__ import annotations

import csv
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from async_dapo.config import ConfigError, read_yaml_mapping

__all__ = [
    "Contention", "EngineProfile", "LearnerProfile", "Prediction", "Profile", "ProfileError", "PushProfile",
    "Recommendation", "Shape", "TOLERANCE", "UPDATE_MODES", "Workload", "bench_row_shape", "load_profile", "markdown", "predict",
    "predicted_step_s", "profile_from_dict", "recommend", "splits_for", "validate",
]

UPDATE_MODES = ("inflight", "drain", "abort")
# validate(): a prediction is "within" the measurement when inside these (steps/s relative, the rest absolute).
TOLERANCE = {"steps_per_s": 0.15, "staleness_mean": 0.3, "learner_idle": 0.1, "rollout_idle": 0.1}
COMPARED = ("occupancy", "tail_share")  # also compared by validate(), with no target


class ProfileError(ConfigError):
    """A bad profile (or planner input): one line, ``<file>: <dotted.key>: <problem>``."""


# ------------------------------------------------------------------------------------------ the profile
class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineProfile(_Part):
    """One rollout engine's measured costs."""

    max_running_seqs: int = Field(..., ge=1, description="Sequences one engine decodes at once (batch / KV "
                                  "cap); more wait in its queue.")
    decode_base_s: float = Field(..., ge=0, description="a: fixed seconds of one decode iteration (one token "
                                 "for every running sequence).")
    decode_per_seq_s: float = Field(..., ge=0, description="b: seconds added per running sequence.")
    decode_per_ctx_token_s: float = Field(..., ge=0, description="c: seconds added per token of context held by "
                                          "the running sequences (attention reads).")
    prefill_per_token_s: float = Field(..., ge=0, description="Seconds per prompt token prefilled (one prefill "
                                       "per group: its G samples share the prompt).")
    per_group_s: float = Field(..., ge=0, description="Host seconds per finished group (detokenize, score, "
                               "send) during which the engine does not decode.")
    devices: int = Field(1, ge=1, description="Accelerators one engine occupies (tensor parallel size); "
                         "recommend() splits total devices by it.")

    @model_validator(mode="after")
    def _iterations_take_time(self) -> "EngineProfile":
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("decode_base_s + decode_per_seq_s must be > 0: a decode iteration takes time")
        return self


class LearnerProfile(_Part):
    """The learner's measured step cost."""

    step_base_s: float = Field(..., ge=0, description="Fixed seconds of one training step (optimizer, "
                               "collectives that do not scale with tokens).")
    per_token_s: float = Field(..., ge=0, description="Seconds per trained token (prompt + response) per "
                               "epoch on ONE rank.")
    scaling_efficiency: float = Field(1.0, gt=0, le=1, description="R ranks run R × this times faster on the "
                                      "token part.")
    devices_per_rank: int = Field(1, ge=1, description="Accelerators one learner rank occupies.")


class PushProfile(_Part):
    """One weight push (learner -> every engine)."""

    base_s: float = Field(..., ge=0, description="Fixed seconds of one push at the sender (snapshot, gather, "
                          "control plane).")
    bytes: float = Field(..., ge=0, description="Bytes pushed per update.")
    bandwidth_bytes_per_s: float = Field(..., gt=0, description="Bytes per second of the broadcast.")
    engine_pause_s: float = Field(..., ge=0, description="Seconds an engine does not decode per update (the "
                                  "load); inflight mode also re-prefills the running context at "
                                  "prefill_per_token_s.")
    learner_stall_s: float = Field(0.0, ge=0, description="Learner seconds lost per push (before it trains on).")


class Contention(_Part):
    """Slowdowns when the roles share hardware (1.0 = separate devices)."""

    engine_slowdown: float = Field(1.0, gt=0, description="Multiplier on engine time while the learner "
                                   "computes (shared CPU cores).")
    learner_slowdown: float = Field(1.0, gt=0, description="Multiplier on learner step time while any engine "
                                    "decodes.")


class Lognormal(_Part):
    median: float = Field(..., gt=0, description="Median response length (tokens).")
    sigma: float = Field(..., ge=0, description="Standard deviation of ln(length).")


class Workload(_Part):
    """What is generated: prompt length, response lengths, how many groups dynamic sampling keeps."""

    prompt_tokens: float = Field(..., ge=0, description="Mean prompt length (tokens).")
    response_lengths: list[int] | None = Field(None, min_length=1, description="An empirical sample of "
                                               "response lengths (resampled); or give lognormal.")
    lognormal: Lognormal | None = Field(None, description="Parametric response lengths; or give "
                                        "response_lengths. Lengths are capped at rollout.max_response_length.")
    keep_rate: float = Field(..., gt=0, le=1, description="Fraction of finished groups dynamic sampling keeps "
                             "(mixed outcome); 1.0 = off.")

    @model_validator(mode="after")
    def _one_length_model(self) -> "Workload":
        if (self.response_lengths is None) == (self.lognormal is None):
            raise ValueError("give exactly one of response_lengths and lognormal")
        if self.response_lengths is not None and min(self.response_lengths) < 1:
            raise ValueError("response_lengths must all be >= 1")
        return self


class Profile(_Part):
    """A measured hardware + workload profile (YAML; see docs/planning.md)."""

    name: str = Field(..., description="Short name of the profile.")
    hardware: str = Field(..., description="Free text: the machines the figures were measured on.")
    sources: dict[str, str] = Field(default_factory=dict, description="figure name -> citation or how it "
                                    "was measured.")
    engine: EngineProfile
    learner: LearnerProfile
    push: PushProfile
    contention: Contention = Field(default_factory=Contention)
    workload: Workload


def _profile_error(where: str, exc: ValidationError) -> ProfileError:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return ProfileError(f"{where}: {key}: {msg}{more}" if key else f"{where}: {msg}{more}")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile YAML; ProfileError naming the file and the field on any fault."""
    return profile_from_dict(read_yaml_mapping(path, "profile", ProfileError), str(path))


def profile_from_dict(tree: dict[str, Any], where: str = "profile") -> Profile:
    try:
        return Profile.model_validate(tree)
    except ValidationError as exc:
        raise _profile_error(where, exc) from None


# ---------------------------------------------------------------------------------------- the run shape
@dataclass(frozen=True)
class Shape:
    """The run's shape: what a Config says about batch, concurrency, staleness and placement."""

    B: int  # algorithm.train_batch_groups
    G: int  # rollout.n
    eta: int  # replay.max_staleness
    max_inflight_prompts: int  # per rollout actor (engine)
    update_mode: str = "inflight"
    max_response_length: int = 1 << 20
    every_k_steps: int = 1
    epochs: int = 1
    num_engines: int = 1
    learner_ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("B", "G", "max_inflight_prompts", "max_response_length", "every_k_steps", "epochs",
                     "num_engines", "learner_ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"Shape.{name} must be >= 1, got {getattr(self, name)}")
        if self.eta < 0:
            raise ValueError(f"Shape.eta must be >= 0, got {self.eta}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"Shape.update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")

    @classmethod
    def from_config(cls, cfg) -> "Shape":
        return cls(B=cfg.algorithm.train_batch_groups, G=cfg.rollout.n, eta=cfg.replay.max_staleness,
                   max_inflight_prompts=cfg.rollout.max_inflight_prompts, update_mode=cfg.rollout.update_mode,
                   max_response_length=cfg.rollout.max_response_length,
                   every_k_steps=cfg.weight_sync.every_k_steps, epochs=cfg.learner.epochs,
                   num_engines=cfg.placement.num_engines, learner_ranks=cfg.placement.learner_ranks)

    def with_(self, **changes) -> "Shape":
        return replace(self, **changes)

    def synchronous(self) -> "Shape":
        """The same plan at η = 0 (which needs every_k_steps = 1): the baseline of the speedup."""
        return replace(self, eta=0, every_k_steps=1)


# ------------------------------------------------------------------------------------------ the output
@dataclass
class Prediction:
    """Steady-state figures of one plan (the steps after the warm-up)."""

    steps_per_s: float
    samples_per_s: float  # trained samples: steps/s · B · G
    gen_tokens_per_s: float  # every generated token, wasted ones included
    trained_tokens_per_s: float  # response tokens trained per second (as tools/bench/throughput.py)
    learner_idle: float  # learner waiting for a batch / wall
    rollout_idle: float  # engine with no group in flight / wall, mean over engines
    occupancy: float  # time-weighted running sequences / (max_inflight_prompts · G), mean over engines
    tail_share: float  # engine decoding with 0 < n < max_inflight_prompts · G / 2 running, / wall
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, int]
    dropped_stale: int
    dropped_filtered: int
    wasted_tokens: int  # tokens generated and thrown away (abort mode)
    step_s: float
    push_s: float  # the sender's time per push
    speedup: float | None = None  # over the same plan at η = 0

    def row(self) -> dict[str, float]:
        """Flat dict; names as tools/bench/throughput.py's COLUMNS where they exist."""
        out = {k: v for k, v in vars(self).items() if k != "staleness_hist"}
        out["speedup"] = float("nan") if self.speedup is None else self.speedup
        return out


# ------------------------------------------------------------------------------------------ simulation
_READY, _LEARNER = 0, 1


@dataclass
class _Engine:
    idx: int
    version: int = 0
    it: int = 0  # decode iterations done
    n: int = 0  # running sequences
    sum_p: float = 0.0  # their prompt tokens
    sum_start: int = 0  # their start iterations: K = sum_p + n·it − sum_start
    heap: list = field(default_factory=list)  # (finish iteration, sid) of the running sequences
    running: set = field(default_factory=set)
    waiting: deque = field(default_factory=deque)  # admitted sequences beyond max_running_seqs
    work: deque = field(default_factory=deque)  # (seconds, kind, payload): non-decode engine time
    inflight: int = 0  # groups admitted and not yet sent
    state: str = "idle"  # idle | decode | work | load (paused in a weight update)
    token: int = 0  # invalidates scheduled events
    seg: tuple = (0.0, 0, 0.0, 1.0)  # decode segment: (t0, iterations, A, slowdown) / work: (kind, payload)
    update: dict | None = None  # the weight update being applied
    last_t: float = 0.0
    idle: float = 0.0
    occ: float = 0.0
    tail: float = 0.0
    gen: int = 0
    wasted: int = 0

    def context(self) -> float:
        return self.sum_p + self.n * self.it - self.sum_start


class _Sim:
    """One plan, simulated event by event (see the module docstring and docs/planning.md)."""

    def __init__(self, profile: Profile, shape: Shape, steps: int, warmup: int, seed: int) -> None:
        if not 0 <= warmup < steps - 1:
            raise ValueError(f"need 0 <= warmup < steps - 1, got warmup {warmup}, steps {steps}")
        self.p, self.s, self.steps, self.warmup = profile, shape, steps, warmup
        self.rng = np.random.default_rng(seed)
        self.events: list = []
        self.serial = 0
        self.engines = [_Engine(i) for i in range(shape.num_engines)]
        self.seqs: dict[int, list] = {}  # sid -> [gid, length, start iteration, version]
        self.groups: dict[int, dict] = {}
        self.next_id = 0
        self.queue: deque = deque()  # accepted groups: (min_version, trained tokens, response tokens)
        self.queue_min = math.inf  # lowest min_version queued (skip the stale scan when nothing can be stale)
        self.in_window = self.running = 0
        self.qv = self.lv = 0  # the engines' loaded version (admission) / the learner's
        self.step, self.lstate, self.ltoken, self.llast = 0, "wait", 0, 0.0
        self.lwork = self.lrate = 0.0
        self.lidle, self.n_decoding = 0.0, 0
        self.push: dict[str, Any] | None = None  # the push in flight: version, start, engines entered/loaded
        self.push_durations: list[float] = []
        self.stale_trained: list[int] = []
        self.counts = {"dropped_stale": 0, "dropped_filtered": 0, "trained_resp": 0}
        self.snap: dict[str, Any] = {}
        self.half = shape.max_inflight_prompts * shape.G / 2

    # ---------------------------------------------------------------- event plumbing
    def _at(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.serial += 1
        heapq.heappush(self.events, (t, self.serial, kind, a, b))

    def run(self) -> Prediction:
        self._admit(0.0)
        self._learner_take(0.0)
        while self.step < self.steps:
            if not self.events:
                raise RuntimeError("the plan stalled: no event left before the last step (a bug in the model)")
            t, _, kind, a, b = heapq.heappop(self.events)
            if kind == _READY:
                if b == self.engines[a].token:
                    self._engine_ready(self.engines[a], t)
            elif a == self.ltoken:
                self._learner_event(t)
        return self._result()

    # ---------------------------------------------------------------- lengths and groups
    def _lengths(self, n: int) -> np.ndarray:
        w = self.p.workload
        if w.response_lengths is not None:
            raw = self.rng.choice(np.asarray(w.response_lengths), size=n)
        else:
            raw = np.rint(np.exp(math.log(w.lognormal.median) + w.lognormal.sigma * self.rng.standard_normal(n)))
        return np.clip(raw, 1, self.s.max_response_length).astype(np.int64)

    def _admit(self, t: float) -> None:
        """replay.py's admission rule; each group goes to the engine with the most room (pull-style)."""
        s = self.s
        room = (s.eta + self.qv + 1) * s.B - self.in_window - self.running
        while room > 0:
            best = None
            for e in self.engines:
                if (e.update is None or e.update["mode"] != "drain") and e.inflight < s.max_inflight_prompts:
                    if best is None or e.inflight < best.inflight:
                        best = e
            if best is None:
                return
            self._acc(best, t)
            gid, self.next_id = self.next_id, self.next_id + 1
            sids = list(range(self.next_id, self.next_id + s.G))
            self.next_id += s.G
            for sid, length in zip(sids, self._lengths(s.G).tolist()):
                self.seqs[sid] = [gid, length, 0, 0]
            self.groups[gid] = {"sids": sids, "left": s.G, "prefilled": False}
            best.waiting.extend(sids)
            best.inflight += 1
            self.running += 1
            room -= 1
            self._poke(best, t)

    # ---------------------------------------------------------------- engines
    def _acc(self, e: _Engine, t: float) -> None:
        """Integrate the engine's state since its last change (idle, occupancy, tail)."""
        dt = t - e.last_t
        if dt > 0:
            if e.inflight == 0:
                e.idle += dt
            e.occ += e.n * dt
            if e.state == "decode" and 0 < e.n < self.half:
                e.tail += dt
        e.last_t = t

    def _slow(self) -> float:
        return self.p.contention.engine_slowdown if self.lstate == "train" else 1.0

    def _poke(self, e: _Engine, t: float) -> None:
        """Something changed for ``e``: an idle engine looks now, a decoding one at its next iteration."""
        if e.state == "idle":
            e.token += 1
            self._at(t, _READY, e.idx, e.token)
        elif e.state == "decode":
            t0, m, A, slow = e.seg
            j = self._iterations_by(e, t - t0, m, A, slow)
            if j < m:
                e.seg = (t0, j, A, slow)
                e.token += 1
                self._at(t0 + self._decode_s(e, j, A, slow), _READY, e.idx, e.token)

    def _decode_s(self, e: _Engine, m: int, A: float, slow: float) -> float:
        """Seconds of m iterations from now: Σ_i (A + c·n·i) with A = a + b·n + c·K."""
        c = self.p.engine.decode_per_ctx_token_s
        return slow * (m * A + c * e.n * m * (m - 1) / 2)

    def _iterations_by(self, e: _Engine, tau: float, m: int, A: float, slow: float) -> int:
        """The fewest iterations (>= 1: the running one completes) whose time reaches ``tau``."""
        q = self.p.engine.decode_per_ctx_token_s * e.n / 2
        x = tau / slow
        if q > 0:
            lin = A - q
            j = (-lin + math.sqrt(lin * lin + 4 * q * x)) / (2 * q)
        else:
            j = x / A
        j = max(1, math.ceil(j - 1e-9))
        while j > 1 and self._decode_s(e, j - 1, A, slow) >= tau:  # float safety on the ceiling
            j -= 1
        return min(j, m)

    def _set_state(self, e: _Engine, state: str, t: float) -> None:
        was = e.state == "decode"
        e.state = state
        if was != (state == "decode"):
            self.n_decoding += 1 if state == "decode" else -1
            if (self.n_decoding == 0 or (self.n_decoding == 1 and state == "decode")) and \
                    self.p.contention.learner_slowdown != 1.0:
                self._learner_rerate(t)

    def _engine_ready(self, e: _Engine, t: float) -> None:
        self._acc(e, t)
        if e.state == "decode":
            self._end_decode(e)
        elif e.state in ("work", "load"):  # a load ends with its resume
            self._end_work(e, t)
        if e.update is not None and e.update["stage"] == "new":
            self._start_update(e, t)
        if e.update is None or e.update["stage"] == "drain":
            self._fill(e)
        self._next(e, t)

    def _end_decode(self, e: _Engine) -> None:
        _, m, _, _ = e.seg
        e.it += m
        e.gen += e.n * m
        while e.heap and e.heap[0][0] <= e.it:
            _, sid = heapq.heappop(e.heap)
            e.running.discard(sid)
            gid, length, start, _ = self.seqs[sid]
            e.n -= 1
            e.sum_p -= self.p.workload.prompt_tokens
            e.sum_start -= start
            g = self.groups[gid]
            g["left"] -= 1
            if g["left"] == 0:
                e.work.append((self.p.engine.per_group_s, "group", gid))

    def _fill(self, e: _Engine) -> None:
        """Start waiting sequences while the engine has room; a group's first start costs its prefill."""
        prefill = 0.0
        while e.waiting and e.n < self.p.engine.max_running_seqs:
            sid = e.waiting.popleft()
            seq = self.seqs[sid]
            seq[2], seq[3] = e.it, e.version
            heapq.heappush(e.heap, (e.it + seq[1], sid))
            e.running.add(sid)
            e.n += 1
            e.sum_p += self.p.workload.prompt_tokens
            e.sum_start += e.it
            g = self.groups[seq[0]]
            if not g["prefilled"]:
                g["prefilled"] = True
                prefill += self.p.workload.prompt_tokens * self.p.engine.prefill_per_token_s
        if prefill > 0:
            e.work.append((prefill, "prefill", 0))

    def _next(self, e: _Engine, t: float) -> None:
        """Choose the engine's next action: pending work first, then decoding, else idle; an engine whose
        update waits (paused, or drained) with no work left enters the load."""
        up = e.update
        if up is not None and not e.work and (up["stage"] == "pausing" or (
                up["stage"] == "drain" and e.n == 0 and not e.waiting)):
            self._enter_load(e, t)
            return
        if e.work:
            seconds, kind, payload = e.work.popleft()
            seconds *= self._slow()
            self._set_state(e, "work", t)
            e.seg = (kind, payload)
            e.token += 1
            self._at(t + seconds, _READY, e.idx, e.token)
        elif e.n > 0 and (up is None or up["stage"] == "drain"):
            slow, eng = self._slow(), self.p.engine
            A = eng.decode_base_s + eng.decode_per_seq_s * e.n + eng.decode_per_ctx_token_s * e.context()
            m = e.heap[0][0] - e.it
            self._set_state(e, "decode", t)
            e.seg = (t, m, A, slow)
            e.token += 1
            self._at(t + self._decode_s(e, m, A, slow), _READY, e.idx, e.token)
        else:
            self._set_state(e, "idle", t)

    def _end_work(self, e: _Engine, t: float) -> None:
        kind, payload = e.seg
        if kind == "group":
            self._arrive(e, payload, t)
        elif kind == "resume":
            self._resume(e, t)

    # ---------------------------------------------------------------- arrival and the queue
    def _arrive(self, e: _Engine, gid: int, t: float) -> None:
        g = self.groups.pop(gid)
        seqs = [self.seqs.pop(sid) for sid in g["sids"]]
        e.inflight -= 1
        self.running -= 1
        min_version = min(s[3] for s in seqs)
        if self.qv - min_version > self.s.eta:
            self.counts["dropped_stale"] += 1
        elif self.p.workload.keep_rate < 1.0 and self.rng.random() >= self.p.workload.keep_rate:
            self.counts["dropped_filtered"] += 1
        else:
            resp = sum(s[1] for s in seqs)
            self.queue.append((min_version, resp + self.s.G * self.p.workload.prompt_tokens, resp))
            self.queue_min = min(self.queue_min, min_version)
            self.in_window += 1
        self._admit(t)
        self._learner_take(t)

    # ---------------------------------------------------------------- learner
    def _acc_learner(self, t: float) -> None:
        if self.lstate == "wait":
            self.lidle += t - self.llast
        elif self.lstate == "train":
            self.lwork -= (t - self.llast) * self.lrate
        self.llast = t

    def _learner_rate(self) -> float:
        return 1.0 / self.p.contention.learner_slowdown if self.n_decoding else 1.0

    def _learner_rerate(self, t: float) -> None:
        if self.lstate != "train":
            return
        self._acc_learner(t)
        self.lrate = self._learner_rate()
        self.ltoken += 1
        self._at(t + max(self.lwork, 0.0) / self.lrate, _LEARNER, self.ltoken)

    def _learner_take(self, t: float) -> None:
        """take_batch at the learner's version: drop stale queued groups, then the B oldest or nothing."""
        if self.lstate != "wait":
            return
        eta, B = self.s.eta, self.s.B
        if self.lv - self.queue_min > eta:
            fresh = deque(g for g in self.queue if self.lv - g[0] <= eta)
            self.counts["dropped_stale"] += len(self.queue) - len(fresh)
            self.in_window -= len(self.queue) - len(fresh)
            self.queue = fresh
            self.queue_min = min((g[0] for g in fresh), default=math.inf)
            self._admit(t)
        if len(self.queue) < B:
            return
        batch = [self.queue.popleft() for _ in range(B)]
        self.queue_min = min((g[0] for g in self.queue), default=math.inf)
        if self.step >= self.warmup:
            self.stale_trained.extend(self.lv - g[0] for g in batch)
        self.counts["trained_resp"] += sum(g[2] for g in batch)
        lp = self.p.learner
        tokens = sum(g[1] for g in batch)
        self._learner_to(t, "train")
        self.lwork = lp.step_base_s + self.s.epochs * lp.per_token_s * tokens / (
            self.s.learner_ranks * lp.scaling_efficiency)
        self.lrate = self._learner_rate()
        self.ltoken += 1
        self._at(t + self.lwork / self.lrate, _LEARNER, self.ltoken)

    def _learner_to(self, t: float, state: str) -> None:
        """Change the learner's state; entering or leaving training changes the engines' speed."""
        self._acc_learner(t)
        was = self.lstate == "train"
        self.lstate = state
        if was != (state == "train") and self.p.contention.engine_slowdown != 1.0:
            for e in self.engines:
                if e.state == "decode":
                    self._poke(e, t)

    def _learner_event(self, t: float) -> None:
        """A training step or a push stall ended."""
        if self.lstate == "stall":
            self._start_push(t)
            self._learner_to(t, "wait")
            self._learner_take(t)
            return
        self._learner_to(t, "between")
        self.lv += 1
        self.step += 1
        if self.step == self.warmup:
            self.snap["w"] = self._snapshot(t)
        if self.step == self.steps:
            self.snap["end"] = self._snapshot(t)
            return
        if self.step % self.s.every_k_steps:
            self._learner_to(t, "wait")
            self._learner_take(t)
        elif self.push is not None:  # the loop waits for the previous push before it pushes again
            self._learner_to(t, "push_wait")
        else:
            self._stall(t)

    def _stall(self, t: float) -> None:
        self._learner_to(t, "stall")
        self.ltoken += 1
        self._at(t + self.p.push.learner_stall_s, _LEARNER, self.ltoken)

    # ---------------------------------------------------------------- weight push
    def _start_push(self, t: float) -> None:
        """The sender starts (rollout.py's update() is called on every engine now): inflight and abort
        engines pause at their next iteration, drain engines stop admitting and finish what they run."""
        self.push = {"version": self.lv, "t0": t, "entered": 0, "loaded": 0, "last_enter": t}
        for e in self.engines:
            e.update = {"version": self.lv, "mode": self.s.update_mode, "stage": "new"}
            self._poke(e, t)

    def _start_update(self, e: _Engine, t: float) -> None:
        up = e.update
        if up["mode"] == "drain":
            up["stage"] = "drain"
            return
        up["stage"] = "pausing"  # no decoding from here; queued work (scoring) finishes first
        if up["mode"] == "abort":
            up["refill"] = self._abort_running(e, up["version"]) * self.p.workload.prompt_tokens

    def _enter_load(self, e: _Engine, t: float) -> None:
        """``e`` waits in the load. Once every engine is in, the broadcast ends at max(start + base_s, last
        one in) + bytes/bandwidth; each engine resumes at the later of that and its entry + engine_pause_s."""
        self._set_state(e, "load", t)
        e.update["stage"], e.update["entered"] = "load", t
        push = self.push
        push["entered"] += 1
        push["last_enter"] = max(push["last_enter"], t)
        if push["entered"] < len(self.engines):
            return
        pp = self.p.push
        land = max(push["t0"] + pp.base_s, push["last_enter"]) + pp.bytes / pp.bandwidth_bytes_per_s
        for other in self.engines:
            other.seg = ("resume", 0)
            other.token += 1
            self._at(max(land, other.update["entered"] + pp.engine_pause_s), _READY, other.idx, other.token)

    def _resume(self, e: _Engine, t: float) -> None:
        """The engine runs the new version; inflight re-prefills the running context (retract dropped the
        KV cache: each group's prompt once, plus the generated tokens), abort prefills the restarted groups."""
        up = e.update
        e.version, e.update = up["version"], None
        if up["mode"] == "inflight":
            groups = len({self.seqs[sid][0] for sid in e.running})
            up["refill"] = groups * self.p.workload.prompt_tokens + e.n * e.it - e.sum_start
        if up.get("refill", 0) > 0:
            e.work.appendleft((up["refill"] * self.p.engine.prefill_per_token_s, "prefill", 0))
        self.push["loaded"] += 1
        if self.push["loaded"] == len(self.engines):
            self._push_done(t)
        else:
            self._admit(t)  # an engine that drained may take groups again

    def _abort_running(self, e: _Engine, version: int) -> int:
        """Abort mode: every running sequence's tokens are thrown away; it restarts from scratch (a new
        sample, so a new length) at ``version``. Returns the groups that need a prefill again."""
        groups, sids = set(), sorted(e.running)
        lengths = self._lengths(len(sids)).tolist()
        e.heap = []
        for sid, length in zip(sids, lengths):
            seq = self.seqs[sid]
            e.wasted += e.it - seq[2]
            seq[1], seq[2], seq[3] = length, e.it, version
            e.heap.append((e.it + length, sid))
            groups.add(seq[0])
        heapq.heapify(e.heap)
        e.sum_start = e.n * e.it
        return len(groups)

    def _push_done(self, t: float) -> None:
        """Every engine loaded the push: the queue's version advances (set_version), admission widens."""
        self.qv = self.push["version"]
        if self.step >= self.warmup:  # steady state only, like every other figure
            self.push_durations.append(t - self.push["t0"])
        self.push = None
        self._admit(t)
        if self.lstate == "push_wait":
            self._stall(t)

    # ---------------------------------------------------------------- figures
    def _snapshot(self, t: float) -> dict[str, Any]:
        for e in self.engines:
            self._acc(e, t)
        self._acc_learner(t)
        sums = {k: sum(getattr(e, k) for e in self.engines) for k in ("idle", "occ", "tail", "gen", "wasted")}
        return {"t": t, "lidle": self.lidle, **sums, **self.counts}

    def _result(self) -> Prediction:
        s = self.s
        a, b = self.snap.get("w") or self._zero(), self.snap["end"]
        wall = b["t"] - a["t"]
        d = {k: b[k] - a[k] for k in b}
        per_s = (self.steps - self.warmup) / wall
        engines_wall = wall * len(self.engines)
        hist: dict[int, int] = {}
        for value in self.stale_trained:
            hist[value] = hist.get(value, 0) + 1
        return Prediction(
            steps_per_s=per_s, samples_per_s=per_s * s.B * s.G, gen_tokens_per_s=d["gen"] / wall,
            trained_tokens_per_s=d["trained_resp"] / wall, learner_idle=d["lidle"] / wall,
            rollout_idle=d["idle"] / engines_wall, occupancy=d["occ"] / (engines_wall * s.max_inflight_prompts * s.G),
            tail_share=d["tail"] / engines_wall, staleness_mean=float(np.mean(self.stale_trained)),
            staleness_max=int(max(self.stale_trained)), staleness_hist=dict(sorted(hist.items())),
            dropped_stale=int(d["dropped_stale"]), dropped_filtered=int(d["dropped_filtered"]),
            wasted_tokens=int(d["wasted"]), step_s=1.0 / per_s, push_s=float(np.mean(self.push_durations or [0.0])))

    def _zero(self) -> dict[str, Any]:
        return {"t": 0.0, "lidle": 0.0, "idle": 0.0, "occ": 0.0, "tail": 0.0, "gen": 0, "wasted": 0,
                **{k: 0 for k in self.counts}}


# ------------------------------------------------------------------------------------------ public API
def predict(profile: Profile, shape: Shape, steps: int = 60, warmup: int = 10, seed: int = 0,
            sync_baseline: bool = True) -> Prediction:
    """Simulate ``steps`` training steps and report the steady state after ``warmup`` (the benchmark's
    10 of 60 by default). Deterministic given ``seed``. ``sync_baseline``: also simulate the same plan at
    η = 0 for ``speedup``."""
    pred = _Sim(profile, shape, steps, warmup, seed).run()
    if sync_baseline:
        sync = shape.synchronous()
        base = pred if sync == shape else _Sim(profile, sync, steps, warmup, seed).run()
        pred.speedup = pred.steps_per_s / base.steps_per_s
    return pred


def predicted_step_s(profile_path: str | Path, cfg) -> float:
    """Predicted steady-state seconds per step of the run ``cfg`` describes, on the profile at
    ``profile_path`` (for the end-of-run table: predicted against measured)."""
    return predict(load_profile(profile_path), Shape.from_config(cfg), sync_baseline=False).step_s


@dataclass
class Recommendation:
    """recommend()'s search: every plan tried (best samples/s first) and the best one within the bound."""

    rows: list[dict[str, Any]]
    best: dict[str, Any] | None
    seconds: float = 0.0


def splits_for(profile: Profile, total_gpus: int, max_splits: int = 7) -> list[tuple[int, int]]:
    """(engines, learner ranks) that use exactly ``total_gpus``; at most ``max_splits`` of them, spread evenly
    over the rollout share (the search's cost grows with each)."""
    ed, rd = profile.engine.devices, profile.learner.devices_per_rank
    ok = [(e, (total_gpus - e * ed) // rd) for e in range(1, total_gpus // ed + 1)
          if total_gpus - e * ed >= rd and (total_gpus - e * ed) % rd == 0]
    if not ok:
        raise ProfileError(f"--total-gpus {total_gpus}: no split into engines of {ed} and learner ranks of {rd} "
                           "devices uses exactly that many")
    if len(ok) <= max_splits:
        return ok
    picks = np.unique(np.linspace(0, len(ok) - 1, max_splits + 2).round().astype(int)[1:-1])
    return [ok[i] for i in picks]


def _plan(shape: Shape, eta: int, k: int, mode: str) -> Shape:
    """One point of the grid; the per-engine cap is raised to ⌈(η + 1)·B / E⌉ where smaller, so that
    admission, not the cap, bounds each η (as tools/bench/throughput.py sets it)."""
    cap = max(shape.max_inflight_prompts, math.ceil((eta + 1) * shape.B / shape.num_engines))
    return shape.with_(eta=eta, every_k_steps=k, update_mode=mode, max_inflight_prompts=cap)


def _grid(etas, ks, modes) -> list[tuple[int, int, str]]:
    """(η, k, mode) with k <= η + 1 (the config's rule) and one η = 0 point: no request is in flight when
    a synchronous update lands, so the mode does not matter there."""
    return [(eta, k, mode) for eta in etas for k in ks if k <= eta + 1
            for mode in (modes if eta > 0 else modes[:1])]


class _Search:
    """recommend()'s plans, each simulated once (a dict keyed by split and grid point)."""

    def __init__(self, profile: Profile, shape: Shape, steps: int, warmup: int, seed: int) -> None:
        self.profile, self.shape, self.steps, self.warmup, self.seed = profile, shape, steps, warmup, seed
        self.rows: dict[tuple, dict[str, Any]] = {}

    def run(self, split: tuple[int, int], point: tuple[int, int, str]) -> dict[str, Any]:
        key = (split, point)
        if key not in self.rows:
            at = self.shape.with_(num_engines=split[0], learner_ranks=split[1])
            pred = predict(self.profile, _plan(at, *point), self.steps, self.warmup, self.seed, sync_baseline=False)
            self.rows[key] = {"engines": split[0], "learner_ranks": split[1], "eta": point[0],
                              "every_k_steps": point[1], "update_mode": point[2], **pred.row()}
        return self.rows[key]

    def best(self, keys, n: int) -> list:
        return sorted(keys, key=lambda key: -self.rows[key]["samples_per_s"])[:n]


def recommend(profile: Profile, shape: Shape, total_gpus: int | None = None, etas=(0, 1, 2, 4, 8),
              ks=(1, 2, 4), modes=UPDATE_MODES, steps: int = 20, warmup: int = 4, seed: int = 0,
              max_mean_staleness: float | None = None, max_splits: int = 7, refine: int | None = 2) -> Recommendation:
    """Search the rollout/train split (``total_gpus`` = engines × engine.devices + ranks ×
    learner.devices_per_rank; None: the shape's own split), η, every_k_steps and update_mode.

    Each plan is a shorter simulation (``steps`` 20, ``warmup`` 4). With ``refine`` = r the search is staged
    to stay within about a minute on a large run: every split at the shape's own (η, k, mode) (clamped to
    the grid), then every (η, k) at the shape's mode on the r fastest splits, then every mode at the r
    fastest (η, k) of those; ``refine=None`` simulates the full grid on every split. Rows are sorted by
    samples/s, each with its speedup over η = 0 at the same split; ``best`` is the fastest whose mean
    staleness is within ``max_mean_staleness``."""
    import time

    t0 = time.perf_counter()
    splits = [(shape.num_engines, shape.learner_ranks)] if total_gpus is None else \
        splits_for(profile, total_gpus, max_splits)
    search, grid = _Search(profile, shape, steps, warmup, seed), _grid(etas, ks, modes)
    mode = shape.update_mode if shape.update_mode in modes else modes[0]
    if refine is None:
        for split in splits:
            for point in grid:
                search.run(split, point)
    else:
        own = min(grid, key=lambda p: (abs(p[0] - shape.eta), abs(p[1] - shape.every_k_steps), p[2] != mode))
        top = search.best([(split, own) for split in splits if search.run(split, own)], refine)
        for split, _ in top:
            for point in (p for p in grid if p[2] == mode or p[0] == 0):
                search.run(split, point)
        for split, (eta, k, _) in search.best([key for key in search.rows if key[0] in {s for s, _ in top}],
                                              refine):
            for m in (modes if eta > 0 else modes[:1]):
                search.run(split, (eta, k, m))
    return _ranked(search, grid, max_mean_staleness, time.perf_counter() - t0)


def _ranked(search: _Search, grid, max_mean_staleness: float | None, seconds: float) -> Recommendation:
    """Rows with their speedup over η = 0 at the same split (simulated if the search had not), fastest first."""
    sync_point = next((p for p in grid if p[0] == 0), None)
    if sync_point is not None:
        for split in {key[0] for key in search.rows}:
            search.run(split, sync_point)
    for (split, _), row in search.rows.items():
        sync = search.rows[(split, sync_point)]["steps_per_s"] if sync_point else float("nan")
        row["speedup"] = row["steps_per_s"] / sync
    rows = sorted(search.rows.values(), key=lambda r: -r["samples_per_s"])
    bound = math.inf if max_mean_staleness is None else max_mean_staleness
    best = next((r for r in rows if r["staleness_mean"] <= bound), None)
    return Recommendation(rows, best, seconds)


def bench_row_shape(shape: Shape) -> Callable[[dict[str, str]], Shape]:
    """How tools/bench/throughput.py sets each mode: η from the row, rollout.max_inflight_prompts =
    (η + 1)·B, the row's update_mode if it has one (else the shape's); every_k_steps kept within η + 1."""
    def for_row(row: dict[str, str]) -> Shape:
        eta = int(float(row["eta"]))
        return shape.with_(eta=eta, max_inflight_prompts=(eta + 1) * shape.B,
                           every_k_steps=min(shape.every_k_steps, eta + 1),
                           update_mode=row.get("update_mode") or shape.update_mode)
    return for_row


def _read_table(table_csv: str | Path) -> list[dict[str, str]]:
    try:
        with open(table_csv, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise ProfileError(f"{table_csv}: table not found") from None
    need = {"eta", "steps_per_s"}
    if not rows or need - set(rows[0]):
        raise ProfileError(f"{table_csv}: needs rows with columns {sorted(need)} (tools/bench/throughput.py's "
                           "throughput.csv)")
    return rows


def validate(profile: Profile, table_csv: str | Path, shape_for_row: Shape | Callable[[dict[str, str]], Shape],
             steps: int = 60, warmup: int = 10, seed: int = 0, measured_keep: bool = False) -> list[dict[str, Any]]:
    """Predict every row of a benchmark CSV (columns mode, eta, optionally update_mode; measured steps_per_s,
    staleness_mean, learner_idle, rollout_idle) and compare: per figure the prediction, the measurement,
    the error (relative for steps/s, absolute for the rest) and whether it is within :data:`TOLERANCE`
    (±15 % / ±0.3 / ±0.1 / ±0.1). ``shape_for_row``: a callable, or a Shape mapped as :func:`bench_row_shape`.
    ``measured_keep``: a diagnostic, not a validation: each row is predicted with the keep rate that row
    measured (its ``keep_rate`` column) instead of the profile's, to tell a drifting workload from a wrong
    pipeline model."""
    to_shape = bench_row_shape(shape_for_row) if isinstance(shape_for_row, Shape) else shape_for_row
    out = []
    for row in _read_table(table_csv):
        shape, used = to_shape(row), profile
        if measured_keep and row.get("keep_rate") not in (None, ""):
            used = profile.model_copy(update={"workload": profile.workload.model_copy(
                update={"keep_rate": float(row["keep_rate"])})})
        pred = predict(used, shape, steps, warmup, seed, sync_baseline=False).row()
        res: dict[str, Any] = {"mode": row.get("mode", ""), "eta": shape.eta, "update_mode": shape.update_mode}
        oks = []
        for key, tol in TOLERANCE.items():
            if row.get(key) in (None, ""):
                continue
            measured = float(row[key])
            err = (pred[key] - measured) / measured if key == "steps_per_s" else pred[key] - measured
            res.update({f"{key}_pred": pred[key], f"{key}_meas": measured, f"{key}_err": err,
                        f"{key}_ok": abs(err) <= tol})
            oks.append(abs(err) <= tol)
        for key in COMPARED:
            if row.get(key) not in (None, ""):
                res.update({f"{key}_pred": pred[key], f"{key}_meas": float(row[key]),
                            f"{key}_err": pred[key] - float(row[key])})
        res["ok"] = all(oks)
        out.append(res)
    return out


def markdown(rows: list[dict[str, Any]], columns: list[str], fmt: dict[str, str] | None = None) -> str:
    """A markdown table of ``rows`` (floats with ``fmt[column]``, default 4 significant digits)."""
    fmt = fmt or {}

    def cell(col: str, value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "**no**"
        if isinstance(value, float):
            return format(value, fmt.get(col, ".4g"))
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
