"""The simulator's engines: each a continuous batcher whose decode iteration takes ``a + b·n + c·K`` seconds
(n running sequences, K their context tokens), slowed while the learner computes and, on shared cores, by
the busy processes' share of them; between events n is
constant, so a whole segment up to the next finish is one closed-form jump. Also the engine's side of a
weight update (pause, drain or abort; the load; the re-prefill after it).

:class:`EngineModel` is one half of :class:`~async_dapo.planning.simulator.Simulator`: its methods read and
change the state the simulator holds (``p`` the profile, ``s`` the shape, ``engines``, ``seqs``,
``groups``) and call the simulator's ``_at``, ``_admit`` and the learner half's ``_learner_rerate``."""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

READY, LEARNER = 0, 1  # event kinds: an engine's next action is due / the learner's step or stall ended
ACTIVE = ("decode", "work")  # engine states that keep a core busy


@dataclass
class Engine:
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


class EngineModel:
    """The engine half of the simulator (see the module docstring)."""

    def _acc(self, e: Engine, t: float) -> None:
        """Integrate the engine's state since its last change (idle, occupancy, tail)."""
        dt = t - e.last_t
        if dt > 0:
            if e.inflight == 0:
                e.idle += dt
            e.occ += e.n * dt
            if e.state == "decode" and 0 < e.n < self.half:
                e.tail += dt
        e.last_t = t

    def _slow(self, extra: int = 0) -> float:
        """How many times slower an engine computes now; ``extra``: busy processes not counted in the state
        (an engine that computes while its state says it waits)."""
        c = self.p.contention
        return (c.interference(c.engine_slowdown) if self.lstate == "train" else 1.0) * c.share(self._busy() + extra)

    def _busy(self) -> int:
        """Compute processes busy now: engines decoding or working (prefill, a finished group's host work)
        and, while it trains, every learner rank."""
        return self.n_active + (self.s.learner_ranks if self.lstate == "train" else 0)

    def _poke(self, e: Engine, t: float) -> None:
        """Something changed for ``e``: an idle engine looks now, a decoding one at its next iteration."""
        if e.state == "idle":
            e.token += 1
            self._at(t, READY, e.idx, e.token)
        elif e.state == "decode":
            t0, m, A, slow = e.seg
            j = self._iterations_by(e, t - t0, m, A, slow)
            if j < m:
                e.seg = (t0, j, A, slow)
                e.token += 1
                self._at(t0 + self._decode_s(e, j, A, slow), READY, e.idx, e.token)

    def _decode_s(self, e: Engine, m: int, A: float, slow: float) -> float:
        """Seconds of m iterations from now: Σ_i (A + c·n·i) with A = a + b·n + c·K."""
        c = self.p.engine.decode_per_ctx_token_s
        return slow * (m * A + c * e.n * m * (m - 1) / 2)

    def _iterations_by(self, e: Engine, tau: float, m: int, A: float, slow: float) -> int:
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

    def _set_state(self, e: Engine, state: str, t: float) -> None:
        was_decoding, was_active = e.state == "decode", e.state in ACTIVE
        e.state = state
        decoding, active = state == "decode", state in ACTIVE
        self.n_decoding += decoding - was_decoding
        self.n_active += active - was_active
        if self.p.contention.cores is not None:
            if active != was_active:  # every busy process's share of the cores changed
                for other in self.engines:
                    if other is not e and other.state == "decode":
                        self._poke(other, t)
            if active != was_active or decoding != was_decoding:
                self._learner_rerate(t)
        elif decoding != was_decoding and self.n_decoding == int(decoding) and \
                self.p.contention.learner_slowdown != 1.0:  # the first engine started or the last one stopped
            self._learner_rerate(t)

    def _engine_ready(self, e: Engine, t: float) -> None:
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

    def _end_decode(self, e: Engine) -> None:
        _, m, _, _ = e.seg
        e.it += m
        e.gen += e.n * m
        while e.heap and e.heap[0][0] <= e.it:
            _, sid = heapq.heappop(e.heap)
            e.running.discard(sid)
            gid, length, start = self.seqs[sid][:3]
            e.n -= 1
            e.sum_p -= self.p.workload.prompt_tokens
            e.sum_start -= start
            g = self.groups[gid]
            g["left"] -= 1
            if g["left"] == 0:
                eng = self.p.engine
                e.work.append((eng.per_group_s + eng.per_sample_s * self.s.G, "group", gid))

    def _fill(self, e: Engine) -> None:
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

    def _next(self, e: Engine, t: float) -> None:
        """Choose the engine's next action: pending work first, then decoding, else idle; an engine whose
        update waits (paused, or drained) with no work left enters the load."""
        up = e.update
        if up is not None and not e.work and (up["stage"] == "pausing" or (
                up["stage"] == "drain" and e.n == 0 and not e.waiting)):
            self._enter_load(e, t)
            return
        if e.work:
            seconds, kind, payload = e.work.popleft()
            self._set_state(e, "work", t)
            seconds *= self._slow()  # at the share of the cores it has now, itself counted
            e.seg = (kind, payload)
            e.token += 1
            self._at(t + seconds, READY, e.idx, e.token)
        elif e.n > 0 and (up is None or up["stage"] == "drain"):
            self._set_state(e, "decode", t)
            slow, eng = self._slow(), self.p.engine
            A = eng.decode_base_s + eng.decode_per_seq_s * e.n + eng.decode_per_ctx_token_s * e.context()
            m = e.heap[0][0] - e.it
            e.seg = (t, m, A, slow)
            e.token += 1
            self._at(t + self._decode_s(e, m, A, slow), READY, e.idx, e.token)
        else:
            self._set_state(e, "idle", t)

    def _end_work(self, e: Engine, t: float) -> None:
        kind, payload = e.seg
        if kind == "group":
            self._arrive(e, payload, t)
        elif kind == "resume":
            self._resume(e, t)

    def _start_update(self, e: Engine, t: float) -> None:
        up = e.update
        if up["mode"] == "drain":
            up["stage"] = "drain"
            return
        up["stage"] = "pausing"  # no decoding from here; queued work (scoring) finishes first
        if up["mode"] == "abort":  # each restarted sample is a new request: its handling is paid again
            up["restarted"] = e.n
            up["refill"] = self._abort_running(e, up["version"]) * self.p.workload.prompt_tokens

    def _enter_load(self, e: Engine, t: float) -> None:
        """``e`` waits in the load. Once every engine is in, the broadcast ends at max(start + base_s, last
        one in) + bytes/bandwidth; each engine resumes at the later of that and its entry + its own pause:
        engine_pause_s plus engine_pause_per_seq_s per sequence it holds, running or waiting for room (the
        update goes through the engine's whole request table, not only its batch), at its share of the cores."""
        self._set_state(e, "load", t)
        pp = self.p.push
        held = e.n + len(e.waiting)
        pause = pp.engine_pause_s + pp.engine_pause_per_seq_s * held * self._slow(extra=1)  # its own CPU work
        e.update["stage"], e.update["ready"] = "load", t + pause
        push = self.push
        push["entered"] += 1
        push["last_enter"] = max(push["last_enter"], t)
        if push["entered"] < len(self.engines):
            return
        land = max(push["t0"] + pp.base_s, push["last_enter"]) + pp.bytes / pp.bandwidth_bytes_per_s
        for other in self.engines:
            other.seg = ("resume", 0)
            other.token += 1
            self._at(max(land, other.update["ready"]), READY, other.idx, other.token)

    def _resume(self, e: Engine, t: float) -> None:
        """The engine runs the new version; inflight re-prefills the running context (retract dropped the
        KV cache: each group's prompt once, plus the generated tokens), abort prefills the restarted groups and
        handles each restarted sample as a new request (``per_sample_s``)."""
        up = e.update
        e.version, e.update = up["version"], None
        if up["mode"] == "inflight":
            groups = len({self.seqs[sid][0] for sid in e.running})
            up["refill"] = groups * self.p.workload.prompt_tokens + e.n * e.it - e.sum_start
        seconds = self._restart_s(up)
        if seconds > 0:
            e.work.appendleft((seconds, "prefill", 0))
        if self.step >= self.warmup:
            self.load_durations.append(t - self.push["t0"])
        self.push["loaded"] += 1
        if self.push["loaded"] == len(self.engines):
            self._push_done(t)
        else:
            self._admit(t)  # an engine that drained may take groups again

    def _restart_s(self, up: dict) -> float:
        """Engine seconds after a load before decoding goes on: the tokens to prefill again, and under abort
        each restarted sample's handling as a new request."""
        eng = self.p.engine
        return up.get("refill", 0) * eng.prefill_per_token_s + up.get("restarted", 0) * eng.per_sample_s

    def _abort_running(self, e: Engine, version: int) -> int:
        """Abort mode: every running sequence's tokens are thrown away; it restarts from scratch at
        ``version``: a new sample OF THE SAME PROMPT (planning.workload: a hard prompt's restart is long
        again). Returns the groups that need a prefill again."""
        groups, sids = set(), sorted(e.running)
        e.heap = []
        for sid in sids:
            seq = self.seqs[sid]
            e.wasted += e.it - seq[2]
            new = self.workload.resample(self.groups[seq[0]]["prompt"], version)
            seq[1], seq[2], seq[3], seq[4] = new.length, e.it, version, new.correct
            e.heap.append((e.it + new.length, sid))
            groups.add(seq[0])
        heapq.heapify(e.heap)
        e.sum_start = e.n * e.it
        return len(groups)
