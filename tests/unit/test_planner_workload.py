"""The planner's workload as whole groups (async_dapo/planning/workload.py): keep derived from per-prompt records
for any group size (closed form by hand), the recorded group at the calibrated size, a prompt's lengths kept
with its outcomes, abort's restart on the same prompt, and keep's drift by version."""

import numpy as np
import pytest

from async_dapo.planning import Shape, predict, profile_from_dict
from async_dapo.planning.workload import WorkloadModel, keep_rate

# Four prompts of 4 samples: accuracies 0, 1/4, 1/2, 1 (two of the four recorded groups are mixed).
RECORDS = [
    {"lengths": [50, 50, 50, 50], "correct": [False] * 4},
    {"lengths": [3, 30, 30, 30], "correct": [True, False, False, False]},
    {"lengths": [5, 5, 9, 9], "correct": [True, True, False, False]},
    {"lengths": [2, 2, 2, 2], "correct": [True] * 4},
]
HAND = {
    "name": "hand", "hardware": "none: hand-made figures",
    "engine": {"max_running_seqs": 100_000, "decode_base_s": 0.01, "decode_per_seq_s": 0.001,
               "decode_per_ctx_token_s": 0.0, "prefill_per_token_s": 0.0, "per_group_s": 0.0},
    "learner": {"step_base_s": 0.1, "per_token_s": 0.0},
    "push": {"base_s": 0.0, "bytes": 0.0, "bandwidth_bytes_per_s": 1e9, "engine_pause_s": 0.0},
    "workload": {"prompt_tokens": 4, "prompts": RECORDS},
}


def workload(**changes):
    return profile_from_dict({**HAND, "workload": {**HAND["workload"], **changes}}).workload


def test_keep_at_the_calibrated_group_size_is_the_recorded_share_of_mixed_groups():
    assert keep_rate(workload(), 4) == 0.5


def test_keep_at_an_unseen_group_size_is_the_closed_form_from_each_prompts_accuracy():
    # p = 0, 1/4, 1/2, 1; keep(G) = mean(1 - p^G - (1-p)^G): the p = 0 and p = 1 prompts are never mixed.
    by_hand_8 = (0 + (1 - 0.25 ** 8 - 0.75 ** 8) + (1 - 2 * 0.5 ** 8) + 0) / 4
    by_hand_2 = (0 + (1 - 0.0625 - 0.5625) + 0.5 + 0) / 4  # 0.375 / 4 + 0.125
    assert keep_rate(workload(), 8) == pytest.approx(by_hand_8, abs=1e-12)
    assert by_hand_8 == pytest.approx(0.47301483154296875, abs=1e-15)  # (0.8998718 + 0.9921875) / 4
    assert keep_rate(workload(), 2) == pytest.approx(by_hand_2, abs=1e-12)


def test_the_simulated_keep_converges_on_the_closed_form():
    model = WorkloadModel(workload(), 10_000, np.random.default_rng(1))
    kept = sum(model.keeps(model.group(8, 0)[1]) for _ in range(20_000))
    assert kept / 20_000 == pytest.approx(keep_rate(workload(), 8), abs=0.01)


def test_a_sample_keeps_its_prompts_length_for_its_outcome():
    model = WorkloadModel(workload(), 10_000, np.random.default_rng(2))
    for _ in range(200):
        prompt, samples = model.group(6, 0)
        for s in samples:
            if prompt == 1:  # the right answer is short, the wrong ones long
                assert s.length == (3 if s.correct else 30)
            elif prompt == 0:
                assert s.length == 50 and s.correct is False


def test_a_restart_is_a_new_sample_of_the_same_prompt():
    model = WorkloadModel(workload(), 40, np.random.default_rng(3))
    draws = [model.resample(0, 0) for _ in range(50)]
    assert {(s.length, s.correct) for s in draws} == {(40, False)}  # capped at max_response_length


def lognormal_model(share: float, seed: int = 4, cap: int = 1 << 30) -> WorkloadModel:
    w = workload(prompts=None, lognormal={"median": 1000.0, "sigma": 0.8, "prompt_share": share}, keep_rate=0.5)
    return WorkloadModel(w, cap, np.random.default_rng(seed))


