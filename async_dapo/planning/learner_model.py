"""The simulator's learner and its weight push: it takes the B oldest queued groups at its own version
(dropping the stale ones), trains for :func:`step_seconds` (slower while engines decode), and every k steps
pushes: it waits for the previous push, stalls ``learner_stall_s``, then every engine applies the update
by ``rollout.update_mode``.

:class:`LearnerModel` is one half of :class:`~async_dapo.planning.simulator.Simulator`: its methods read and
change the state the simulator holds and call the engine half's ``_poke``."""

from __future__ import annotations

import math
from collections import deque

from async_dapo.planning.engine_model import LEARNER
from async_dapo.planning.profile import LearnerProfile
from async_dapo.planning.shape import Shape


def step_seconds(lp: LearnerProfile, s: Shape, group_tokens: list[float]) -> float:
    """One training step on groups of ``group_tokens`` (prompt + response tokens each), as the learner runs it
    (learner.rank.train_step), R = ``s.learner_ranks``:

    * the batch splits into mini-batches of ``s.mini_batch_groups`` groups, one optimizer update each;
    * a mini-batch of T tokens is, per rank, ``m = ceil(T / R / micro_batch_tokens)`` micro-batches (at
      least 1; padding inside a micro-batch is not modelled) costing
      ``per_token_s·T / (R·efficiency) + m·per_micro_batch_s`` of compute and, when R > 1,
      ``m·(3·collective_bytes·(R − 1)/R / collective_bandwidth + collective_latency_s)`` of collectives, of
      which ``collective_overlap`` hides under compute;
    * each update costs ``per_update_s / R`` (FSDP shards the optimizer state);
    * all of that ``epochs`` times, plus, with a proximal pass, ``forward_share`` of every mini-batch but
      the first once, plus ``step_base_s``."""
    R = s.learner_ranks
    comm_per_micro = 0.0
    if R > 1:
        comm_per_micro = (3 * lp.collective_bytes * (R - 1) / R / lp.collective_bandwidth_bytes_per_s
                          + lp.collective_latency_s) * (1 - lp.collective_overlap)
    passes = []
    for j in range(0, len(group_tokens), s.mini_batch_groups):
        tokens = sum(group_tokens[j:j + s.mini_batch_groups])
        micro = max(1, math.ceil(tokens / R / s.micro_batch_tokens))
        compute = lp.per_token_s * tokens / (R * lp.scaling_efficiency) + micro * lp.per_micro_batch_s
        passes.append(compute + micro * comm_per_micro)
    train = sum(passes) + len(passes) * lp.per_update_s / R
    proximal = lp.forward_share * sum(passes[1:]) if s.proximal else 0.0
    return lp.step_base_s + s.epochs * train + proximal


class LearnerModel:
    """The learner half of the simulator (see the module docstring)."""

    def _acc_learner(self, t: float) -> None:
        if self.lstate == "wait":
            self.lidle += t - self.llast
        elif self.lstate == "train":
            self.lwork -= (t - self.llast) * self.lrate
        self.llast = t

    def _learner_rate(self) -> float:
        c = self.p.contention
        return 1.0 / ((c.interference(c.learner_slowdown) if self.n_decoding else 1.0) * c.share(self._busy()))

    def _learner_rerate(self, t: float) -> None:
        if self.lstate != "train":
            return
        self._acc_learner(t)
        self.lrate = self._learner_rate()
        self.ltoken += 1
        self._at(t + max(self.lwork, 0.0) / self.lrate, LEARNER, self.ltoken)

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
        batch = self._pick(B)
        if batch is None:
            return
        self.queue_min = min((g[0] for g in self.queue), default=math.inf)
        if self.step >= self.warmup:
            self.stale_trained.extend(self.lv - g[0] for g in batch)
        self.counts["trained_resp"] += sum(g[2] for g in batch)
        self.counts["trained_samples"] += B * self.s.G
        self._learner_to(t, "train")
        self.ltrain_at = t
        lp = self.p.learner
        self.lwork = step_seconds(lp, self.s, [g[1] for g in batch]) + lp.loop_per_step_s + \
            lp.loop_per_sample_s * len(batch) * self.s.G
        self.lrate = self._learner_rate()
        self.ltoken += 1
        self._at(t + self.lwork / self.lrate, LEARNER, self.ltoken)

    def _pick(self, B: int) -> list | None:
        """The batch replay.policy hands out: the B first arrived, or (admission order) the B first admitted
        once no earlier-admitted group is still generating (the queue's order_wait_s bound is not modelled)."""
        if len(self.queue) < B:
            return None
        if self.s.order == "arrival":
            return [self.queue.popleft() for _ in range(B)]
        ranked = sorted(self.queue, key=lambda g: g[3])[:B]
        if self.groups and min(self.groups) < ranked[-1][3]:  # groups still generating, keyed by admission
            return None
        chosen = {g[3] for g in ranked}
        self.queue = deque(g for g in self.queue if g[3] not in chosen)
        return ranked

    def _learner_to(self, t: float, state: str) -> None:
        """Change the learner's state; entering or leaving training changes the engines' speed."""
        self._acc_learner(t)
        was = self.lstate == "train"
        self.lstate = state
        if was != (state == "train") and (self.p.contention.engine_slowdown != 1.0 or self.p.contention.cores):
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
        if self.step >= self.warmup:
            self.train_durations.append(t - self.ltrain_at)
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
        self._at(t + self.p.push.learner_stall_s, LEARNER, self.ltoken)

    def _start_push(self, t: float) -> None:
        """The sender starts (rollout.py's update() is called on every engine now): inflight and abort
        engines pause at their next iteration, drain engines stop admitting and finish what they run."""
        self.push = {"version": self.lv, "t0": t, "entered": 0, "loaded": 0, "last_enter": t}
        for e in self.engines:
            e.update = {"version": self.lv, "mode": self.s.update_mode, "stage": "new"}
            self._poke(e, t)

    def _push_done(self, t: float) -> None:
        """Every engine loaded the push: the queue's version advances (set_version), admission widens."""
        self.qv = self.push["version"]
        if self.step >= self.warmup:  # steady state only, like every other figure
            self.push_durations.append(t - self.push["t0"])
        self.push = None
        self._admit(t)
        if self.lstate == "push_wait":
            self._stall(t)
