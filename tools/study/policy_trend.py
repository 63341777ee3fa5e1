"""Did training help or hurt the policy on its own training prompts? For each run directory, the queue's
cumulative counters (metrics.jsonl) over windows of steps: the accuracy of every sample generated in the
window (kept or dropped by dynamic sampling), the keep rate (accepted / received) and the all-wrong and
all-correct shares of the groups received. The kept batch's own accuracy cannot show this: dynamic sampling
keeps only mixed groups.

    python tools/study/policy_trend.py runs/lt/e0 runs/lt/e4 --window 10
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


def trend(run_dir: Path, size: int) -> list[dict]:
    """One row per window of ``size`` steps (the last may be shorter)."""
    steps = common.step_records(common.records(run_dir))
    rows, start = [], None
    for i in range(0, len(steps), size):
        end = steps[min(i + size, len(steps)) - 1]
        rows.append({"run": run_dir.name, "steps": f"{(start or {}).get('step', 0) + 1}-{end['step']}",
                     **common.queue_rates(start, end)})
        start = end
    return rows


def main(argv=None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (logging.run_dir)")
    ap.add_argument("--window", type=int, default=10, help="steps per window (default %(default)s)")
    args = ap.parse_args(argv)
    rows = [r for run in args.runs for r in trend(run, args.window)]
    for r in rows:
        for k in ("acc", "keep", "all_wrong", "all_correct"):
            r[k] = round(r[k], 3)
    print(common.write_table(rows, ["run", "steps", "acc", "keep", "all_wrong", "all_correct", "groups"], None, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