def test_a_lognormal_prompt_share_splits_the_length_variance_between_and_within_groups():
    """ln L = ln 1000 + 0.8·(√s·z_prompt + √(1 − s)·z_sample): at s = 1 a group and its restarts are one
    length; at s = 0.36 the groups' ln-means vary by 0.36·0.64 (+ the within part / G) and the samples within
    a group by 0.64·0.64, so ln L keeps its variance 0.64."""
    model = lognormal_model(1.0)
    key, samples = model.group(4, 0)
    assert key <= -2 and len({smp.length for smp in samples}) == 1 and samples[0].correct is None
    assert model.resample(key, 3).length == samples[0].length  # an aborted sample is as long again
    model = lognormal_model(0.36)
    ln = np.log([[smp.length for smp in model.group(4, 0)[1]] for _ in range(20_000)])
    within = ln.var(axis=1, ddof=1).mean()
    assert within == pytest.approx(0.64 * 0.64, rel=0.03)
    assert ln.mean(axis=1).var(ddof=1) == pytest.approx(0.36 * 0.64 + within / 4, rel=0.03)
    assert ln.var() == pytest.approx(0.64, rel=0.03)


def test_without_a_prompt_share_a_lognormal_group_is_independent_population_draws():
    a, b = lognormal_model(0.0, seed=5), lognormal_model(0.0, seed=5)
    key, samples = a.group(4, 0)
    assert key == -1 and [smp.length for smp in samples] == list(b._population_lengths(4))


def test_drift_moves_every_prompts_accuracy_to_the_stated_mean():
    w = workload(accuracy_by_version=[0.4375, 0.8])
    # version 0: the recorded mean accuracy (7/16) -> the closed form on the recorded p, now also at G = 4
    p = np.array([0, 0.25, 0.5, 1.0])
    assert keep_rate(w, 4, 0.4375) == pytest.approx(float(np.mean(1 - p ** 4 - (1 - p) ** 4)), abs=1e-9)
    # version 1: a higher accuracy moves the two inner prompts up together (one logit shift d)
    from async_dapo.planning.workload import _shifted

    q = _shifted(p, 0.6)
    assert q.mean() == pytest.approx(0.6, abs=1e-9)
    assert (q[0], q[3]) == (0.0, 1.0)
    d1, d2 = np.log(q[1] / (1 - q[1])) - np.log(1 / 3), np.log(q[2] / (1 - q[2]))
    assert d1 == pytest.approx(d2, abs=1e-9) and d1 > 0
    # the prompts at 0 and 1 stay there, so a mean beyond (0 + 1 + 1 + 1) / 4 is as close as it gets
    assert _shifted(p, 0.8).mean() == pytest.approx(0.75, abs=1e-6)


def test_the_simulator_derives_keep_and_the_trained_length_ratio_from_records():
    shape = Shape(B=2, G=4, eta=0, max_inflight_prompts=4, max_response_length=64)
    pred = predict(profile_from_dict(HAND), shape, steps=80, warmup=10, sync_baseline=False)
    assert pred.keep_rate == pytest.approx(0.5, abs=0.08)
    # kept groups are prompts 1 and 2: mean length (3 + 90) / 4 = 23.25 and 7; every finished sample
    # (prompts drawn uniformly): (200 + 93 + 28 + 8) / 16 = 20.5625 -> ratio (23.25 + 7) / 2 / 20.5625
    assert pred.trained_length_ratio == pytest.approx(15.125 / 20.5625, abs=0.08)


def test_without_dynamic_sampling_every_group_is_kept():
    shape = Shape(B=2, G=4, eta=0, max_inflight_prompts=4, filter_groups=False)
    pred = predict(profile_from_dict(HAND), shape, steps=30, warmup=5, sync_baseline=False)
    assert pred.dropped_filtered == 0 and pred.keep_rate == 1.0


@pytest.mark.parametrize("change, named", [
    ({"keep_rate": 0.5}, "keep_rate is derived from prompts"),
    ({"prompts": None}, "give exactly one of prompts, response_lengths and lognormal"),
    ({"prompts": [{"lengths": [1, 2], "correct": [True]}]}, "lengths has 2 entries, correct 1"),
    ({"accuracy_by_version": [1.0]}, "accuracy_by_version values must be in (0, 1)"),
    ({"prompts": None, "response_lengths": [4], "accuracy_by_version": [0.5], "keep_rate": 0.5},
     "accuracy_by_version needs prompts"),
    ({"prompts": None, "response_lengths": [4]}, "keep_rate is required"),
])
def test_a_bad_workload_names_the_problem(change, named):
    from async_dapo.planning import ProfileError

    with pytest.raises(ProfileError, match="workload") as err:
        profile_from_dict({**HAND, "workload": {**HAND["workload"], **change}}, "p.yaml")
    assert named in str(err.value)
