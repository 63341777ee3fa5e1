"""What every tool under tools/ shares: the command line (``--config``, ``--set KEY=VALUE``, ``--help``),
config loading and the tiny model's bootstrap, and, for the study and benchmark tools, running
``async-dapo train`` as a child process, reading what a run wrote (metrics.jsonl) and writing a table as
Markdown and CSV.

Tools are run by their path, from any directory: ``python tools/bench/push.py --help``. Each tool finds
this module with one line (``sys.path.insert(0, <tools/>)``); importing it makes ``async_dapo`` importable
(the repository root is appended to ``sys.path`` when no other copy is found first, so a ``PYTHONPATH``
naming another worktree still wins). This module imports the standard library only, and async_dapo (which
imports pydantic) only inside the functions that need it: ``--help`` starts nothing, and
tools/gpu/gpu_smoke.py, which runs where ray, zmq, sglang and pydantic are absent, may import it.

A tool never imports the training loop to run it: every run is the same command a user types, in its own
process (its own Ray instance), so one crashed run cannot take the rest of a study with it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
if not any(Path(p or ".").resolve() == REPO for p in sys.path):
    sys.path.append(str(REPO))


# ------------------------------------------------------------------------------------------ command line
def tool_path(file: str | Path) -> str:
    """A tool's path as a user types it from the repository root (``tools/bench/push.py``)."""
    path = Path(file).resolve()
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


