"""What the study and benchmark tools share: run ``async-dapo train`` as a child process, read what a run
wrote (metrics.jsonl), and write a table as Markdown and CSV.

A tool never imports the training loop to run it: every run is the same command a user types, in its own
process (its own Ray instance), so one crashed run cannot take the rest of a study with it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train_command(config: str | Path, sets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(config)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def run_train(config: str | Path, sets: list[str], log_path: Path, timeout_s: float, cwd: Path = REPO) -> int:
    """Run one training run to its end (its output in ``log_path``); returns the exit code. A run that
    outlives ``timeout_s`` is ended (its process group: Ray's workers go with it) and reported as 124."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # this tree's package, in the driver and every Ray worker
    with log_path.open("w") as log:
        proc = subprocess.Popen(train_command(config, sets), cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the driver only: on SIGTERM it ends its actors and its own Ray instance
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:  # then the run's process group (start_new_session): ours, by PID
                os.killpg(proc.pid, 9)
                proc.wait(timeout=60)
            return 124


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
    from async_dapo.config import load_config

    if load_config(run_dir / "config.yaml") != load_config(config, sets):
        raise SystemExit(f"{run_dir} holds a finished run made with another config; choose another --out "
                         "or move it away")


def step_records(rows: list[dict]) -> list[dict]:
    """The training-step records (one per step, in order), without validation or phase records."""
    return [r for r in rows if "perf/time_per_step" in r]


def write_table(rows: list[dict], columns: list[str], md_path: Path | None, csv_path: Path | None,
                fmt: dict[str, str] | None = None) -> str:
    """``rows`` as a Markdown table (returned, and written to ``md_path``) and as CSV (full precision)."""
    fmt = fmt or {}

    def cell(col: str, v) -> str:
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
