"""avg@k / pass@k / maj@k scoring of validation samples."""

import pytest

from async_dapo.data.rows import Message, PromptRow, RewardSpec
from async_dapo.rollout.evaluate import merge_parts, split_rows
from tests.unit.val_scores import prompt_scores
from async_dapo.rollout.evaluate import val_metrics as _val_metrics
from async_dapo.data.reward import RewardResult


def val_metrics(texts, rows):
    return _val_metrics(prompt_scores(texts, rows), rows)


def test_scores_hand_computed():
    texts = [
        ["Answer: 7", "Answer: 8", "Answer: 7", "junk"],  # 2/4 right; majority 7 -> right
        ["Answer: 1", "Answer: 2", "Answer: 2", "Answer: 5"],  # 1/4 right (5); majority 2 -> wrong
        ["no answer", "still none", "nothing", "Answer: 3"],  # 0/4; invalid preds never win a vote
    ]
    m = val_metrics(texts, [_row("7", q="a"), _row("5", q="b"), _row("4", q="c")])
    assert m == {"val/avg_at_k": 3 / 12, "val/pass_at_k": 2 / 3, "val/maj_at_k": 1 / 3, "val/distinct_prompts": 3.0}


def _row(truth: str, level=None, source="src", q="q"):
    extra = {"level": level} if level is not None else {}
    return PromptRow(data_source=source, prompt=[Message(role="user", content=q)], ability="math",
                     reward_model=RewardSpec(style="rule", ground_truth=truth), extra_info=extra)


def test_val_metrics_break_down_by_level():
    texts = [["Answer: 7", "Answer: 7"], ["Answer: 1", "Answer: 5"], ["x", "Answer: 4"]]
    rows = [_row("7", 1), _row("5", 2), _row("4", 2)]
    m = val_metrics(texts, rows)
    assert m["val/avg_at_k"] == (1.0 + 0.5) / 2  # levels weigh equally: L1 1.0, L2 0.5
    assert m["val/pass_at_k"] == 1.0
    assert m["val/maj_at_k"] == (1.0 + 0.5) / 2  # prompt 2: tie 1 vs 5 goes to the first seen (1), wrong
    assert m["val/avg_at_k/L1"] == 1.0
    assert m["val/avg_at_k/L2"] == (0.5 + 0.5) / 2


def test_val_metrics_fall_back_to_data_source_and_skip_a_single_subset():
    texts = [["Answer: 7"], ["Answer: 2"]]
    by_source = val_metrics(texts, [_row("7", source="a"), _row("5", source="b")])
    assert by_source["val/avg_at_k/a"] == 1.0 and by_source["val/avg_at_k/b"] == 0.0
    one = val_metrics(texts, [_row("7"), _row("5")])
    assert sorted(one) == ["val/avg_at_k", "val/distinct_prompts", "val/maj_at_k", "val/pass_at_k"]


# One level-1 prompt, three level-2 prompts (k=2). Per prompt (avg, pass, maj):
#   L1 "a": (1, 1, 1);  L2 "b": (1/2, 1, 0) (tie 1 vs 9: first seen, wrong);  "c": (0, 0, 0);  "d": (1/2, 1, 1)
# L2 means: avg 1/3, pass 2/3, maj 1/3. Macro = mean of L1 and L2; row mean = mean of the four prompts.
UNEQUAL_TEXTS = [["Answer: 3", "Answer: 3"], ["Answer: 1", "Answer: 9"], ["Answer: 0", "Answer: 0"],
                 ["Answer: 6", "junk"]]
UNEQUAL = [("3", 1, "a"), ("9", 2, "b"), ("8", 2, "c"), ("6", 2, "d")]


def test_levels_weigh_equally_not_by_row_count():
    m = val_metrics(UNEQUAL_TEXTS, [_row(t, level, q=q) for t, level, q in UNEQUAL])
    assert m["val/avg_at_k"] == pytest.approx((1 + 1 / 3) / 2, abs=1e-15)  # 2/3; the row mean would be 1/2
    assert m["val/pass_at_k"] == pytest.approx((1 + 2 / 3) / 2, abs=1e-15)  # 5/6; row mean 3/4
    assert m["val/maj_at_k"] == pytest.approx((1 + 1 / 3) / 2, abs=1e-15)  # 2/3; row mean 1/2
    assert m["val/avg_at_k/L1"] == 1.0 and m["val/avg_at_k/L2"] == pytest.approx(1 / 3, abs=1e-15)
    assert m["val/distinct_prompts"] == 4.0


def test_rows_without_level_keep_the_row_mean():
    m = val_metrics(UNEQUAL_TEXTS, [_row(t, source="s1" if q == "a" else "s2", q=q) for t, _, q in UNEQUAL])
    assert (m["val/avg_at_k"], m["val/pass_at_k"], m["val/maj_at_k"]) == (2 / 4, 3 / 4, 2 / 4)
    assert m["val/avg_at_k/s1"] == 1.0 and m["val/avg_at_k/s2"] == pytest.approx(1 / 3, abs=1e-15)
    # One row without a level is enough to fall back to the row mean.
    mixed = [_row(t, level if q != "a" else None, q=q) for t, level, q in UNEQUAL]
    assert val_metrics(UNEQUAL_TEXTS, mixed)["val/avg_at_k"] == 2 / 4


def test_distinct_prompts_counts_prompts_not_rows():
    texts = [["Answer: 1"]] * 4
    rows = [_row("1", q="a"), _row("1", q="b"), _row("1", q="a"), _row("1", q="c")]
    assert val_metrics(texts, rows)["val/distinct_prompts"] == 3.0


def test_engines_shares_merge_back_in_row_order_with_the_version_range():
    rows = [_row("7", q="a"), _row("5", q="b"), _row("4", q="c")]
    texts = [["Answer: 7", "x"], ["Answer: 5", "Answer: 5"], ["x", "y"]]
    parts = split_rows(rows, 2)
    assert parts == [[0, 2], [1]]
    shares = [{"scores": prompt_scores([texts[i] for i in idx], [rows[i] for i in idx]), "gen_tokens": 3,
               "version_min": v0, "version_max": v1} for idx, (v0, v1) in zip(parts, [(4, 5), (4, 4)])]
    m = merge_parts(parts, shares, rows)
    assert m["val/avg_at_k"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)  # the rows' own order, not the engines'
    assert (m["val/version"], m["val/version_max"], m["val/gen_tokens"]) == (4.0, 5.0, 6.0)
    assert m == {**val_metrics(texts, rows), "val/version": 4.0, "val/version_max": 5.0, "val/gen_tokens": 6.0}


def test_validation_scores_with_the_runs_reward_function():
    def length_reward(data_source, solution, ground_truth, extra_info):  # a user's: no pred reported
        return RewardResult(score=1.0, acc=len(solution) == int(ground_truth), pred="")

    scores = prompt_scores([["abc", "ab", "abc"]], [_row("3", q="a")], length_reward)
    assert scores == [(2 / 3, 1.0, 0.0)]  # no pred: no majority vote


def test_validation_uses_verls_reward_by_default_and_the_runs_reward_section():
    from async_dapo.config import RewardConfig
    from async_dapo.data.reward import load_score_fn

    texts, rows = [["so \\boxed{7}", "Answer: 7"]], [_row("7", q="a")]
    assert prompt_scores(texts, rows) == [(0.5, 1.0, 1.0)]  # verl's math_dapo: no Answer line -> wrong
    boxed = load_score_fn(RewardConfig(boxed_fallback="exact"))
    assert prompt_scores(texts, rows, boxed) == [(1.0, 1.0, 1.0)]
