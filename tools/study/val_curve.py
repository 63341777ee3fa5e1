"""The validation curve of a run, as a Markdown table: one row per validation, read from
RUN_DIR/metrics.jsonl (what ``async-dapo train`` writes next to TensorBoard).

    python tools/study/val_curve.py RUN_DIR [RUN_DIR ...]

Columns: step, minutes since the run's first metrics record, val avg@k / pass@k / maj@k, the change of
avg@k since the first validation, and avg@k per subset (level or data source) when the run logged them.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

PREFIX = "val/avg_at_k/"


def val_rows(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    start = min((r["time"] for r in records if "time" in r), default=None)
    rows = []
    for r in records:
        if "val/avg_at_k" in r:
            minutes = (r["time"] - start) / 60 if start is not None and "time" in r else float("nan")
            rows.append({**r, "minutes": minutes})
    return rows


def table(rows: list[dict]) -> str:
    subsets = sorted({k[len(PREFIX):] for r in rows for k in r if k.startswith(PREFIX)})
    head = ["step", "min", "avg@k", "pass@k", "maj@k", "Δ avg@k", *subsets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = rows[0]["val/avg_at_k"] if rows else 0.0
    for r in rows:
        cells = [str(r["step"]), f"{r['minutes']:.1f}", f"{r['val/avg_at_k']:.3f}", f"{r['val/pass_at_k']:.3f}",
                 f"{r['val/maj_at_k']:.3f}", f"{100 * (r['val/avg_at_k'] - base):+.1f} pt",
                 *(f"{r.get(PREFIX + s, float('nan')):.3f}" for s in subsets)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's logging.run_dir")
    for run_dir in ap.parse_args().run_dirs:
        print(f"{run_dir}\n\n{table(val_rows(run_dir))}\n")


if __name__ == "__main__":
    main()
