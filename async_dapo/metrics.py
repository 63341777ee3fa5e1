"""Step metrics: what a DAPO step measured, under the TensorBoard tags documented in docs/metrics.md, plus
the one readable progress line per step.

The orchestrator gathers raw numbers (batch, learner, queue, rollout stats); :func:`step_metrics` turns
them into tags; :class:`MetricsWriter` writes them to ``run_dir/tb`` and appends them to
``run_dir/metrics.jsonl`` (the same numbers, for scripts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from async_dapo.stream.wire import Group

# learner key -> tag. verl's names where the quantity is verl's (docs/metrics.md maps every tag).
_LEARNER_TAGS = {
    "entropy": "actor/entropy", "token_prob": "actor/token_prob_mean",
    "pg_clipfrac": "actor/pg_clipfrac", "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "pg_clipfrac_upper": "actor/pg_clipfrac_upper", "pg_clipfrac_low_side": "actor/pg_clipfrac_low_side",
    "ppo_kl": "actor/ppo_kl", "grad_norm_max": "actor/grad_norm_max", "grad_norm_mean": "actor/grad_norm",
    "is_weight": "actor/is_weight_mean",
    "is_weight_max": "actor/is_weight_max", "rollout_logprob_abs_diff": "actor/rollout_logprob_abs_diff",
    "loss": "actor/pg_loss", "lr": "actor/lr", "skipped_updates": "actor/skipped_updates",
    "advantages": "critic/advantages/mean", "advantages_max": "critic/advantages/max",
    "advantages_min": "critic/advantages/min", "pad_ratio": "perf/pad_ratio",
}
# replay-queue key -> tag
_REPLAY_TAGS = {
    "depth": "replay/depth", "dropped_all_correct": "replay/dropped_all_correct",
    "dropped_all_wrong": "replay/dropped_all_wrong", "dropped_uniform": "replay/dropped_uniform",
    "rejected_malformed": "replay/rejected_malformed", "rejected_oversized": "replay/rejected_oversized",
    "rejected_schema": "replay/rejected_schema", "accepted": "replay/accepted", "received": "replay/received",
    "running": "replay/running", "abandoned": "replay/abandoned", "rejected_auth": "replay/rejected_auth",
    "received_samples": "replay/received_samples", "received_correct": "replay/received_correct",
    "rejected_unexpected": "replay/rejected_unexpected", "rejected_peers": "replay/rejected_peers",
    "rejected_handshake": "replay/rejected_handshake",
    "retired_prompts": "replay/retired_prompts", "skipped_retired": "replay/skipped_retired",
    "quarantined_prompts": "replay/quarantined_prompts", "admitted": "replay/admitted",
    "handed_out": "replay/handed_out", "dropped_capacity": "replay/dropped_capacity",
    "open_tickets": "replay/open_tickets", "forced_batches": "replay/forced_batches",
    "last_batch_length_ratio": "replay/trained_length_ratio", "received_tokens": "replay/received_tokens",
    "handed_out_tokens": "replay/handed_out_tokens", "handed_out_samples": "replay/handed_out_samples",
    "last_batch_acc_ratio": "replay/trained_acc_ratio", "handed_out_correct": "replay/handed_out_correct",
    # progress reports of the groups in flight (rollout.partial_every_s)
    "partials_received": "replay/partials_received", "partials_unexpected": "replay/partials_unexpected",
    "partials_held": "replay/partials_held", "partials_carried": "replay/partials_carried",
    "partials_waiting": "replay/partials_waiting", "partials_handed_out": "replay/partials_handed_out",
    "partial_tokens_handed_out": "replay/partial_tokens_handed_out", "partials_restored": "replay/partials_restored",
}
# engine counters summed over the engine processes and over steps (a replacement counts from zero)
ENGINE_SUMS = ("aborted_tokens", "continued_tokens", "carried_tokens", "carried_stale_tokens", "partials_unsent")


def batch_metrics(groups: list[Group], trained_version: int) -> dict[str, float]:
    """Reward, length and staleness statistics of the groups a step trains on (verl's
    ``compute_data_metrics`` names where the quantity is verl's). Staleness of a group = the version of
    the weights it is trained on − its oldest token's version (what η bounds)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    lengths = [s.num_tokens for s in samples]
    prompts = [g.prompt_ids.size for g in groups for _ in g.samples]  # per sample, as verl counts them
    stale = [trained_version - g.min_version for g in groups]
    out = {}
    # The shaped reward is verl's sequence score; with no KL penalty in the reward, also its "rewards".
    for name in ("critic/score", "critic/rewards"):
        out.update({f"{name}/mean": statistics.fmean(rewards), f"{name}/max": float(max(rewards)),
                    f"{name}/min": float(min(rewards))})
    out.update({
        "reward/acc_mean": statistics.fmean(float(s.acc) for s in samples),
        "response_length/mean": statistics.fmean(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        "response_length/clip_ratio": statistics.fmean(float(s.truncated) for s in samples),
        "prompt_length/mean": statistics.fmean(prompts),
        "prompt_length/max": float(max(prompts)),
        "prompt_length/min": float(min(prompts)),
        "perf/total_num_tokens": float(sum(prompts) + sum(lengths)),
        "staleness/mean": statistics.fmean(stale),
        "staleness/max": float(max(stale)),
        "staleness/partial_rollout_frac": statistics.fmean(
            float(s.versions.size > 0 and s.versions.min() != s.versions.max()) for s in samples),
    })
    return out


def fleet_metrics(now: dict[int, dict], before: dict[int, dict], dt: float,
                  batch: list[Group]) -> tuple[dict[str, float], dict[str, float]]:
    """(each engine's tags ``rollout/<rank>/...``, the fleet's totals ``gen_tokens_per_s`` and
    ``rollout_idle_ratio`` for step_metrics' timing) between two snapshots of the serving engines' counters
    ``dt`` seconds apart (rank -> RolloutWorker.get_stats). An engine absent from ``before``, or another process
    under the same rank (a replacement), counts from zero. ``batch_share``: the fraction of this step's groups
    that engine produced (also for a rank that has left since)."""
    dt = max(dt, 1e-9)
    share = {g.engine_rank for g in batch} | set(now)
    out = {f"rollout/{r}/batch_share": sum(g.engine_rank == r for g in batch) / max(len(batch), 1) for r in share}
    totals = dict.fromkeys(("tokens", "idle", "occupancy", "tail", "updates", "update_seconds", *ENGINE_SUMS), 0.0)
    for rank, s in now.items():
        b = before.get(rank)
        if b is None or b.get("pid") != s.get("pid"):
            b = {}
        d = {k: max(0.0, s.get(k, 0.0) - b.get(k, 0.0)) for k in ("gen_tokens", "idle_seconds", "groups_sent",
                                                                   "seq_seconds", "tail_seconds", "updates",
                                                                   "update_seconds", *ENGINE_SUMS)}
        for key in ("updates", "update_seconds", *ENGINE_SUMS):
            totals[key] += d[key]
        occupancy = d["seq_seconds"] / dt / max(s.get("batch_seqs", 1), 1)
        for key, value in zip(("tokens", "idle", "occupancy", "tail"),
                              (d["gen_tokens"], d["idle_seconds"], occupancy, d["tail_seconds"])):
            totals[key] += value
        out.update({f"rollout/{rank}/gen_tokens_per_s": d["gen_tokens"] / dt,
                    f"rollout/{rank}/groups_per_s": d["groups_sent"] / dt,
                    f"rollout/{rank}/idle_ratio": min(1.0, d["idle_seconds"] / dt),
                    f"rollout/{rank}/occupancy": occupancy, f"rollout/{rank}/tail_ratio": min(1.0, d["tail_seconds"] / dt),
                    f"rollout/{rank}/version": float(s["version"]),
                    # seconds inside one weight update (paused or draining, then loading): what a push costs it
                    f"rollout/{rank}/weight_load_s": d["update_seconds"] / d["updates"] if d["updates"] else 0.0,
                    f"rollout/{rank}/groups_sent": float(s.get("groups_sent", 0))})  # by this process, cumulative
    engines = max(len(now), 1)
    return out, {"gen_tokens_per_s": totals["tokens"] / dt,
                 "rollout_idle_ratio": min(1.0, totals["idle"] / dt / engines),
                 "rollout_occupancy": totals["occupancy"] / engines,
                 "rollout_tail_ratio": min(1.0, totals["tail"] / dt / engines),
                 "weight_load_s": totals["update_seconds"] / totals["updates"] if totals["updates"] else 0.0,
                 **{key: totals[key] for key in ENGINE_SUMS}}


def step_metrics(groups: list[Group], learner: dict[str, float], queue: dict[str, Any], *, trained_version: int,
                 timing: dict[str, float]) -> dict[str, float]:
    """All tags of one step. ``timing`` holds step_s, wait_data_s, weight_push_s, weight_push_stall_s,
    gen_tokens_per_s, rollout_idle_ratio, weight_load_s (measured by the orchestrator)."""
    out = batch_metrics(groups, trained_version)
    out.update({tag: float(learner[k]) for k, tag in _LEARNER_TAGS.items() if k in learner})
    out.update({tag: float(queue[k]) for k, tag in _REPLAY_TAGS.items() if k in queue})
    out["replay/dropped_stale"] = float(queue.get("dropped_stale", 0) + queue.get("dropped_stale_at_handout", 0))
    out.update({f"replay/{k}": float(v) for k, v in queue.items() if k.startswith("abandoned/")})  # by reason
    # response tokens generated and never trained, cumulative, by reason (the queue's drops; abort from the engines)
    out.update({f"rollout/{k}": float(v) for k, v in queue.items() if k.startswith("wasted_tokens/")})
    sums = timing.get("engine_sums", {})  # the engines' cumulative counters (ENGINE_SUMS)
    if sums:
        out["rollout/wasted_tokens/abort"] = float(sums["aborted_tokens"])
        out["rollout/wasted_tokens/carried_stale"] = float(sums["carried_stale_tokens"])
        out["rollout/continued_tokens"] = float(sums["continued_tokens"])  # kept across an abort and continued
        out["rollout/carried_tokens"] = float(sums["carried_tokens"])  # another engine's, continued after it left
        out["rollout/partials_unsent"] = float(sums["partials_unsent"])
    step_s = max(timing["step_s"], 1e-9)
    out.update({
        "perf/time_per_step": step_s, "perf/wait_data_s": timing["wait_data_s"],
        "perf/weight_push_s": timing["weight_push_s"], "perf/weight_push_stall_s": timing.get("weight_push_stall_s", 0.0),
        "perf/weight_load_s": timing.get("weight_load_s", 0.0),
        "perf/update_actor_s": float(learner["train_s"]),
        "perf/gen_tokens_per_s": timing["gen_tokens_per_s"],
        "perf/train_tokens_per_s": learner["train_tokens"] / max(learner["train_s"], 1e-9),
        "perf/learner_idle_ratio": min(1.0, timing["wait_data_s"] / step_s),
        "perf/rollout_idle_ratio": timing["rollout_idle_ratio"],
        "perf/rollout_occupancy": timing.get("rollout_occupancy", 0.0),
        "perf/rollout_tail_ratio": timing.get("rollout_tail_ratio", 0.0),
        "train/version": float(learner["version"]),
    })
    return out


def progress_line(step: int, total: int, m: dict[str, float], eta_s: float) -> str:
    """One readable line per step."""
    return (f"step {step}/{total} v{int(m['train/version'])} reward {m['critic/score/mean']:+.3f} "
            f"acc {m['reward/acc_mean']:.3f} stale {m['staleness/mean']:.2f}/{int(m['staleness/max'])} "
            f"gen {m['perf/gen_tokens_per_s']:.0f} tok/s train {m['perf/train_tokens_per_s']:.0f} tok/s "
            f"step {m['perf/time_per_step']:.1f}s wait {m['perf/wait_data_s']:.1f}s ETA {eta_s / 60:.1f} min")


# Tags renamed for verl's names: old -> new, for reading metrics.jsonl of older runs. Two old names are
# verl's with another meaning: ``actor/pg_clipfrac_lower`` (was A < 0 and ratio < 1 − ε_low, is now verl's
# dual-clip fraction) and ``actor/grad_norm``, so rows are renamed only when they are old (see
# :func:`upgrade_row`).
RENAMED_TAGS = {
    "reward/mean": "critic/score/mean",
    "response/length_mean": "response_length/mean",
    "response/length_max": "response_length/max",
    "response/clip_ratio": "response_length/clip_ratio",
    "perf/step_s": "perf/time_per_step",
    "actor/grad_norm": "actor/grad_norm_max",  # the largest of the step's updates; verl's is their mean
    "actor/pg_clipfrac_lower": "actor/pg_clipfrac_low_side",
}
# The replay queue's counters were ``queue/*``; they are ``replay/*``, the name of the queue's config section.
RENAMED_PREFIXES = {"queue/": "replay/"}


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics.jsonl row under today's tags: a training-step row written before the verl rename (it has
    ``perf/step_s``) gets the new names, and a ``queue/*`` tag of any row becomes ``replay/*``; a row of
    today's is returned unchanged."""
    if "perf/step_s" in row:
        row = {RENAMED_TAGS.get(k, k): v for k, v in row.items()}
    return {_renamed_prefix(k): v for k, v in row.items()}


def _renamed_prefix(tag: str) -> str:
    for old, new in RENAMED_PREFIXES.items():
        if tag.startswith(old):
            return new + tag[len(old):]
    return tag


class MetricsWriter:
    """TensorBoard events in ``run_dir/tb`` and one JSON object per step in ``run_dir/metrics.jsonl``."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, purge_step: int | None = None) -> None:
        """``purge_step`` (a resumed run: checkpoint step + 1): TensorBoard hides the events at and after it
        that the interrupted run wrote (metrics.jsonl is rewound by :func:`rewind_jsonl` beforehand)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._tb is not None:
            for tag, value in metrics.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        # Unix time too, so scripts can draw curves against wall time (TensorBoard keeps its own).
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()


def rewind_jsonl(path: Path, step: int) -> int:
    """Drop the rows of ``path`` whose ``step`` is after ``step`` (a run resumed from that checkpoint
    writes them again), atomically; returns how many were dropped. Rows are JSON objects with "step"."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old file or the new one, never a torn
    one: write a temporary file beside it, flush it to disk, then rename over (atomic on POSIX). The temporary
    file's name is this writer's own (process id and a random part, created exclusively), so two writers of
    the same path at once never write into each other's file: the last rename wins, whole."""
    import os
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def val_subsets_line(metrics: dict[str, float]) -> str:
    """'L1 0.612 L2 0.071 ...': the per-subset avg@k of a validation, for its log line."""
    prefix = "val/avg_at_k/"
    return " ".join(f"{k[len(prefix):]} {v:.3f}" for k, v in metrics.items() if k.startswith(prefix))


def timed(phase: str):
    """Method decorator: the call's wall time is charged to ``phase`` of ``self.clock`` (a PhaseClock)."""
    def wrap(method):
        @functools.wraps(method)
        def timed_method(self, *args, **kwargs):
            with self.clock.phase(phase):
                return method(self, *args, **kwargs)
        return timed_method
    return wrap


class PhaseClock:
    """Wall time of a run by phase. Phases nest: entering one pauses the enclosing phase, so the totals
    add up to the wall time (the rest is reported as ``other``)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.totals: dict[str, float] = {}
        self._stack: list[list] = []  # [name, since]

    def _charge(self, entry: list, now: float) -> None:
        self.totals[entry[0]] = self.totals.get(entry[0], 0.0) + now - entry[1]

    @contextlib.contextmanager
    def phase(self, name: str):
        now = time.perf_counter()
        if self._stack:
            self._charge(self._stack[-1], now)
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            self._charge(self._stack.pop(), now)
            if self._stack:
                self._stack[-1][1] = now

    def metrics(self) -> dict[str, float]:
        """``time/<phase>_s`` for every phase, ``time/other_s`` and ``time/total_s``."""
        total = time.perf_counter() - self.start
        out = {f"time/{k}_s": v for k, v in self.totals.items()}
        out["time/other_s"] = max(0.0, total - sum(self.totals.values()))
        out["time/total_s"] = total
        return out

    def table(self) -> str:
        """One line per phase: seconds and share of the wall time, largest first."""
        m = self.metrics()
        total = max(m.pop("time/total_s"), 1e-9)
        rows = sorted(m.items(), key=lambda kv: -kv[1])
        lines = [f"  {k[5:-2]:<18} {v:8.1f} s  {v / total:6.1%}" for k, v in rows]
        return "\n".join(["wall time by phase:", *lines, f"  {'total':<18} {total:8.1f} s"])
