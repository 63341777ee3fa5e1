"""The unseen-config study (tools/study/plan_unseen.py): its drawn configs fit the machine, and repeated rounds
are averaged with their spread, on hand-made run summaries."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "study"))
import plan_unseen  # noqa: E402


def test_rounds_are_averaged_and_their_spread_is_max_minus_min_over_the_mean():
    runs = [{"steps_per_s": 2.0, "staleness_mean": 1.0, "learner_idle": 0.5},
            {"steps_per_s": 3.0, "staleness_mean": 2.0, "learner_idle": 0.3}]
    got = plan_unseen.mean_of(runs)
    assert got["steps_per_s"] == 2.5 and got["staleness_mean"] == 1.5 and got["learner_idle"] == pytest.approx(0.4)
    assert got["steps_per_s_spread"] == pytest.approx((3.0 - 2.0) / 2.5)
    assert plan_unseen.mean_of(runs[:1])["steps_per_s_spread"] == 0.0


def test_the_first_round_keeps_the_single_run_directory_and_later_rounds_get_their_own():
    out = Path("runs/x")
    assert plan_unseen.run_dir_of(out, "c3", 0) == out / "c3"
    assert plan_unseen.run_dir_of(out, "c3", 2) == out / "c3_r2"


def test_the_drawn_configs_are_seeded_distinct_and_fit_two_cores():
    drawn = plan_unseen.draw(8, 0)
    assert drawn == plan_unseen.draw(8, 0) and drawn != plan_unseen.draw(8, 1)
    assert len({tuple(c.values()) for c in drawn}) == 8
    assert all(c["engines"] + c["ranks"] <= 3 for c in drawn)
    assert all(c["update_mode"] == "inflight" for c in drawn if c["eta"] == 0)


def test_repeats_below_one_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        plan_unseen.main(["--profile", "none.yaml", "--repeats", "0"])
    assert exc.value.code == 2 and "--repeats must be >= 1, got 0" in capsys.readouterr().err
