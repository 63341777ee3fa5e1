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


def test_step_parts_are_the_rounds_means_of_training_wait_and_samples_finished(tmp_path):
    import json

    def run(name, steps):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": i + 1, "time": t, "perf/time_per_step": step, "perf/wait_data_s": wait,
             "perf/weight_push_stall_s": stall, "replay/received_samples": n}) + "\n"
            for i, (t, step, wait, stall, n) in enumerate(steps)))
        return d

    # round 1, after 1 warm-up step: steps of 0.5 s (0.1 waiting, 0.05 stalled), 100 samples in 2 s
    one = run("c0", [(0.0, 9.0, 9.0, 9.0, 0), (1.0, 0.5, 0.1, 0.05, 40), (3.0, 0.5, 0.1, 0.05, 140)])
    # round 2: steps of 1.0 s (0.3 waiting, none stalled), 60 samples in 1 s
    two = run("c0_r1", [(0.0, 9.0, 9.0, 9.0, 0), (2.0, 1.0, 0.3, 0.0, 10), (3.0, 1.0, 0.3, 0.0, 70)])
    got = plan_unseen.step_parts([one, two], 1)
    assert got["train_s"] == pytest.approx((0.35 + 0.35 + 0.7 + 0.7) / 4)
    assert got["wait_s"] == pytest.approx((0.1 + 0.1 + 0.3 + 0.3) / 4)
    assert got["samples_per_s"] == pytest.approx((100 / 2 + 60 / 1) / 2)
