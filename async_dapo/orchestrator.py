"""The orchestrator: place every actor with Ray, wire the group stream and the weight group, run the DAPO
loop, and shut everything down on completion, Ctrl-C or SIGTERM.

One code path serves every mode. η = ``replay.max_staleness`` alone decides how far rollouts run ahead:
η = 0 is synchronous (the queue admits the next batch's prompts only once the engines run the newest
weights), η = 1 overlaps one step, larger η is fully asynchronous with that bound.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from async_dapo.config import Config, dump_config
from async_dapo.data import val_rows
from async_dapo.metrics import MetricsWriter, progress_line, step_metrics, val_subsets_line

log = logging.getLogger("async_dapo")


def train(cfg: Config, resume: Path | None = None) -> dict[str, Any]:
    """Run DAPO training as configured; returns the last step's metrics."""
    with Run(cfg, resume) as run:
        for step in range(run.step + 1, cfg.learner.total_steps + 1):
            t0 = time.perf_counter()
            batch = run.next_batch()                       # B fresh, mixed-outcome groups
            stats = run.train(batch)                       # one DAPO step on every rank: version += 1
            if step % cfg.weight_sync.every_k_steps == 0:
                run.push_weights()                         # engines load while the next step trains
            run.log(step, batch, stats, t0)
            if run.due(step, cfg.logging.val_every_steps):
                run.validate(step)
            if run.due(step, cfg.checkpoint.every_steps):
                run.checkpoint(step)
        return run.finish()