def parser(file: str | Path, doc: str | None, config: bool | str = False) -> argparse.ArgumentParser:
    """The tool's argument parser: ``prog`` is the command that runs it (``python tools/bench/push.py``, so
    ``--help`` starts with a usage line naming the tool), the description its module docstring as written.
    ``config``: False, no ``--config``/``--set``; True, ``--config`` is required; a path, its default."""
    ap = argparse.ArgumentParser(prog=f"python {tool_path(file)}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if config is not False:
        add_config(ap, None if config is True else str(config))
    return ap


def add_config(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--config PATH`` (required unless ``default``) and ``--set KEY=VALUE`` (see add_sets)."""
    if default is None:
        ap.add_argument("--config", required=True, help="run config (YAML)")
    else:
        ap.add_argument("--config", default=default, help="run config (YAML; default %(default)s)")
    add_sets(ap)


def add_sets(ap: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE``, repeatable, into ``args.overrides`` (async_dapo.config's override syntax)."""
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. learner.lr=1e-5 (repeatable)")


# ------------------------------------------------------------------------------------------ config, model
def load_config(path: str | Path | None, sets: Sequence[str] = ()):
    """``async_dapo.config.load_config`` (imported here, on first use)."""
    from async_dapo.config import load_config as load

    return load(path, list(sets))


def load(args: argparse.Namespace, extra: Sequence[str] = ()):
    """The config of ``--config`` with the ``--set`` overrides, then ``extra`` (later ones win)."""
    return load_config(args.config, [*args.overrides, *extra])


def bootstrap_model(cfg):
    """Build the tiny model that ``model.bootstrap`` describes at ``model.path`` (cached: a second call with
    the same config reuses it; async_dapo.bootstrap). Returns its report, or None when bootstrap is null."""
    if cfg.model.bootstrap is None:
        return None
    from async_dapo.bootstrap import bootstrap

    return bootstrap(cfg)


def load_model(args: argparse.Namespace, extra: Sequence[str] = (), threads: int | None = 1):
    """``load(args, extra)`` with its model ready: bootstrapped if configured, then the config reloaded
    with the model's absolute path and bootstrap off (what an engine or a Ray worker needs, wherever it
    starts). ``threads``: async_dapo.device.pin_threads afterwards (None: leave the thread count alone)."""
    cfg = load(args, extra)
    bootstrap_model(cfg)
    cfg = load(args, [*extra, f"model.path={Path(cfg.model.path).resolve()}", "model.bootstrap=null"])
    if threads is not None:
        from async_dapo.device import pin_threads

        pin_threads(threads)
    return cfg


# ------------------------------------------------------------------------------------------ runs
def cli_command(command: str, config: str | Path, sets: Sequence[str]) -> list[str]:
    """``python -m async_dapo.cli COMMAND --config CONFIG --set ...`` (``async-dapo COMMAND ...``)."""
    cmd = [sys.executable, "-m", "async_dapo.cli", command, "--config", str(config)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def train_command(config: str | Path, sets: Sequence[str]) -> list[str]:
    return cli_command("train", config, sets)


def run_train(config: str | Path, sets: list[str], log_path: Path, timeout_s: float, cwd: Path = REPO) -> int:
    """Run one training run to its end (its output in ``log_path``); returns the exit code. A run that
    outlives ``timeout_s`` is ended (:func:`end_run`) and reported as 124."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = start_train(config, sets, log, cwd)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_run(proc)
            return 124


def start_train(config: str | Path, sets: Sequence[str], log, cwd: Path = REPO) -> subprocess.Popen:
    """Start one training run in its own session, its output to the open file ``log``."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # this tree's package, in the driver and every Ray worker
    return subprocess.Popen(train_command(config, sets), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def end_run(proc: subprocess.Popen) -> None:
    """End a run :func:`start_train` started: the driver first (on SIGTERM it ends its actors and its own Ray
    instance), then, if it outlives 120 s, its process group (its own session: ours, by PID)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=60)


def records(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, under today's tags (an older run's renamed, see upgrade_row)."""
    from async_dapo.metrics import upgrade_row

    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [upgrade_row(r) for r in rows]


def finished(run_dir: Path, steps: int) -> bool:
    """The run trained its ``steps`` steps and ended (the wall time by phase, time/total_s, is written at
    every exit, a failed or killed run's too: the step count is what tells a finished run)."""
    rows = records(run_dir)
    return any("time/total_s" in r for r in rows) and any(r.get("step") == steps for r in step_records(rows))


def check_reusable(run_dir: Path, config: str | Path, sets: list[str]) -> None:
    """A finished run is reused only if it was made with this config: ``SystemExit`` naming the directory
    otherwise (a quick preset's 4-step run must not stand in for a full one)."""
    if load_config(run_dir / "config.yaml") != load_config(config, sets):
        raise SystemExit(f"{run_dir} holds a finished run made with another config; choose another --out "
                         "or move it away")


def step_records(rows: list[dict]) -> list[dict]:
    """The training-step records (one per step, in order), without validation or phase records."""
    return [r for r in rows if "perf/time_per_step" in r]


def queue_rates(first: dict | None, last: dict) -> dict[str, float]:
    """The replay queue's rates between two step records of metrics.jsonl (``first`` None: from the run's
    start), from its cumulative counters: ``keep`` (accepted / received groups), ``all_wrong`` and
    ``all_correct`` (shares of the groups received), ``groups`` (received), and ``acc``, the accuracy of every
    sample received, kept or dropped (nan for a run older than that counter)."""
    def delta(key: str) -> float:
        return last.get(key, 0.0) - (first.get(key, 0.0) if first else 0.0)

    received = max(delta("replay/received"), 1.0)
    samples = delta("replay/received_samples")
    return {"keep": delta("replay/accepted") / received, "all_wrong": delta("replay/dropped_all_wrong") / received,
            "all_correct": delta("replay/dropped_all_correct") / received, "groups": delta("replay/received"),
            "acc": delta("replay/received_correct") / samples if "replay/received_samples" in last and samples
            else float("nan")}


def write_table(rows: list[dict], columns: list[str], md_path: Path | None, csv_path: Path | None,
                fmt: dict[str, str] | None = None) -> str:
    """``rows`` as a Markdown table (returned, and written to ``md_path``) and as CSV (full precision)."""
    fmt = fmt or {}

    def cell(col: str, v: Any) -> str:
        return format(v, fmt[col]) if col in fmt and isinstance(v, (int, float)) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(text)
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return text


def save_results(name: str, results: list[dict], rows: list[dict], columns: list[str], out: Path | None) -> str:
    """A benchmark's results: ``rows`` as a table (returned), and with ``out`` also ``<name>.md``/``.csv``
    and every raw result in ``<name>.jsonl`` there."""
    md = csv_path = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        md, csv_path = out / f"{name}.md", out / f"{name}.csv"
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    return write_table(rows, columns, md, csv_path)
