"""The planner's learner against ranks (planning.learner_model.step_seconds): per-token compute, micro-batch
granularity, optimizer updates, FSDP's collectives over a bandwidth and the proximal pass, by hand."""

import pytest

from async_dapo.planning import Shape
from async_dapo.planning.learner_model import step_seconds
from async_dapo.planning.profile import LearnerProfile

LP = LearnerProfile(step_base_s=0.5, per_token_s=1e-3, per_micro_batch_s=0.02, per_update_s=0.3,
                    collective_bytes=1e6, collective_bandwidth_bytes_per_s=1e8, collective_latency_s=0.01)


def shape(**kw):
    return Shape(B=4, G=2, eta=0, max_inflight_prompts=4, **{"mini_batch_groups": 2, "micro_batch_tokens": 100, **kw})


def test_one_rank_is_tokens_micro_batches_and_updates():
    # mini-batches [100, 150] and [250, 100] tokens -> 250 and 350 tokens: 3 and 4 micro-batches of 100
    got = step_seconds(LP, shape(), [100, 150, 250, 100])
    by_hand = 0.5 + (0.25 + 3 * 0.02) + (0.35 + 4 * 0.02) + 2 * 0.3
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(1.84, abs=1e-12)


def test_two_ranks_halve_compute_and_the_optimizer_and_pay_the_collectives():
    # per rank 125 and 175 tokens -> 2 micro-batches each; collectives 3 x 1e6 x 1/2 / 1e8 + 0.01 = 0.025 s each
    got = step_seconds(LP, shape(learner_ranks=2), [100, 150, 250, 100])
    by_hand = 0.5 + (0.125 + 2 * 0.02 + 2 * 0.025) + (0.175 + 2 * 0.02 + 2 * 0.025) + 2 * 0.15
    assert got == pytest.approx(by_hand, rel=1e-12)
    half_hidden = LP.model_copy(update={"collective_overlap": 0.5})
    assert step_seconds(half_hidden, shape(learner_ranks=2), [100, 150, 250, 100]) == pytest.approx(
        by_hand - 2 * 2 * 0.0125, rel=1e-12)


def test_epochs_repeat_the_passes_and_the_proximal_pass_forwards_every_mini_batch_but_the_first():
    one = step_seconds(LP, shape(), [100, 150, 250, 100]) - 0.5  # 1.34
    second = 0.35 + 4 * 0.02
    assert step_seconds(LP, shape(epochs=3), [100, 150, 250, 100]) == pytest.approx(0.5 + 3 * one, rel=1e-12)
    assert step_seconds(LP, shape(proximal=True), [100, 150, 250, 100]) == pytest.approx(
        0.5 + one + second / 3, rel=1e-12)


def test_the_summary_efficiency_still_scales_the_token_part():
    lp = LearnerProfile(step_base_s=0.1, per_token_s=1e-3, scaling_efficiency=0.8)
    s = Shape(B=2, G=2, eta=0, max_inflight_prompts=2, learner_ranks=4)
    assert step_seconds(lp, s, [400, 400]) == pytest.approx(0.1 + 1e-3 * 800 / 3.2, rel=1e-12)
