"""``async-dapo`` command line: bootstrap | eval | train | scale | stop | plan | from-verl | config-reference.

Config errors print one line (``error: <dotted.key>: <problem>``) and exit 2; a run that cannot go on (a dead
learner rank, restarts exhausted, a batch that cannot be filled, silence, and any other exception in the
driver: a lost Ray object, an out-of-memory kill, a bug) prints one line
(``run failed: <what>; last checkpoint: <path>``) and exits 1; the full traceback goes to the run's log file
(``<logging.run_dir>/train.log``, which also holds every progress line), not to the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from async_dapo.config import Config, ConfigError, config_from_mapping, config_yaml, load_config
from async_dapo.data.rows import DatasetError
from async_dapo.waits import RunFailed

log = logging.getLogger("async_dapo")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async-dapo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in [
        ("bootstrap", "build (or reuse) the tiny CPU model: tokenizer, Qwen2, supervised warm start"),
        ("eval", "held-out avg@k / pass@k / maj@k of the model through an SGLang engine"),
        ("train", "run DAPO training"),
    ]:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config", type=Path, required=True, help="YAML config file")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="override a config field (repeatable); value parsed as YAML")
        if name == "bootstrap":
            sp.add_argument("--force", action="store_true", help="rebuild even if cached")
        if name == "eval":
            sp.add_argument("--repeats", type=_positive, default=1, metavar="N",
                            help="validate N times on the same weights and report the spread of avg@k "
                                 "(the evaluation noise a training gain must stand out from)")
        if name == "train":
            sp.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                            help="continue the run in RUN_DIR from its latest checkpoint "
                                 "(or from RUN_DIR/checkpoints/step_N)")
            sp.add_argument("--print-config", action="store_true",
                            help="print the run's resolved config (every default filled in) as YAML and exit")
    sp = sub.add_parser("scale", help="ask a running run for N rollout engines (added or removed while it trains)")
    sp.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running run's logging.run_dir")
    sp.add_argument("--engines", type=_positive, required=True, metavar="N",
                    help="rollout engines wanted, 1 .. placement.max_engines of the run")
    sp.add_argument("--wait-s", type=_seconds, default=0.0, metavar="S",
                    help="wait up to S seconds for the run to apply or refuse the request and exit 0 only if it "
                         "was applied (default 0: exit once the request is written)")
    sp = sub.add_parser("stop", help="ask a running run to end after its current step, with a checkpoint, as at "
                        "learner.total_steps (train --resume continues it)")
    sp.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running run's logging.run_dir")
    sub.add_parser("config-reference", help="print the config reference (every section and field, its type, "
                   "default, unit and rules) as Markdown: docs/config.md")
    sp = sub.add_parser("from-verl", help="a verl DAPO launch script (or its key=value overrides) as this "
                        "project's config: YAML on stdout, what was mapped, derived or has no equivalent on stderr")
    sp.add_argument("source", nargs="+", metavar="SCRIPT_OR_OVERRIDES",
                    help="a launch script's path (its variables expanded from the script and the environment), "
                         "or verl overrides such as data.train_batch_size=512")
    _plan_parser(sub)
    return p


def _plan_parser(sub) -> None:
    sp = sub.add_parser("plan", help="predict throughput, idle and staleness from a hardware profile "
                        "(discrete-event model, docs/planning.md); no Ray, no engine")
    sp.add_argument("--config", type=Path, required=True, help="YAML config file: the run's shape")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                    help="override a config field (repeatable); value parsed as YAML")
    sp.add_argument("--profile", type=Path, required=True, help="profile YAML (configs/profiles/)")
    sp.add_argument("--steps", type=_positive, default=60, help="steps simulated per plan (first 10 discarded)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the simulated lengths and keep draws")
    sp.add_argument("--validate", type=Path, default=None, metavar="TABLE.csv",
                    help="compare with a measured table (tools/bench/throughput.py's throughput.csv)")
    sp.add_argument("--measured-keep-rate", action="store_true",
                    help="with --validate, a diagnostic: predict each row with its own measured keep_rate")
    sp.add_argument("--recommend", action="store_true",
                    help="search split, eta, weight_sync.every_k_steps and rollout.update_mode")
    sp.add_argument("--total-gpus", type=_positive, default=None, metavar="N",
                    help="with --recommend: devices to split between engines and learner ranks")
    sp.add_argument("--max-mean-staleness", type=float, default=None, metavar="S",
                    help="with --recommend: the best plan's mean staleness must be <= S")


def _plan(cfg: Config, args) -> int:
    """Print the plan of ``cfg`` on the profile (markdown), and the validation or the search if asked."""
    from async_dapo import planning as pl

    profile, shape = pl.load_profile(args.profile), pl.Shape.from_config(cfg)
    warmup = min(10, args.steps // 6)
    cols = ["plan", "eta", "update_mode", "steps_per_s", "samples_per_s", "gen_tokens_per_s", "learner_idle",
            "rollout_idle", "occupancy", "tail_share", "staleness_mean", "staleness_max", "keep_rate",
            "trained_length_ratio", "step_s", "speedup"]
    pred = pl.predict(profile, shape, args.steps, warmup, args.seed, sync_baseline=False)
    sync = pl.predict(profile, shape.synchronous(), args.steps, warmup, args.seed, sync_baseline=False)
    pred.speedup = pred.steps_per_s / sync.steps_per_s
    rows = [{"plan": "config", "eta": shape.eta, "update_mode": shape.update_mode, **pred.row()},
            {"plan": "sync", "eta": 0, "update_mode": shape.update_mode, **sync.row(), "speedup": 1.0}]
    print(f"## plan: profile {profile.name} ({profile.hardware}); B={shape.B} x G={shape.G}, "
          f"{shape.num_engines} engine(s), {shape.learner_ranks} learner rank(s), {args.steps} steps "
          f"(first {warmup} discarded)\n\n{pl.markdown(rows, cols)}\n")
    if args.validate is not None:
        res = pl.validate(profile, args.validate, shape, args.steps, warmup, args.seed, args.measured_keep_rate)
        vcols = (["mode", "eta"] + [f"{k}_{s}" for k in pl.TOLERANCE for s in ("pred", "meas", "err", "ok")]
                 + [f"{k}_{s}" for k in pl.COMPARED for s in ("pred", "meas") if f"{k}_meas" in (res or [{}])[0]])
        print(f"## validation against {args.validate}\n\n{pl.markdown(res, vcols)}\n")
    if args.recommend:
        rec = pl.recommend(profile, shape, args.total_gpus, max_mean_staleness=args.max_mean_staleness)
        rcols = ["engines", "learner_ranks", "eta", "every_k_steps", "update_mode", "samples_per_s",
                 "steps_per_s", "speedup", "staleness_mean", "staleness_max", "learner_idle", "rollout_idle"]
        print(f"## search ({len(rec.rows)} plans, {rec.seconds:.1f} s), fastest first\n\n"
              f"{pl.markdown(rec.rows[:20], rcols)}\n\nbest: " + (", ".join(f"{c} {rec.best[c]:.3g}" if
              isinstance(rec.best[c], float) else f"{c} {rec.best[c]}" for c in rcols) if rec.best else
              "none within the staleness bound"))
    return 0


def _bootstrap(cfg: Config, force: bool = False) -> None:
    from async_dapo.bootstrap import bootstrap

    rep = bootstrap(cfg, force=force)
    log.info("bootstrap %s: %s", "cached" if rep.cached else "built", json.dumps(asdict(rep)))


def _eval(cfg: Config, repeats: int = 1) -> None:
    """Validate the configured model ``repeats`` times through a rollout actor's sampling path, in this
    process (no Ray): the same function, sample type and scoring as training and in-run validation."""
    from async_dapo.data.rows import val_rows
    from async_dapo.rollout.evaluate import merge_parts, val_sampling_params
    from async_dapo.metrics import val_subsets_line
    from async_dapo.rollout.actor import RolloutWorker

    if cfg.model.bootstrap is not None:
        _bootstrap(cfg)
    rows, k, worker = val_rows(cfg), cfg.logging.val_n, None
    avgs = []
    try:
        with _deadline(cfg.placement.start_timeout_s, "engine start (placement.start_timeout_s)"):
            worker = RolloutWorker(cfg, 0)
        for _ in range(repeats):  # the engine's sampler moves on: each pass draws new samples
            t0 = time.perf_counter()
            m = merge_parts([list(range(len(rows)))], [worker.validate(rows, k, val_sampling_params(cfg))], rows)
            seconds = time.perf_counter() - t0
            avgs.append(m["val/avg_at_k"])
            log.info("val avg@%d %.3f  pass@%d %.3f  maj@%d %.3f  (%d distinct prompts, %d tokens, %.0f tok/s)  %s",
                     k, m["val/avg_at_k"], k, m["val/pass_at_k"], k, m["val/maj_at_k"], len(rows),
                     m["val/gen_tokens"], m["val/gen_tokens"] / seconds, val_subsets_line(m))
    finally:
        if worker is not None:  # started, even if past its bound
            worker.shutdown()
    if repeats > 1:
        log.info("avg@%d over %d validations of the same weights: mean %.4f, sd %.4f, range %.4f-%.4f",
                 k, repeats, statistics.mean(avgs), statistics.stdev(avgs), min(avgs), max(avgs))


def _scale(run_dir: Path, engines: int, wait_s: float = 0.0) -> int:
    """Write RUN_DIR/scale.json, numbered (request #N); the run's supervisor applies it at its next round
    (async_dapo.fleet.supervise) and records ``scale`` or ``scale_refused`` with its number in fleet.jsonl. With
    ``wait_s`` > 0, wait for that record: 0 if applied, 1 (one line saying why) if refused, superseded by a
    later request, or not answered in time."""
    from async_dapo.checkpoint.run_dir import RunDir, fleet_end, write_scale_request
    from async_dapo.fleet.supervise import scale_target

    rd = RunDir(run_dir)
    if not rd.config.exists():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.yaml)")
    try:
        # the run's planner profile is not needed here (its path may be relative to the run's start directory)
        scale_target(load_config(rd.config, ["logging.plan_profile=null"]), json.dumps({"engines": engines}))
    except ValueError as exc:
        raise ConfigError(f"--engines: {exc}") from None
    offset = fleet_end(rd)  # the run's answer to this request comes after
    try:
        written = write_scale_request(rd, {"engines": engines, "asked_at": time.time()})
    except OSError as exc:  # the lock held too long (TimeoutError), scale.json not replaceable
        print(f"error: scale request not written: {exc}", file=sys.stderr)
        return 1
    serving = len(json.loads(rd.actors.read_text()).get("rollout", {})) if rd.actors.exists() else 0
    log.info("request #%d written (engines=%d): asked %s for %d rollout engine(s) (%d serving now); the run logs "
             "each change and records it in %s", written.seq, engines, run_dir, engines, serving, rd.fleet)
    return _await_scale(rd, written.seq, offset, wait_s) if wait_s > 0 else 0


def _stop(run_dir: Path) -> int:
    """Write RUN_DIR/stop.json; the run reads it after each step's log line, makes that step its last
    (validation and checkpoint as at learner.total_steps) and ends with exit status 0."""
    from async_dapo.checkpoint.run_dir import RunDir
    from async_dapo.metrics import write_atomic

    rd = RunDir(run_dir)
    if not rd.config.exists():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.yaml)")
    write_atomic(rd.stop, json.dumps({"asked_at": time.time()}))
    log.info("asked %s to stop after its current step (it checkpoints first); continue it with "
             "async-dapo train --config %s --resume %s", run_dir, rd.config, run_dir)
    return 0


def _await_scale(rd, seq: int, offset: int, wait_s: float) -> int:
    """The run's answer to request #``seq``: the first ``scale``/``scale_refused`` record in fleet.jsonl
    after ``offset`` that is about it, about a later request (which superseded it: the run reads only the
    newest), or about a scale.json the run could not read."""
    from async_dapo.checkpoint.run_dir import fleet_events

    deadline = time.monotonic() + wait_s
    while True:
        try:
            events, offset = fleet_events(rd, offset)
        except ValueError as exc:
            print(f"error: scale request #{seq} written, but its answer cannot be read: {exc}", file=sys.stderr)
            return 1
        for e in events:
            if e.get("event") not in ("scale", "scale_refused"):
                continue
            about = e.get("seq")
            if about == seq and e["event"] == "scale":
                log.info("request #%d applied by the run: scaling to %s engine(s) (%s records each engine that "
                         "joins or leaves)", seq, e.get("engines"), rd.fleet)
                return 0
            if about == seq:
                print(f"error: scale request #{seq} refused by the run: {e.get('reason')}", file=sys.stderr)
                return 1
            if isinstance(about, int) and about > seq:
                print(f"error: scale request #{seq} superseded by request #{about} before the run read it "
                      f"(the run follows #{about})", file=sys.stderr)
                return 1
            if about is None and e["event"] == "scale_refused":
                print(f"error: scale request #{seq} written, but the run refused the scale.json it found: "
                      f"{e.get('reason')}", file=sys.stderr)
                return 1
        if time.monotonic() >= deadline:
            print(f"error: scale request #{seq} written, but the run did not answer it in {wait_s:g} s (is it "
                  f"running? it reads {rd.scale} between its polls; {rd.fleet} records each answer)",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)


def _from_verl(source: list[str]) -> int:
    """Print the converted config (stdout) and what happened to every key (stderr); exit 2 with a line naming
    the key when the config does not load as it is (a value out of range here, a rule such as a shared
    run_dir on several nodes), so the user knows what to edit."""
    import os

    from async_dapo.config.from_verl import convert, parse_overrides, script_overrides, to_yaml

    path = Path(source[0])
    try:
        if len(source) == 1 and path.is_file():
            overrides = script_overrides(path.read_text(), os.environ)
        else:
            overrides = parse_overrides(source)
        conversion = convert(overrides)
    except (ValueError, OSError) as exc:  # an unreadable script or line, no override, an unsupported estimator
        raise ConfigError(f"from-verl: {exc}") from None
    print(conversion.report(), end="", file=sys.stderr)
    print(to_yaml(conversion), end="")
    try:  # every range and rule, as a run would check them
        config_from_mapping(conversion.config)
    except ConfigError as exc:
        print(f"error: the converted config does not load yet: {exc}; set that in the YAML", file=sys.stderr)
        return 2
    return 0


def train_run_dir(cfg: Config, resume: Path | None) -> Config:
    """A resumed run keeps its own directory (RUN_DIR, or the run owning RUN_DIR/checkpoints/step_N); the
    config given on the command line still applies."""
    if resume is None:
        return cfg
    from async_dapo.checkpoint.run_dir import owning_run

    return cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"run_dir": owning_run(resume)})})


class _Expired(BaseException):
    """What the SIGALRM handler raises: not an Exception (TimeoutError is an OSError), so that no ``except
    Exception`` or ``except OSError`` in the code it interrupts (SGLang's reads of its pipes) swallows it."""


@contextlib.contextmanager
def _deadline(seconds: float, what: str):
    """TimeoutError naming ``what`` if the block runs past ``seconds``. SIGALRM, because the SGLang engine must
    start on the main thread (it installs signal handlers), so no other thread can wait for it; its blocking
    reads of the scheduler's pipes are interrupted by the signal. Should the interrupted code still swallow
    the signal's exception, the block's end raises the TimeoutError all the same."""
    fired = []

    def expired(signum, frame):
        fired.append(signum)
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Expired:
        raise TimeoutError(f"{what}: not ready in {seconds:.0f} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:
        raise TimeoutError(f"{what}: not ready in {seconds:.0f} s")


def _train(cfg: Config, resume: Path | None) -> int:
    from async_dapo.checkpoint.run_dir import RunDir, archive_previous_run
    from async_dapo.metrics import PhaseClock
    from async_dapo.orchestrator import train

    clock = PhaseClock()
    run_dir = Path(cfg.logging.run_dir)
    # Before the log file opens in run_dir: a fresh run first moves an earlier run out of the way.
    if resume is None and (moved := archive_previous_run(run_dir)) is not None:
        log.info("run_dir %s held an earlier run: moved it to %s", run_dir, moved)
    _log_to_file(RunDir(run_dir).log)
    if cfg.model.bootstrap is not None:
        with clock.phase("bootstrap"):
            _bootstrap(cfg)
    result = train(cfg, resume, clock)
    # 4 significant digits, not 4 decimals: a per-token log-prob difference of 3e-7 must not read 0.0.
    log.info("done: %s", json.dumps({k: float(f"{v:.4g}") for k, v in result.items()}))
    return 0


_run_log: Path | None = None  # where a fatal traceback goes (set once a run has a directory)


def _log_to_file(path: Path) -> None:
    """Also write our log lines to ``path`` (appended): the run's record, and where a fatal traceback goes."""
    global _run_log
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    _run_log = path


def _fatal(exc: BaseException, cfg: Config | None, command: str) -> int:
    """One line on the terminal for an exception nothing else caught; its traceback in the run's log file."""
    import traceback

    what = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    where = f"traceback in {_run_log}" if _to_run_log(f"{command} failed:\n{traceback.format_exc()}") else "no log file"
    if command == "train" and cfg is not None:
        from async_dapo.checkpoint.run_dir import last_checkpoint

        print(f"run failed: {what} ({where}); last checkpoint: {last_checkpoint(Path(cfg.logging.run_dir))}",
              file=sys.stderr)
    else:
        print(f"{command} failed: {what} ({where})", file=sys.stderr)
    return 1


def _to_run_log(text: str) -> bool:
    """Append ``text`` to the run's log file (only there, not on the terminal); False when there is none."""
    if _run_log is None:
        return False
    with _run_log.open("a") as f:
        f.write(text.rstrip("\n") + "\n")
    return True


def _setup_logging() -> None:
    # Our own handler, not the root logger's: SGLang reconfigures the root logger (to its log_level)
    # when an engine starts, which would silence our progress lines.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"))
    global _run_log
    _run_log = None
    for old in log.handlers:  # a second main() in one process (tests) must not keep the last run's file open
        old.close()
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    cfg = None
    try:
        if args.command == "scale":
            return _scale(args.run_dir, args.engines, args.wait_s)
        if args.command == "stop":
            return _stop(args.run_dir)
        if args.command == "from-verl":
            return _from_verl(args.source)
        if args.command == "config-reference":
            from async_dapo.config.reference import reference

            print(reference(), end="")
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            cfg = train_run_dir(cfg, args.resume)
            if args.print_config:
                print(config_yaml(cfg), end="")
                return 0
        if args.command == "plan":
            return _plan(cfg, args)
        if args.command == "bootstrap":
            _bootstrap(cfg, args.force)
        elif args.command == "eval":
            _eval(cfg, args.repeats)
        else:
            return _train(cfg, args.resume)
    except (ConfigError, DatasetError, FileNotFoundError) as exc:  # bad config, data or --resume path
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:  # the run cannot go on: one line, what failed and the last checkpoint
        print(f"run failed: {exc}", file=sys.stderr)
        _to_run_log(f"run failed: {exc}")
        return 1
    except KeyboardInterrupt:
        print("interrupted: actors and engines were shut down", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else (Ray's ObjectLostError, OutOfMemoryError, a bug): still one line
        return _fatal(exc, cfg, args.command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
