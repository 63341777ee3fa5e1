"""avg@k / pass@k / maj@k scoring of validation samples."""

from async_dapo.data import Message, PromptRow, RewardSpec
from async_dapo.evaluate import val_metrics


def test_scores_hand_computed():
    texts = [
        ["Answer: 7", "Answer: 8", "Answer: 7", "junk"],  # 2/4 right; majority 7 -> right
        ["Answer: 1", "Answer: 2", "Answer: 2", "Answer: 5"],  # 1/4 right (5); majority 2 -> wrong
        ["no answer", "still none", "nothing", "Answer: 3"],  # 0/4; invalid preds never win a vote
    ]
    m = val_metrics(texts, [_row("7"), _row("5"), _row("4")])
    assert m == {"val/avg_at_k": 3 / 12, "val/pass_at_k": 2 / 3, "val/maj_at_k": 1 / 3}


def _row(truth: str, level=None, source="src"):
    extra = {"level": level} if level is not None else {}
    return PromptRow(data_source=source, prompt=[Message(role="user", content="q")], ability="math",
                     reward_model=RewardSpec(style="rule", ground_truth=truth), extra_info=extra)


def test_val_metrics_break_down_by_level():
    texts = [["Answer: 7", "Answer: 7"], ["Answer: 1", "Answer: 5"], ["x", "Answer: 4"]]
    rows = [_row("7", 1), _row("5", 2), _row("4", 2)]
    m = val_metrics(texts, rows)
    assert m["val/avg_at_k"] == 4 / 6
    assert m["val/pass_at_k"] == 1.0
    assert m["val/maj_at_k"] == 2 / 3  # prompt 2: tie 1 vs 5 goes to the first seen (1), wrong
    assert m["val/avg_at_k/L1"] == 1.0
    assert m["val/avg_at_k/L2"] == (0.5 + 0.5) / 2


def test_val_metrics_fall_back_to_data_source_and_skip_a_single_subset():
    texts = [["Answer: 7"], ["Answer: 2"]]
    by_source = val_metrics(texts, [_row("7", source="a"), _row("5", source="b")])
    assert by_source["val/avg_at_k/a"] == 1.0 and by_source["val/avg_at_k/b"] == 0.0
    one = val_metrics(texts, [_row("7"), _row("5")])
    assert sorted(one) == ["val/avg_at_k", "val/maj_at_k", "val/pass_at_k"]
