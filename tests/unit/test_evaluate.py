"""avg@k / pass@k / maj@k scoring of validation samples."""

from async_dapo.evaluate import score_groups


def test_scores_hand_computed():
    texts = [
        ["Answer: 7", "Answer: 8", "Answer: 7", "junk"],  # 2/4 right; majority 7 -> right
        ["Answer: 1", "Answer: 2", "Answer: 2", "Answer: 5"],  # 1/4 right (5); majority 2 -> wrong
        ["no answer", "still none", "nothing", "Answer: 3"],  # 0/4; invalid preds never win a vote
    ]
    avg, pas, maj = score_groups(texts, ["7", "5", "4"])
    assert avg == 3 / 12
    assert pas == 2 / 3
    assert maj == 1 / 3
