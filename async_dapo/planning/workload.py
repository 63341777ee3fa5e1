"""The planner's workload: what one admitted prompt turns into (G response lengths, G outcomes) and whether
dynamic sampling keeps the group.

Two ways to state it (``profile.Workload``):

* **Per-prompt records** (what ``tools/bench/calibrate.py`` measures): for each calibration prompt, the
  lengths and outcomes of its samples. A group is a prompt drawn uniformly; it is kept iff
  ``0 < correct < G``. At the calibrated group size (and no drift) the recorded group itself is the draw,
  so keep is the recorded share of mixed groups. For any other G each sample's outcome is Bernoulli(p) with
  p = the prompt's recorded accuracy, and its length is drawn from the prompt's recorded samples with that
  outcome (a prompt's lengths and their correlation with correctness are kept). The expected keep rate is
  then the closed form :func:`keep_rate` = mean over prompts of ``1 − p^G − (1 − p)^G``.
* **Population figures** (the GPU profiles written from published numbers): response lengths (an empirical
  sample or a lognormal) and a constant ``keep_rate``; every sample is independent, except that a
  lognormal's ``prompt_share`` of ln(length)'s variance can belong to the prompt: one draw per group that
  its samples, and their restarts after an abort, share.

Drift: ``accuracy_by_version`` (mean per-sample accuracy at each policy version, from a short synchronous
run, or an assumption) shifts every prompt's accuracy logit by the one amount that makes the population's
mean accuracy that figure, so easy and hard prompts move together; past the list's end the last value holds.

An aborted sample restarts on the same prompt: :meth:`WorkloadModel.resample` draws its new length and
outcome from that prompt, not from the population (a hard prompt's restart is long again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from async_dapo.planning.profile import Workload


def keep_rate(workload: Workload, G: int, accuracy: float | None = None) -> float:
    """Expected share of groups of size ``G`` that dynamic sampling keeps (closed form, no simulation).

    Per-prompt records: ``mean_i(1 − p_i^G − (1 − p_i)^G)`` with p_i the prompt's accuracy shifted to the
    population ``accuracy`` (None: as recorded); at the recorded group size and no shift, the recorded share
    of mixed groups. Population figures: the profile's ``keep_rate``."""
    if workload.prompts is None:
        return workload.keep_rate
    if G == 1:
        return 0.0
    if accuracy is None and all(len(r.lengths) == G for r in workload.prompts):
        return float(np.mean([0 < sum(r.correct) < G for r in workload.prompts]))
    p = _shifted(_accuracies(workload), accuracy)
    return float(np.mean(1.0 - p ** G - (1.0 - p) ** G))


def _accuracies(workload: Workload) -> np.ndarray:
    return np.array([sum(r.correct) / len(r.correct) for r in workload.prompts], dtype=float)


def _shifted(p: np.ndarray, target: float | None) -> np.ndarray:
    """``p`` with every logit moved by the one shift that makes ``mean(p) == target`` (bisection; prompts at
    0 or 1 stay there: a prompt never solved in calibration is not assumed solvable; a target beyond reach
    gives the nearest reachable mean)."""
    if target is None:
        return p
    inner = (p > 0) & (p < 1)
    fixed = float(p[~inner].sum())
    if not inner.any():
        return p
    logit = np.log(p[inner] / (1 - p[inner]))

    def mean_at(d: float) -> float:
        return (fixed + float((1 / (1 + np.exp(-(logit + d)))).sum())) / len(p)

    lo, hi = -40.0, 40.0
    if target <= mean_at(lo):
        d = lo
    elif target >= mean_at(hi):
        d = hi
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_at(mid) < target else (lo, mid)
        d = (lo + hi) / 2
    out = p.copy()
    out[inner] = 1 / (1 + np.exp(-(logit + d)))
    return out


@dataclass
class Sample:
    length: int
    correct: bool | None  # None: population figures (the group's keep is drawn from keep_rate)


