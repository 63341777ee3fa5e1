"""A reward function (verl's custom_reward_function signature) that raises for a fraction of calls: the
fault-injection tests use it to fail groups in the real rollout actors' scoring path. The fraction is read
from the environment (ASYNC_DAPO_TEST_FAIL_FRACTION, default 0.05 per sample, i.e. ~34% of 8-sample
groups); the draws come from Python's ``random``, which each reward worker process seeds from logging.seed and its engine rank."""

import os
import random

from async_dapo.data.reward import dapo_math_score

FRACTION = float(os.environ.get("ASYNC_DAPO_TEST_FAIL_FRACTION", "0.05"))


def score(data_source, solution_str, ground_truth, extra_info=None):
    if random.random() < FRACTION:
        raise RuntimeError("injected scoring fault")
    result = dapo_math_score(solution_str, ground_truth)
    return {"score": result.score, "acc": result.acc, "pred": result.pred}
