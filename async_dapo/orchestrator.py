"""The orchestrator: place every actor with Ray, wire the group stream and the weight group, run the DAPO
loop, and shut everything down on completion, Ctrl-C or SIGTERM.

One code path serves every mode. η = ``replay.max_staleness`` alone decides how far rollouts run ahead:
η = 0 is synchronous (the queue admits the next batch's prompts only once the engines run the newest
weights), η = 1 overlaps one step, larger η is fully asynchronous with that bound.

Faults and the fleet (docs/reliability.md): while it waits for a batch (and for a push) the orchestrator lets
the supervisor (async_dapo.fleet.supervise) heartbeat the rollout actors, take a dead or hung one out, bring its
replacement (or an engine added with ``async-dapo scale``) in, all in the background: training goes on
with the other engines' groups. A dead learner rank, a queue that cannot fill a batch,
or silence past ``replay.silence_timeout_s`` stops the run with one line naming what failed and the last
checkpoint (:class:`~async_dapo.waits.RunFailed`). Where things live on disk, which checkpoint a resume
continues from and what it rewinds is async_dapo.checkpoint.run_dir.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from async_dapo.checkpoint import run_dir as checkpoints
from async_dapo.checkpoint.run_dir import RunDir
from async_dapo.config import Config, dump_config
from async_dapo.data.rows import val_rows
from async_dapo.replay.partials import saved_limit
from async_dapo.rollout.evaluate import merge_parts, split_rows, val_sampling_params
from async_dapo.metrics import (
    ENGINE_SUMS, MetricsWriter, PhaseClock, fleet_metrics, progress_line, step_metrics, timed, val_subsets_line,
    write_atomic,
)
from async_dapo.stream.wire import read_groups, write_groups
from async_dapo.fleet.supervise import EngineSupervisor
from async_dapo.waits import ActorDied, RestartsExhausted, RunFailed, WaitExpired

log = logging.getLogger("async_dapo")


def train(cfg: Config, resume: Path | None = None, clock: PhaseClock | None = None) -> dict[str, Any]:
    """Run DAPO training as configured; returns the last step's metrics. RunFailed: the run cannot go on.
    ``clock`` (the CLI's, which already timed the bootstrap) receives the wall time by phase."""
    with Run(cfg, resume, clock) as run:
        for step in range(run.step + 1, cfg.learner.total_steps + 1):
            t0 = time.perf_counter()
            batch = run.next_batch()                       # B fresh, mixed-outcome groups (engines supervised)
            stats = run.train(batch)                       # one DAPO step on every rank: version += 1
            if step % cfg.weight_sync.every_k_steps == 0:
                run.push_weights()                         # engines load while the next step trains
            run.log(step, batch, stats, t0)
            if run.due(step, cfg.logging.val_every_steps):
                run.validate(step)                         # on every engine; the learner does not wait
            if run.due(step, cfg.checkpoint.every_steps):
                run.checkpoint(step)                       # and at the last step
            if step == run.last_step:                      # learner.total_steps, or `async-dapo stop` asked
                break
        return run.finish()


class Run:
    """The placed actors of one run and the operations the loop calls (each one short)."""

    def __init__(self, cfg: Config, resume: Path | None, clock: PhaseClock | None = None) -> None:
        self.cfg, self.resume = cfg, resume
        self.clock = clock or PhaseClock()
        self.dir = RunDir(Path(cfg.logging.run_dir))
        self.step, self.version = 0, 0
        self._started_ray = False
        self._ray_park = None  # set it to let connect_ray's parked thread end
        self._last: dict[str, Any] = {"engines": {}, "t": time.perf_counter()}  # the engines' previous counters
        self._engine_sums = dict.fromkeys(ENGINE_SUMS, 0.0)  # the engines' counters since the start, all processes
        self._t_start = time.perf_counter()
        self._steps_done = 0
        self._push_failed_before = False
        self._push_stall_s = 0.0
        self._val_rows: list | None = None
        self._val: dict[str, Any] | None = None  # the validation in flight (see _collect_validation)
        self._val_skipped = 0  # validations not started because the previous one was still running
        self._predicted_s: float | None = None  # the planner's step time (logging.plan_profile)
        self._step_times: list[float] = []
        self._stop_at: int | None = None  # the step in progress when `async-dapo stop` asked
        self._fetched: list | None = None  # the batch taken from the queue for the step in progress

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Run":
        try:
            self._start()
        except BaseException as exc:
            self._shutdown()
            if isinstance(exc, RunFailed):
                raise RunFailed(f"{exc}; last checkpoint: {self.last_checkpoint()}") from None
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._shutdown()
        log.info(self.clock.table() + self._predicted_line() + self._waste_line())
        if isinstance(exc, RunFailed):  # one line: what failed, where to resume from
            raise RunFailed(f"{exc}; last checkpoint: {self.last_checkpoint()}") from None

    def _predict(self) -> None:
        """The planner's steady-state step time for this run (logging.plan_profile), said at the start."""
        from async_dapo.planning import predicted_step_s

        self._predicted_s = predicted_step_s(self.cfg.logging.plan_profile, self.cfg)
        log.info("planner (%s): %.3f s per step predicted", self.cfg.logging.plan_profile, self._predicted_s)

    def _predicted_line(self) -> str:
        """Predicted against measured step time, the measured one over the steps after the planner's warm-up
        (a quarter of the run, at most 10 steps, as the planner discards)."""
        times = self._step_times[min(10, len(self._step_times) // 4):]
        if self._predicted_s is None or not times:
            return ""
        measured = sum(times) / len(times)
        return (f"\n  {'step (planner)':<18} {self._predicted_s:8.3f} s predicted, {measured:.3f} s measured "
                f"over {len(times)} steps ({measured / self._predicted_s - 1:+.0%})")

    def _waste_line(self) -> str:
        """The response tokens generated and never trained, by reason, those kept across an abort and those an
        engine that left made and another continued (rollout/wasted_tokens/<reason>, rollout/continued_tokens,
        rollout/carried_tokens at the last step)."""
        m = getattr(self, "last_metrics", {})
        waste = {k.rsplit("/", 1)[1]: int(v) for k, v in m.items() if k.startswith("rollout/wasted_tokens/")}
        if not waste:
            return ""
        by_reason = ", ".join(f"{k} {v}" for k, v in waste.items())
        return (f"\n  {'tokens not trained':<18} {sum(waste.values()):8d} ({by_reason}); continued after an abort: "
                f"{int(m.get('rollout/continued_tokens', 0))}; continued on another engine: "
                f"{int(m.get('rollout/carried_tokens', 0))}")

    def last_checkpoint(self) -> str:
        return checkpoints.last_checkpoint(self.dir.path)

    @staticmethod
    def _on_sigterm(signum, frame) -> None:
        # Same path as Ctrl-C: unwind the loop so that __exit__ ends every actor and engine.
        raise KeyboardInterrupt("SIGTERM")

    def _start(self) -> None:
        import ray

        from async_dapo.device import seed_everything
        from async_dapo.fleet.placement import connect_ray, place
        from async_dapo.preflight import check_prompts, check_reward_function

        cfg = self.cfg
        seed_everything(cfg.logging.seed)
        with self.clock.phase("preflight"):
            check_reward_function(cfg)  # before anything starts: a bad config costs seconds, not a cluster
            check_prompts(cfg)
        # (the CLI archives before it opens run_dir/train.log; this covers callers of train() itself)
        if self.resume is None and (moved := checkpoints.archive_previous_run(self.dir.path)) is not None:
            log.info("run_dir %s held an earlier run: moved it to %s", self.dir.path, moved)
        dump_config(cfg, self.dir.config)
        if cfg.logging.plan_profile is not None:
            self._predict()
        self.dir.drop_scale_request()
        self.dir.drop_stop_request()
        if not ray.is_initialized():
            with self.clock.phase("ray_start"):
                self._ray_park = connect_ray(cfg)
            self._started_ray = True
        # After ray.init, which installs a SIGTERM handler of its own that skips our cleanup.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.resume is not None:
            self.ckpt = checkpoints.resume_target(self.resume)
            self.step, self.version = checkpoints.read_meta(self.ckpt)
            checkpoints.rewind_to(self.dir, self.step)  # the killed run's steps after the checkpoint
        with self.clock.phase("placement"):
            self.placed = place(cfg, initial_version=self.version)
        self.supervisor = EngineSupervisor(self.placed, self.last_checkpoint, self.placed.push_weights,
                                           self.placed.wait_push, self.placed.push_idle,
                                           on_change=self._write_actors, clock=self.clock, run_dir=self.dir)
        self.metrics = MetricsWriter(self.dir.path, cfg.logging.tensorboard,
                                     purge_step=self.step + 1 if self.resume is not None else None)
        with self.clock.phase("placement"):
            if self.resume is not None:
                self._restore()
            if failed := self.placed.start_rollouts():
                raise RunFailed("start rollouts: " + "; ".join(f"rollout actor {r} {why}" for r, why in failed.items()))
        self._write_actors()
        self._last["t"] = self._t_start = time.perf_counter()
        if self.step == 0 and cfg.logging.val_every_steps and cfg.logging.val_before_train:
            self.validate(0)

    def _restore(self) -> None:
        ckpt = self.ckpt
        versions = self.placed.on_learners("load_checkpoint", str(ckpt))
        if set(versions) != {self.version}:
            raise RunFailed(f"{ckpt}: learner ranks restored versions {versions}, meta.json says {self.version}")
        state = checkpoints.read_replay_state(ckpt, self.cfg.transport.max_message_bytes,
                                              saved_limit(self.cfg.replay.capacity_groups))
        self.placed.get(self.placed.replay.load_state_dict.remote(state), "replay state")
        self._push_now(self.version)  # engines restart from model.path: give them the restored weights first
        log.info("resumed from %s at step %d, version %d", ckpt, self.step, self.version)

    def _shutdown(self) -> None:
        """End every actor and our own Ray instance; then record the wall time by phase (metrics.jsonl
        and TensorBoard, at the last step) and close the writers."""
        import ray

        with self.clock.phase("shutdown"):
            placed = getattr(self, "placed", None)
            if placed is not None:
                self._keep_work_in_flight()
                placed.shutdown()
            if self._started_ray and ray.is_initialized():
                ray.shutdown()
            if self._ray_park is not None:
                self._ray_park.set()  # the parked ray.init thread may end now
        if getattr(self, "metrics", None) is not None:
            self.metrics.write(self.step, self.clock.metrics())
            self.metrics.close()

    def _keep_work_in_flight(self) -> None:
        """However the run ends: if the newest checkpoint is of the learner's current step, its replay state is
        rewritten with the queue's state now, so that ``--resume`` continues the work generated since it was
        taken (the groups in flight, as last reported, the groups queued, and the batch of a step that did not
        finish). Past it, that work was made for steps the resumed run trains again, and is lost (said here).
        Bounded by placement.call_timeout_s; a failure leaves the checkpoint as it was."""
        try:
            latest = checkpoints.latest_complete(self.dir.checkpoints)
            if latest is None:
                return
            if checkpoints.read_meta(latest) != (self.step, self.version):
                log.info("the work in flight is not kept: the learner trained past the last checkpoint %s "
                         "(checkpoint.every_steps)", latest)
                return
            state = self.placed.get(self.placed.replay.state_dict.remote(self._fetched or ()), "replay state")
            checkpoints.write_replay_state(latest, state)
            log.info("the work in flight at the end (%d prompts) is kept with %s: --resume continues it",
                     len(state["partials"]), latest)
        except BaseException as exc:  # a second Ctrl-C / SIGTERM included: the actors must still be ended
            log.warning("the work in flight at the end is not kept: %r", exc)

    # ------------------------------------------------------------------ loop operations
    @timed("waiting_for_data")
    def next_batch(self) -> list:
        t0 = time.perf_counter()
        if (recorded := self.cfg.data.replay_batches) is not None:
            batch = read_groups(self.dir.batch(self.step + 1, Path(recorded)))
        else:
            batch = self._await_batch()
        if self.cfg.logging.record_batches:
            write_groups(batch, self.dir.batch(self.step + 1))
        self._fetched = batch if recorded is None else None  # out of the queue, not trained yet
        self._wait_data_s = time.perf_counter() - t0
        self._batch_version = self.version  # the weights this batch is trained on
        return batch

    def _await_batch(self) -> list:
        """Poll the queue (2 s at a time; 0.2 s while a regroup moves on) for B groups; between polls the
        supervisor does its bounded round (heartbeats, failures, engines coming in or leaving). Stops the run
        when the queue reports it cannot fill a batch, or when no group arrived for replay.silence_timeout_s
        (silence, not duration: a slow engine that delivers is fine)."""
        rc = self.cfg.replay
        while True:
            self.supervisor.poll(self.version)
            wait_s = 0.2 if self.supervisor.busy else 2.0  # a regroup moves on at each poll: poll it often
            got = self.placed.get(self.placed.replay.get_batch.remote(self.version, wait_s), "replay get_batch")
            if got["batch"] is not None:
                return got["batch"]
            if got["problem"]:
                raise RunFailed(f"no batch can be filled: {got['problem']}")
            if got["silent_s"] > rc.silence_timeout_s:
                q = self.placed.get(self.placed.replay.stats.remote(), "replay stats")
                alive = self.supervisor.serving - len(self.supervisor.failed_engines())
                why = ", ".join(f"{v} {k[10:]}" for k, v in q.items() if k.startswith("abandoned/")) or "none"
                raise RunFailed(f"no group for {got['silent_s']:.0f} s (replay.silence_timeout_s); {alive} of "
                                f"{self.supervisor.serving} serving rollout actors alive "
                                f"({len(self.supervisor.starting)} starting); {q['running']} running, "
                                f"{q['depth']} queued, admission capacity {q['capacity_to_admit']}; "
                                f"abandoned: {why}")

    @timed("training")
    def train(self, batch: list) -> dict[str, float]:
        stats = self.placed.on_learners("train_step", self.placed.put(batch))[0]
        self.version, self._fetched = int(stats["version"]), None
        self._write_prompts(batch)
        return stats

    def _write_actors(self) -> None:
        write_atomic(self.dir.actors, json.dumps(self.placed.pids()))

    def _write_prompts(self, batch: list) -> None:
        """prompts.jsonl: the (epoch, prompt index) pairs each step trained on (rewound on resume), so a
        run's data lineage can be audited: no prompt twice in an epoch, none skipped."""
        line = json.dumps({"step": self.step + 1, "prompts": [[g.epoch, g.prompt_index] for g in batch]})
        with self.dir.prompts.open("a") as f:
            f.write(line + "\n")

    @timed("weight_push")
    def push_weights(self) -> None:
        """Push the current weights. If the previous push failed and an engine died or hung under it, the
        supervisor takes that engine out and rebuilds the group with the others (which pushes the current
        weights itself); if every engine is healthy, the failure was transient and this push simply goes
        ahead (a second failure in a row then stops the run)."""
        t0 = time.perf_counter()
        try:
            if self._previous_push_ok():
                self.placed.push_weights(self.version)
        finally:
            self._push_stall_s = time.perf_counter() - t0  # what the loop lost to the push this step

    def _previous_push_ok(self) -> bool:
        """Wait for the previous push, heartbeating meanwhile (an engine hung under it is killed, which ends
        the wait); False when the supervisor rebuilds the group, which pushes the current weights itself
        (while it forms the group, pushes are skipped: the engines go on with the weights they have)."""
        if self.supervisor.forming:
            return False
        if self.supervisor.pushing:  # a regroup's push: the supervisor lets its joiners in once it landed
            self.supervisor.finish_push(self.version)
        try:
            self.placed.wait_push(meanwhile=lambda: self.supervisor.detect(self.version))
        except RunFailed as exc:
            if isinstance(exc, (ActorDied, RestartsExhausted)):  # (the latter from the heartbeats meanwhile)
                raise
            log.warning("%s; checking the engines", exc)
            if self.supervisor.check(self.version):  # an engine failed or left: the group followed, pushed
                self._push_failed_before = False
                return False
            if self._push_failed_before:  # a second failure in a row that no engine explains
                raise
            self._push_failed_before = True
            return True
        self._push_failed_before = False
        if self.supervisor.regroup_pending:  # an engine left after the push: the group follows first
            self.supervisor.poll(self.version)
            return False
        return True

    def _push_now(self, version: int) -> None:
        """Push ``version`` to every engine and wait until they run it (resume, engine replacement)."""
        self.placed.push_weights(version)
        self.placed.wait_push()

    @property
    def last_step(self) -> int:
        """learner.total_steps, or the step in progress when ``async-dapo stop`` asked."""
        return self.cfg.learner.total_steps if self._stop_at is None else self._stop_at

    def due(self, step: int, every: int) -> bool:
        return every > 0 and (step % every == 0 or step == self.last_step)

    @timed("logging")
    def log(self, step: int, batch: list, stats: dict[str, float], t0: float) -> None:
        self._collect_validation(block=False)  # a validation that finished meanwhile
        queue, engines, t, push = self.placed.step_stats()
        now = time.perf_counter()
        per_engine, fleet = fleet_metrics(engines, self._last["engines"], t - self._last["t"], batch)
        # an engine that did not answer this time keeps its last counters (its next answer is a delta of them)
        self._last = {"engines": {**self._last["engines"], **engines}, "t": t}
        for key in ENGINE_SUMS:  # engines count per process: summed over steps here
            self._engine_sums[key] += fleet.pop(key)
        timing = {"step_s": now - t0, "wait_data_s": self._wait_data_s, "engine_sums": self._engine_sums,
                  "weight_push_s": push.get("push_s", 0.0), "weight_push_stall_s": self._push_stall_s, **fleet}
        self._push_stall_s = 0.0  # a step without a push (weight_sync.every_k_steps > 1) stalls nothing
        m = {**step_metrics(batch, stats, queue, trained_version=self._batch_version, timing=timing), **per_engine}
        m["rollout/engines"] = float(self.supervisor.serving)  # serving, whether or not it answered in time
        m["rollout/engine_restarts"] = float(self.supervisor.restarts)
        m["rollout/engines_starting"] = float(len(self.supervisor.starting))
        m["val/skipped"] = float(self._val_skipped)
        self._step_times.append(m["perf/time_per_step"])
        self.metrics.write(step, m)
        self.step = step
        self._steps_done += 1
        eta = (now - self._t_start) / self._steps_done * (self.cfg.learner.total_steps - step)
        log.info(progress_line(step, self.cfg.learner.total_steps, m, eta))
        if self.last_step > step and self.dir.stop_requested():  # read once per step: its last step is this one
            self._stop_at = step
            log.info("stop requested (%s): step %d is the run's last; it checkpoints and ends as at "
                     "learner.total_steps (%d), and --resume continues it", self.dir.stop, step,
                     self.cfg.learner.total_steps)
        self.last_metrics = m

    @timed("validation")
    def validate(self, step: int) -> None:
        """Start a validation of the current weights, its rows spread over every engine; the loop does not
        wait for it. At most one runs at a time: if the previous one is still running, this one is skipped
        and counted (``val/skipped``; a metric never stalls the learner), except at the last step, where the
        previous one is awaited (training is over) so that the final weights are validated (unless no engine
        runs them yet: then it is skipped and counted like any other)."""
        self._collect_validation(block=step == self.last_step)
        if self._val is not None:
            self._val_skipped += 1
            log.warning("validation at step %d skipped: the one started at step %d is still running "
                        "(%d skipped so far, val/skipped)", step, self._val["step"], self._val_skipped)
            return
        self._start_validation(step)

    def _start_validation(self, step: int) -> None:
        if self._val_rows is None:  # built once: a file's dedup is logged once
            self._val_rows = val_rows(self.cfg)
        engines = self.placed.ready()
        if not engines:  # the only engine is being replaced: nothing to validate on
            self._val_skipped += 1
            log.warning("validation at step %d skipped: no engine serving (val/skipped)", step)
            return
        parts = split_rows(self._val_rows, len(engines))
        params, k = val_sampling_params(self.cfg), self.cfg.logging.val_n
        refs = [e.validate.remote([self._val_rows[i] for i in idx], k, params) for e, idx in zip(engines, parts)]
        self._val = {"step": step, "parts": parts, "refs": refs, "t0": time.perf_counter()}

    def _collect_validation(self, block: bool) -> None:
        """Log the validation in flight once every engine has answered, against the step it started at (and
        the policy versions it sampled: val/version .. val/version_max). ``block``: wait for it, at most
        logging.val_timeout_s from its start. A failed or late validation is skipped with a warning: a
        metric never ends the run (a dead engine is the supervisor's business)."""
        import ray

        v, lg = self._val, self.cfg.logging
        if v is None:
            return
        left = v["t0"] + lg.val_timeout_s - time.perf_counter()
        ready, _ = ray.wait(v["refs"], num_returns=len(v["refs"]), timeout=max(0.0, left) if block else 0)
        if len(ready) < len(v["refs"]) and not block and left > 0:
            return  # still running: the learner goes on
        self._val = None
        try:
            if len(ready) < len(v["refs"]):
                raise WaitExpired(f"not every engine answered in {lg.val_timeout_s:.0f} s (logging.val_timeout_s)")
            res = merge_parts(v["parts"], self.placed.get(v["refs"], "validation"), self._val_rows)
        except RunFailed as exc:
            log.warning("validation at step %d skipped: %s", v["step"], exc)
            return
        res["val/seconds"] = time.perf_counter() - v["t0"]
        res["val/engines"] = float(len(v["refs"]))
        self.metrics.write(v["step"], res)
        log.info("val step %d (v%d..v%d, %d distinct prompts, %d engines, %.1f s): avg@%d %.3f pass@%d %.3f "
                 "maj@%d %.3f  %s", v["step"], int(res["val/version"]), int(res["val/version_max"]),
                 int(res["val/distinct_prompts"]), len(v["refs"]), res["val/seconds"], lg.val_n, res["val/avg_at_k"],
                 lg.val_n, res["val/pass_at_k"], lg.val_n, res["val/maj_at_k"], val_subsets_line(res))
        self.last_val = res

    @timed("checkpoint")
    def checkpoint(self, step: int) -> None:
        ckpt = self.dir.step_dir(step)
        checkpoints.begin(ckpt)
        self.placed.on_learners("save_checkpoint", str(ckpt))
        state = self.placed.get(self.placed.replay.state_dict.remote(), "replay state")
        checkpoints.commit(self.dir, ckpt, step, self.version, state, self.cfg.checkpoint.keep_last)
        log.info("checkpoint %s", ckpt)

    def finish(self) -> dict[str, Any]:
        with self.clock.phase("validation"):
            self._collect_validation(block=True)
        try:
            self.placed.wait_push()
        except RunFailed as exc:
            if isinstance(exc, ActorDied):
                raise
            log.warning("the last weight push failed (%s); the learners' checkpoint and export are unaffected", exc)
        if self.cfg.checkpoint.export_hf:
            self.placed.on_learners("export_hf", str(self.dir.hf))
        return {**getattr(self, "last_metrics", {}), **getattr(self, "last_val", {})}
