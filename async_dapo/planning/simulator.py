"""The planner's discrete-event simulation of one plan: engines -> replay queue -> learner -> weight push,
event by event, the queue's admission and staleness rules as replay.policy states them; then the
steady-state figures after the warm-up (see the package docstring and docs/planning.md)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from async_dapo.planning.engine_model import READY, Engine, EngineModel
from async_dapo.planning.learner_model import LearnerModel
from async_dapo.planning.profile import Profile, load_profile
from async_dapo.planning.shape import Prediction, Shape
from async_dapo.planning.workload import Sample, WorkloadModel


class Simulator(EngineModel, LearnerModel):
    """One plan, simulated event by event (see the module docstring and docs/planning.md)."""

    def __init__(self, profile: Profile, shape: Shape, steps: int, warmup: int, seed: int) -> None:
        if not 0 <= warmup < steps - 1:
            raise ValueError(f"need 0 <= warmup < steps - 1, got warmup {warmup}, steps {steps}")
        self.p, self.s, self.steps, self.warmup = profile, shape, steps, warmup
        self.rng = np.random.default_rng(seed)
        self.workload = WorkloadModel(profile.workload, shape.max_response_length, self.rng)
        self.events: list = []
        self.serial = 0
        self.engines = [Engine(i) for i in range(shape.num_engines)]
        self.seqs: dict[int, list] = {}  # sid -> [gid, length, start iteration, version, correct]
        self.groups: dict[int, dict] = {}
        self.next_id = 0
        self.queue: deque = deque()  # accepted groups: (min_version, trained tokens, response tokens, gid)
        self.queue_min = math.inf  # lowest min_version queued (skip the stale scan when nothing can be stale)
        self.in_window = self.running = 0
        self.qv = self.lv = 0  # the engines' loaded version (admission) / the learner's
        self.step, self.lstate, self.ltoken, self.llast = 0, "wait", 0, 0.0
        self.lwork = self.lrate = 0.0
        self.lidle, self.n_decoding, self.n_active = 0.0, 0, 0  # engines decoding / decoding or working
        self.push: dict[str, Any] | None = None  # the push in flight: version, start, engines entered/loaded
        self.push_durations: list[float] = []
        self.load_durations: list[float] = []  # per engine and push: push start -> it runs the new weights
        self.train_durations: list[float] = []  # per step: the train call (contention and loop overhead in)
        self.ltrain_at = 0.0
        self.stale_trained: list[int] = []
        self.counts = {"dropped_stale": 0, "dropped_filtered": 0, "kept": 0, "trained_resp": 0,
                       "trained_samples": 0, "finished_resp": 0, "finished_samples": 0}
        self.snap: dict[str, Any] = {}
        self.half = shape.max_inflight_prompts * shape.G / 2

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
            if kind == READY:
                if b == self.engines[a].token:
                    self._engine_ready(self.engines[a], t)
            elif a == self.ltoken:
                self._learner_event(t)
        return self._result()

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
            prompt, samples = self.workload.group(s.G, self.qv)
            for sid, smp in zip(sids, samples):
                self.seqs[sid] = [gid, smp.length, 0, 0, smp.correct]
            self.groups[gid] = {"sids": sids, "left": s.G, "prefilled": False, "prompt": prompt}
            best.waiting.extend(sids)
            best.inflight += 1
            self.running += 1
            room -= 1
            self._poke(best, t)

    def _arrive(self, e: Engine, gid: int, t: float) -> None:
        g = self.groups.pop(gid)
        seqs = [self.seqs.pop(sid) for sid in g["sids"]]
        e.inflight -= 1
        self.running -= 1
        min_version = min(s[3] for s in seqs)
        resp = sum(s[1] for s in seqs)
        self.counts["finished_resp"] += resp
        self.counts["finished_samples"] += len(seqs)
        if self.qv - min_version > self.s.eta:
            self.counts["dropped_stale"] += 1
        elif self.s.filter_groups and not self.workload.keeps([Sample(s[1], s[4]) for s in seqs]):
            self.counts["dropped_filtered"] += 1
        else:
            self.counts["kept"] += 1
            self.queue.append((min_version, resp + self.s.G * self.p.workload.prompt_tokens, resp, gid))
            self.queue_min = min(self.queue_min, min_version)
            self.in_window += 1
        self._admit(t)
        self._learner_take(t)

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
            wasted_tokens=int(d["wasted"]), step_s=1.0 / per_s, push_s=float(np.mean(self.push_durations or [0.0])),
            weight_load_s=float(np.mean(self.load_durations or [0.0])),
            train_s=float(np.mean(self.train_durations or [0.0])),
            keep_rate=d["kept"] / max(1, d["kept"] + d["dropped_filtered"]),
            trained_length_ratio=_ratio(d["trained_resp"], d["trained_samples"], d["finished_resp"],
                                        d["finished_samples"]))

    def _zero(self) -> dict[str, Any]:
        return {"t": 0.0, "lidle": 0.0, "idle": 0.0, "occ": 0.0, "tail": 0.0, "gen": 0, "wasted": 0,
                **{k: 0 for k in self.counts}}


def _ratio(trained: float, trained_n: float, finished: float, finished_n: float) -> float:
    """Mean trained response length / mean length of every finished sample over the same window."""
    if not (trained_n and finished_n and finished):
        return float("nan")
    return (trained / trained_n) / (finished / finished_n)


def predict(profile: Profile, shape: Shape, steps: int = 60, warmup: int = 10, seed: int = 0,
            sync_baseline: bool = True) -> Prediction:
    """Simulate ``steps`` training steps and report the steady state after ``warmup`` (the benchmark's
    10 of 60 by default). Deterministic given ``seed``. ``sync_baseline``: also simulate the same plan at
    η = 0 for ``speedup``."""
    pred = Simulator(profile, shape, steps, warmup, seed).run()
    if sync_baseline:
        sync = shape.synchronous()
        base = pred if sync == shape else Simulator(profile, sync, steps, warmup, seed).run()
        pred.speedup = pred.steps_per_s / base.steps_per_s
    return pred


def predicted_step_s(profile_path: str | Path, cfg) -> float:
    """Predicted steady-state seconds per step of the run ``cfg`` describes, on the profile at
    ``profile_path`` (for the end-of-run table: predicted against measured)."""
    return predict(load_profile(profile_path), Shape.from_config(cfg), sync_baseline=False).step_s

