"""The planner's search: the rollout/train split, η, the push interval and the update mode, each plan a short
simulation, staged so that a large run's search stays within about a minute."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from async_dapo.planning.profile import Profile, ProfileError
from async_dapo.planning.shape import UPDATE_MODES, Shape
from async_dapo.planning.simulator import predict


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

