"""``async-dapo`` command line: bootstrap | eval | train.

Config errors print one line (``error: <dotted.key>: <problem>``) and exit 2; a run that cannot go on (a dead
learner rank, restarts exhausted, a batch that cannot be filled, silence) prints one line
(``run failed: <what>; last checkpoint: <path>``) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from async_dapo.config import Config, ConfigError, dump_config, load_config
from async_dapo.data import DatasetError
from async_dapo.supervise import RunFailed

log = logging.getLogger("async_dapo")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


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
    return p


def _bootstrap(cfg: Config, force: bool = False) -> None:
    from async_dapo.bootstrap import bootstrap

    rep = bootstrap(cfg, force=force)
    log.info("bootstrap %s: %s", "cached" if rep.cached else "built", json.dumps(asdict(rep)))


def _eval(cfg: Config, repeats: int = 1) -> None:
    """Validate the configured model ``repeats`` times through a rollout actor's sampling path, in this
    process (no Ray): the same function, sample type and scoring as training and in-run validation."""
    from async_dapo.data import val_rows
    from async_dapo.evaluate import merge_parts, val_sampling_params
    from async_dapo.metrics import val_subsets_line
    from async_dapo.rollout import RolloutWorker

    if cfg.model.bootstrap is not None:
        _bootstrap(cfg)
    worker = RolloutWorker(cfg, 0)
    rows, k = val_rows(cfg), cfg.logging.val_n
    avgs = []
    try:
        for _ in range(repeats):  # the engine's sampler moves on: each pass draws new samples
            t0 = time.perf_counter()
            m = merge_parts([list(range(len(rows)))], [worker.validate(rows, k, val_sampling_params(cfg))], rows)
            seconds = time.perf_counter() - t0
            avgs.append(m["val/avg_at_k"])
            log.info("val avg@%d %.3f  pass@%d %.3f  maj@%d %.3f  (%d distinct prompts, %d tokens, %.0f tok/s)  %s",
                     k, m["val/avg_at_k"], k, m["val/pass_at_k"], k, m["val/maj_at_k"], len(rows),
                     m["val/gen_tokens"], m["val/gen_tokens"] / seconds, val_subsets_line(m))
    finally:
        worker.shutdown()
    if repeats > 1:
        log.info("avg@%d over %d validations of the same weights: mean %.4f, sd %.4f, range %.4f-%.4f",
                 k, repeats, statistics.mean(avgs), statistics.stdev(avgs), min(avgs), max(avgs))


def _train(cfg: Config, resume: Path | None) -> int:
    from async_dapo.metrics import PhaseClock
    from async_dapo.orchestrator import train

    clock = PhaseClock()

    if resume is not None:
        # A resumed run keeps its own directory (RUN_DIR, or the run owning RUN_DIR/checkpoints/step_N);
        # the config given on the command line still applies.
        run_dir = resume.parent.parent if resume.parent.name == "checkpoints" else resume
        cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"run_dir": run_dir})})
    if cfg.model.bootstrap is not None:
        with clock.phase("bootstrap"):
            _bootstrap(cfg)
    result = train(cfg, resume, clock)
    log.info("done: %s", json.dumps({k: round(v, 4) for k, v in result.items()}))
    return 0


def _setup_logging() -> None:
    # Our own handler, not the root logger's: SGLang reconfigures the root logger (to its log_level)
    # when an engine starts, which would silence our progress lines.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
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
        return 1
    except KeyboardInterrupt:
        print("interrupted: actors and engines were shut down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