class WorkloadModel:
    """Draws groups and restarts for the simulator (see the module docstring)."""

    def __init__(self, workload: Workload, max_response_length: int, rng: np.random.Generator) -> None:
        self.w, self.cap, self.rng = workload, max_response_length, rng
        self._p_cache: dict[int, np.ndarray] = {}
        self._prompt_z: dict[int, float] = {}  # lognormal prompt_share: a prompt's standard-normal length effect
        if workload.prompts is not None:
            self._p = _accuracies(workload)
            self._by_outcome = [
                {c: [L for L, ok in zip(r.lengths, r.correct) if ok == c] or list(r.lengths) for c in (True, False)}
                for r in workload.prompts]

    def _accuracy_at(self, version: int) -> float | None:
        table = self.w.accuracy_by_version
        return None if not table else table[min(version, len(table) - 1)]

    def _p_at(self, version: int) -> np.ndarray:
        acc = self._accuracy_at(version)
        key = -1 if acc is None else min(version, len(self.w.accuracy_by_version) - 1)
        if key not in self._p_cache:
            self._p_cache[key] = _shifted(self._p, acc)
        return self._p_cache[key]

    def group(self, G: int, version: int) -> tuple[int, list[Sample]]:
        """A new prompt's G samples at policy ``version``: (prompt index, samples); for population figures
        prompt -1, or with a lognormal's ``prompt_share`` a new prompt's key (<= -2) to its length effect."""
        if self.w.prompts is None:
            if self.w.lognormal is None or self.w.lognormal.prompt_share == 0:
                return -1, [Sample(L, None) for L in self._population_lengths(G)]
            key = -2 - len(self._prompt_z)
            self._prompt_z[key] = float(self.rng.standard_normal())
            return key, [self.resample(key, version) for _ in range(G)]
        i = int(self.rng.integers(len(self.w.prompts)))
        rec = self.w.prompts[i]
        if len(rec.lengths) == G and self._accuracy_at(version) is None:
            return i, [Sample(min(L, self.cap), bool(c)) for L, c in zip(rec.lengths, rec.correct)]
        return i, [self.resample(i, version) for _ in range(G)]

    def resample(self, prompt: int, version: int) -> Sample:
        """One new sample of ``prompt`` (an aborted sample's restart, or a draw at an unseen G)."""
        if prompt == -1:
            return Sample(int(self._population_lengths(1)[0]), None)
        if prompt < -1:
            return Sample(self._lognormal_length(self._prompt_z[prompt]), None)
        ok = bool(self.rng.random() < self._p_at(version)[prompt])
        pool = self._by_outcome[prompt][ok]
        return Sample(min(int(pool[int(self.rng.integers(len(pool)))]), self.cap), ok)

    def keeps(self, samples: list[Sample]) -> bool:
        """Dynamic sampling's decision on a finished group."""
        if samples[0].correct is None:
            return self.w.keep_rate >= 1.0 or bool(self.rng.random() < self.w.keep_rate)
        right = sum(bool(s.correct) for s in samples)
        return 0 < right < len(samples)

    def _lognormal_length(self, z_prompt: float) -> int:
        """ln L = ln median + σ·(√s·z_prompt + √(1 − s)·z_sample), s = prompt_share: ln L keeps its variance σ²,
        and two samples of one prompt share s of it."""
        ln, s = self.w.lognormal, self.w.lognormal.prompt_share
        z = math.sqrt(s) * z_prompt + math.sqrt(1 - s) * float(self.rng.standard_normal())
        return int(min(max(round(math.exp(math.log(ln.median) + ln.sigma * z)), 1), self.cap))

    def _population_lengths(self, n: int) -> np.ndarray:
        w = self.w
        if w.response_lengths is not None:
            raw = self.rng.choice(np.asarray(w.response_lengths), size=n)
        else:
            raw = np.rint(np.exp(math.log(w.lognormal.median) + w.lognormal.sigma * self.rng.standard_normal(n)))
        return np.clip(raw, 1, self.cap).astype(np.int64)
