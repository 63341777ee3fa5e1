"""Validation scores of plain texts, for tests: score each sample in-process, then the production
aggregation (``evaluate.result_scores``; in a run the rollout actors score in reward worker processes)."""

from async_dapo.rollout.evaluate import result_scores
from async_dapo.data.reward import builtin_score


def prompt_scores(texts, rows, score_fn=builtin_score):
    return result_scores([[score_fn(row.data_source, t, row.ground_truth, row.extra_info) for t in group]
                          for group, row in zip(texts, rows)])