class Run:
    """The placed actors of one run and the operations the loop calls (each one short)."""

    def __init__(self, cfg: Config, resume: Path | None) -> None:
        self.cfg, self.resume = cfg, resume
        self.run_dir = Path(cfg.logging.run_dir)
        self.step, self.version = 0, 0
        self._started_ray = False
        self._last: dict[str, Any] = {"gen_tokens": 0, "idle": 0.0, "t": time.perf_counter()}
        self._t_start = time.perf_counter()
        self._steps_done = 0

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Run":
        try:
            self._start()
        except BaseException:
            self._shutdown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._shutdown()

    @staticmethod
    def _on_sigterm(signum, frame) -> None:
        # Same path as Ctrl-C: unwind the loop so that __exit__ ends every actor and engine.
        raise KeyboardInterrupt("SIGTERM")

    def _start(self) -> None:
        import ray

        from async_dapo.placement import place

        cfg = self.cfg
        if self.resume is None and (moved := archive_previous_run(self.run_dir)) is not None:
            log.info("run_dir %s held an earlier run: moved it to %s", self.run_dir, moved)
        dump_config(cfg, self.run_dir / "config.yaml")
        if not ray.is_initialized():
            ray.init(address=cfg.placement.ray_address, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        # After ray.init, which installs a SIGTERM handler of its own that skips our cleanup.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.resume is not None:
            self.ckpt = _checkpoint_to_resume(self.resume)
            meta = json.loads((self.ckpt / "meta.json").read_text())
            self.step, self.version = int(meta["step"]), int(meta["version"])
        self.placed = place(cfg, initial_version=self.version)
        self.metrics = MetricsWriter(self.run_dir, cfg.logging.tensorboard)
        if self.resume is not None:
            self._restore()
        self.placed.start_rollouts()
        self._last["t"] = self._t_start = time.perf_counter()
        if self.step == 0 and cfg.logging.val_every_steps:
            self.validate(0)

    def _restore(self) -> None:
        import ray

        ckpt = self.ckpt
        versions = self.placed.on_learners("load_checkpoint", str(ckpt))
        if set(versions) != {self.version}:
            raise RuntimeError(f"{ckpt}: learner ranks restored versions {versions}, meta.json says {self.version}")
        ray.get(self.placed.replay.load_state_dict.remote(json.loads((ckpt / "replay.json").read_text())))
        self.push_weights()  # engines restart from model.path: give them the restored weights first
        self.placed.wait_push()
        log.info("resumed from %s at step %d, version %d", ckpt, self.step, self.version)

    def _shutdown(self) -> None:
        import ray

        placed = getattr(self, "placed", None)
        if placed is not None:
            placed.shutdown()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    # ------------------------------------------------------------------ loop operations
    def next_batch(self) -> list:
        import ray

        t0 = time.perf_counter()
        if self.cfg.data.replay_batches is not None:
            batch = read_batch(Path(self.cfg.data.replay_batches) / f"step_{self.step + 1}.bin")
        else:
            batch = ray.get(self.placed.replay.get_batch.remote(self.version))
        if self.cfg.logging.record_batches:
            write_batch(batch, self.run_dir / "batches" / f"step_{self.step + 1}.bin")
        self._wait_data_s = time.perf_counter() - t0
        self._batch_version = self.version  # the weights this batch is trained on
        return batch

    def train(self, batch: list) -> dict[str, float]:
        stats = self.placed.on_learners("train_step", batch)[0]
        self.version = int(stats["version"])
        return stats

    def push_weights(self) -> None:
        self.placed.push_weights(self.version)

    def due(self, step: int, every: int) -> bool:
        return every > 0 and (step % every == 0 or step == self.cfg.learner.total_steps)

    def log(self, step: int, batch: list, stats: dict[str, float], t0: float) -> None:
        import ray

        queue = ray.get(self.placed.replay.stats.remote())
        roll = self.placed.rollout_stats()
        now = time.perf_counter()
        dt = max(now - self._last["t"], 1e-9)
        timing = {"step_s": now - t0, "wait_data_s": self._wait_data_s,
                  "weight_push_s": self.placed.last_push().get("push_s", 0.0),
                  "gen_tokens_per_s": (roll["gen_tokens"] - self._last["gen_tokens"]) / dt,
                  "rollout_idle_ratio": min(1.0, (roll["idle_seconds"] - self._last["idle"]) / dt / roll["engines"])}
        self._last = {"gen_tokens": roll["gen_tokens"], "idle": roll["idle_seconds"], "t": now}
        m = step_metrics(batch, stats, queue, trained_version=self._batch_version, timing=timing)
        self.metrics.write(step, m)
        self.step = step
        self._steps_done += 1
        eta = (now - self._t_start) / self._steps_done * (self.cfg.learner.total_steps - step)
        log.info(progress_line(step, self.cfg.learner.total_steps, m, eta))
        self.last_metrics = m

    def validate(self, step: int) -> None:
        import ray

        lg = self.cfg.logging
        params = {"temperature": lg.val_temperature, "top_p": lg.val_top_p,
                  "max_new_tokens": self.cfg.rollout.max_response_length}
        res = ray.get(self.placed.engines[0].validate.remote(val_rows(self.cfg), lg.val_n, params))
        self.metrics.write(step, res)
        log.info("val step %d (engine v%d): avg@%d %.3f pass@%d %.3f maj@%d %.3f  %s", step, int(res["val/version"]),
                 lg.val_n, res["val/avg_at_k"], lg.val_n, res["val/pass_at_k"], lg.val_n, res["val/maj_at_k"],
                 val_subsets_line(res))
        self.last_val = res

    def checkpoint(self, step: int) -> None:
        import ray

        ckpt = self.run_dir / "checkpoints" / f"step_{step}"
        self.placed.on_learners("save_checkpoint", str(ckpt))
        state = ray.get(self.placed.replay.state_dict.remote())
        (ckpt / "replay.json").write_text(json.dumps(state))
        meta = json.dumps({"step": step, "version": self.version})
        (ckpt / "meta.json").write_text(meta)  # written last: a checkpoint without it is incomplete
        (self.run_dir / "checkpoints" / "latest.json").write_text(meta)
        _prune(self.run_dir / "checkpoints", self.cfg.checkpoint.keep_last)
        log.info("checkpoint %s", ckpt)

    def finish(self) -> dict[str, Any]:
        self.placed.wait_push()
        if self.cfg.checkpoint.export_hf:
            self.placed.on_learners("export_hf", str(self.run_dir / "hf"))
        return {**getattr(self, "last_metrics", {}), **getattr(self, "last_val", {})}


def archive_previous_run(run_dir: Path) -> Path | None:
    """A fresh (not resumed) run must not append to an earlier run's metrics or mix checkpoints with it,
    and must not delete it either: the earlier run is renamed to ``<run_dir>.<n>`` (first free n).
    Returns the new name, or None when ``run_dir`` holds no run."""
    if not ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        return None
    n = 1
    while (moved := run_dir.with_name(f"{run_dir.name}.{n}")).exists():
        n += 1
    run_dir.rename(moved)
    return moved


def _checkpoint_to_resume(path: Path) -> Path:
    """``--resume`` takes a run directory (its latest checkpoint) or one checkpoint directory."""
    if (path / "meta.json").exists():
        return path
    latest = path / "checkpoints" / "latest.json"
    if not latest.exists():
        raise FileNotFoundError(f"--resume {path}: neither a checkpoint nor a run with checkpoints/latest.json")
    return path / "checkpoints" / f"step_{json.loads(latest.read_text())['step']}"


def write_batch(groups: list, path: Path) -> None:
    import msgpack

    from async_dapo.wire import encode_group

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb([encode_group(g) for g in groups]))


def read_batch(path: Path) -> list:
    import msgpack

    from async_dapo.wire import decode_group

    return [decode_group(b) for b in msgpack.unpackb(path.read_bytes())]


def _prune(root: Path, keep: int) -> None:
    import shutil

    done = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old)
