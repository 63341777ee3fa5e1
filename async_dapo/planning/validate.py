"""The planner against measurements: every row of a benchmark table (tools/bench/throughput.py's CSV)
predicted and compared within a stated tolerance, and the markdown tables the tools print."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_dapo.planning.profile import Profile, ProfileError
from async_dapo.planning.shape import Shape
from async_dapo.planning.simulator import predict

# validate(): a prediction is "within" the measurement when inside these (steps/s relative, the rest absolute).
TOLERANCE = {"steps_per_s": 0.15, "staleness_mean": 0.3, "learner_idle": 0.1, "rollout_idle": 0.1}
COMPARED = ("occupancy", "tail_share")  # also compared by validate(), with no target



def bench_row_shape(shape: Shape) -> Callable[[dict[str, str]], Shape]:
    """How tools/bench/throughput.py sets each mode: η from the row, rollout.max_inflight_prompts =
    (η + 1)·B, the row's update_mode and batch_order if it has them (else the shape's); every_k_steps kept
    within η + 1."""
    def for_row(row: dict[str, str]) -> Shape:
        eta = int(float(row["eta"]))
        return shape.with_(eta=eta, max_inflight_prompts=(eta + 1) * shape.B,
                           every_k_steps=min(shape.every_k_steps, eta + 1),
                           update_mode=row.get("update_mode") or shape.update_mode,
                           batch_order=row.get("batch_order") or shape.batch_order)
    return for_row


def _read_table(table_csv: str | Path) -> list[dict[str, str]]:
    try:
        with open(table_csv, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise ProfileError(f"{table_csv}: table not found") from None
    need = {"eta", "steps_per_s"}
    if not rows or need - set(rows[0]):
        raise ProfileError(f"{table_csv}: needs rows with columns {sorted(need)} (tools/bench/throughput.py's "
                           "throughput.csv)")
    return rows


def validate(profile: Profile, table_csv: str | Path, shape_for_row: Shape | Callable[[dict[str, str]], Shape],
             steps: int = 60, warmup: int = 10, seed: int = 0, measured_keep: bool = False) -> list[dict[str, Any]]:
    """Predict every row of a benchmark CSV (columns mode, eta, optionally update_mode; measured steps_per_s,
    staleness_mean, learner_idle, rollout_idle) and compare: per figure the prediction, the measurement,
    the error (relative for steps/s, absolute for the rest) and whether it is within :data:`TOLERANCE`
    (±15 % / ±0.3 / ±0.1 / ±0.1). ``shape_for_row``: a callable, or a Shape mapped as :func:`bench_row_shape`.
    ``measured_keep``: a diagnostic, not a validation: each row is predicted with the keep rate that row
    measured (its ``keep_rate`` column) instead of the profile's, to tell a drifting workload from a wrong
    pipeline model (per-prompt records become their population: every recorded length, that keep rate)."""
    to_shape = bench_row_shape(shape_for_row) if isinstance(shape_for_row, Shape) else shape_for_row
    out = []
    for row in _read_table(table_csv):
        shape, used = to_shape(row), profile
        if measured_keep and row.get("keep_rate") not in (None, ""):
            w = profile.workload
            used = profile.model_copy(update={"workload": w.model_copy(update={
                "keep_rate": float(row["keep_rate"]), "prompts": None, "accuracy_by_version": None,
                "response_lengths": w.response_lengths or w.all_lengths() or None})})
        pred = predict(used, shape, steps, warmup, seed, sync_baseline=False).row()
        res: dict[str, Any] = {"mode": row.get("mode", ""), "eta": shape.eta, "update_mode": shape.update_mode}
        oks = []
        for key, tol in TOLERANCE.items():
            if row.get(key) in (None, ""):
                continue
            measured = float(row[key])
            err = (pred[key] - measured) / measured if key == "steps_per_s" else pred[key] - measured
            res.update({f"{key}_pred": pred[key], f"{key}_meas": measured, f"{key}_err": err,
                        f"{key}_ok": abs(err) <= tol})
            oks.append(abs(err) <= tol)
        for key in COMPARED:
            if row.get(key) not in (None, ""):
                res.update({f"{key}_pred": pred[key], f"{key}_meas": float(row[key]),
                            f"{key}_err": pred[key] - float(row[key])})
        res["ok"] = all(oks)
        out.append(res)
    return out


def markdown(rows: list[dict[str, Any]], columns: list[str], fmt: dict[str, str] | None = None) -> str:
    """A markdown table of ``rows`` (floats with ``fmt[column]``, default 4 significant digits)."""
    fmt = fmt or {}

    def cell(col: str, value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "**no**"
        if isinstance(value, float):
            return format(value, fmt.get(col, ".4g"))
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)

