"""Row schema, parquet/JSONL loading with row-level errors, and the synthetic task."""

import json
import logging

import pytest

from async_dapo.config import load_config
from async_dapo.data.rows import (
    DatasetError, LEVELS, Message, RewardSpec, fit_prompt_lengths, load_rows, source_name, synthetic_distinct_rows,
    synthetic_problems, synthetic_response, synthetic_rows, val_rows, write_rows,
)
from async_dapo.data.reward import dapo_math_score

DAPO_ROW = {  # the shape of a DAPO-Math-17k row as users have it
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": "Solve ... Answer: $Answer\n\nWhat is 1+1?"}],
    "ability": "MATH",
    "reward_model": {"style": "rule-lighteval/MATH_v2", "ground_truth": "2"},
    "extra_info": {"index": "a0"},
}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_synthetic_rows_round_trip(tmp_path, suffix):
    rows = synthetic_rows("train", 40, levels=[1, 2, 3, 4], heldout_fraction=0.1, seed=3)
    path = tmp_path / f"rows{suffix}"
    write_rows(rows, path)
    assert load_rows(path) == rows


def test_dapo_math_row_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([DAPO_ROW, DAPO_ROW]), tmp_path / "d.parquet")
    rows = load_rows(tmp_path / "d.parquet")
    assert rows[1].ground_truth == "2" and rows[0].prompt[0].role == "user"


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda r: r["reward_model"].pop("ground_truth"), "row 2: reward_model.ground_truth: Field required"),
        (lambda r: r.update(prompt=[]), "row 2: prompt: List should have at least 1 item"),
        (lambda r: r["prompt"][0].update(role="robot"), "row 2: prompt.0.role: Input should be"),
        (lambda r: r.pop("data_source"), "row 2: data_source: Field required"),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path, mutate, expected):
    bad = json.loads(json.dumps(DAPO_ROW))
    mutate(bad)
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [DAPO_ROW, DAPO_ROW, bad]) + "\n")
    with pytest.raises(DatasetError) as err:
        load_rows(path)
    assert str(err.value).startswith(f"{path}: {expected}"), str(err.value)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(DAPO_ROW) + "\n{oops\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 1: not valid JSON"):
        load_rows(path)


def test_integer_ground_truth_is_text(tmp_path):
    row = dict(DAPO_ROW, reward_model={"style": "rule", "ground_truth": 42})
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert load_rows(tmp_path / "d.jsonl")[0].ground_truth == "42"


def test_synthetic_answers_and_split():
    for level in LEVELS:
        train = synthetic_problems(level, "train", 0.1)
        val = synthetic_problems(level, "val", 0.1)
        assert not set(q for q, _ in train) & set(q for q, _ in val)
        assert 0.05 < len(val) / (len(train) + len(val)) < 0.2
    assert ("What is 12*7?", 84) in synthetic_problems(4, "train", 0.1) + synthetic_problems(4, "val", 0.1)
    assert ("What is 3-9?", -6) in synthetic_problems(1, "train", 0.1) + synthetic_problems(1, "val", 0.1)


def test_synthetic_rows_deterministic_and_balanced():
    a = synthetic_rows("train", 100, levels=[1, 3], heldout_fraction=0.1, seed=7)
    b = synthetic_rows("train", 100, levels=[1, 3], heldout_fraction=0.1, seed=7)
    assert a == b
    assert [r.extra_info["level"] for r in a[:4]] == [1, 3, 1, 3]
    row = a[1]
    a_, op, b_ = row.prompt[0].content.removeprefix("What is ").removesuffix("?").partition("+") \
        if "+" in row.prompt[0].content else row.prompt[0].content.removeprefix("What is ").removesuffix("?").partition("-")
    assert int(row.ground_truth) == (int(a_) + int(b_) if op == "+" else int(a_) - int(b_))
    assert synthetic_response(row) == f"Answer: {row.ground_truth}"


def _row(question: str, answer: int):
    return synthetic_rows("train", 1, levels=[2], heldout_fraction=0.1, seed=0)[0].model_copy(update={
        "prompt": [Message(role="user", content=question)],
        "reward_model": RewardSpec(style="rule", ground_truth=str(answer))})


def test_steps_style_shows_the_carry_or_borrow_before_the_answer_line_for_half_of_the_problems():
    assert synthetic_response(_row("What is 14+7?", 21), "steps") == "4+7=11, carry 1. Answer: 21"
    assert synthetic_response(_row("What is 11-3?", 8), "steps") == "11-3=8, borrow 1. Answer: 8"
    assert synthetic_response(_row("What is 2+8?", 10), "steps") == "2+8=10, carry 1. Answer: 10"
    # a carry in the other half (by hash), no carry, a one-digit subtraction, a product: the answer line only
    for q, a in [("What is 11+9?", 20), ("What is 14+2?", 16), ("What is 2-7?", -5), ("What is 12*3?", 36)]:
        assert synthetic_response(_row(q, a), "steps") == f"Answer: {a}"
    assert synthetic_response(_row("What is 14+7?", 21)) == "Answer: 21"  # the default style
    carries = [_row(q, a) for q, a in synthetic_problems(2, "train", 0.1) if "+" in q and int(q[9]) + int(q[-2]) >= 10]
    shown = sum(synthetic_response(r, "steps") != synthetic_response(r) for r in carries) / len(carries)
    assert 0.4 < shown < 0.6
    assert dapo_math_score("4+7=11, carry 1. Answer: 21", "21").acc  # the reward reads the answer line


def _val_cfg(*overrides):
    return load_config(None, ["data.synthetic.levels=[1,2]", "data.synthetic.heldout_fraction=0.3", *overrides])


def test_synthetic_val_rows_are_every_distinct_heldout_problem_once():
    heldout = {q for lv in (1, 2) for q, _ in synthetic_problems(lv, "val", 0.3)}
    assert len(heldout) == 50 + 554  # level 1 has 50 held-out problems, level 2 has 554
    rows = val_rows(_val_cfg("logging.val_prompts=1000"))  # more than there are: no cycling
    questions = [r.prompt[0].content for r in rows]
    assert len(questions) == len(set(questions)) == 604 and set(questions) == heldout
    assert [r.extra_info["index"] for r in rows] == list(range(604))
    assert {r.extra_info["split"] for r in rows} == {"val"}
    # Levels alternate until level 1's 50 are used up (rows 0..99), then only level 2 is left.
    assert [r.extra_info["level"] for r in rows[:100]] == [1, 2] * 50
    assert {r.extra_info["level"] for r in rows[100:]} == {2}
    q, ans = next((q, a) for q, a in synthetic_problems(1, "val", 0.3) if q == rows[0].prompt[0].content)
    assert rows[0].ground_truth == str(ans)


def test_synthetic_val_rows_cap_and_alternate():
    rows = val_rows(_val_cfg("logging.val_prompts=7"))
    assert [r.extra_info["level"] for r in rows] == [1, 2, 1, 2, 1, 2, 1]
    assert len({r.prompt[0].content for r in rows}) == 7
    # Deterministic in logging.seed; while no level runs out it is the training-style interleave.
    assert rows == synthetic_distinct_rows("val", levels=[1, 2], heldout_fraction=0.3, seed=0, limit=7)
    assert rows == synthetic_rows("val", 7, levels=[1, 2], heldout_fraction=0.3, seed=0)
    assert rows != val_rows(_val_cfg("logging.val_prompts=7", "logging.seed=1"))


def test_file_val_rows_drop_repeated_prompts(tmp_path, caplog):
    base = synthetic_rows("train", 3, levels=[3], heldout_fraction=0.1, seed=0)  # 3 distinct prompts
    other_role = base[0].model_copy(update={"prompt": [base[0].prompt[0].model_copy(update={"role": "system"})]})
    rows = [base[0], base[1], base[0], base[2], base[1], base[0], other_role]  # verl-style repeats
    path = tmp_path / "val.jsonl"
    write_rows(rows, path)
    with caplog.at_level(logging.INFO, logger="async_dapo.data.rows"):
        got = val_rows(_val_cfg(f"data.val={path}", "logging.val_prompts=100"))
    assert got == [base[0], base[1], base[2], other_role]  # first occurrence wins; the role is part of the prompt
    assert f"{path}: removed 3 duplicate prompt rows of 7 (4 distinct)" in caplog.text
    capped = val_rows(_val_cfg(f"data.val={path}", "logging.val_prompts=2"))
    assert capped == [base[0], base[1]]  # deduplicated before the cap


def test_cursor_epochs_are_permutations_and_resume_exactly():
    from async_dapo.data.rows import PromptCursor

    cur = PromptCursor(5, seed=1)
    first = cur.take(7)  # crosses into epoch 1
    assert [e for e, _ in first] == [0] * 5 + [1] * 2
    assert sorted(i for e, i in first if e == 0) == [0, 1, 2, 3, 4]
    # A checkpoint while two prompts are in flight: they are given back and re-issued first.
    cur.give_back([first[6], first[5]])
    saved = cur.state_dict()
    resumed = PromptCursor(5, seed=1)
    resumed.load_state_dict(saved)
    rest_a, rest_b = cur.take(8), resumed.take(8)
    assert rest_a == rest_b
    assert rest_a[:2] == sorted([first[5], first[6]])
    # Over epoch 1 every index appears exactly once: nothing replayed, nothing skipped.
    epoch1 = [i for e, i in first[5:] + rest_a[2:] if e == 1]
    assert sorted(epoch1) == [0, 1, 2, 3, 4]


def test_cursor_retires_a_prompt_after_its_solved_groups_and_skips_all_its_rows():
    from async_dapo.data.rows import PromptCursor

    # 6 rows of 3 prompts (A at rows 0 and 3, B at 1 and 4, C at 2 and 5), as a dataset repeating problems.
    keys = [0, 1, 2, 0, 1, 2]
    cur = PromptCursor(6, seed=0, keys=keys, retire_after=2)
    first = cur.take(6)  # epoch 0, every row once: nothing retired yet
    assert sorted(i for _, i in first) == [0, 1, 2, 3, 4, 5] and cur.skipped == 0
    assert cur.solved(0) is False  # A: 1 of 2 all-correct groups
    assert cur.solved(3) is True  # row 3 is A too: its second, so A retires now
    assert cur.solved(0) is False and cur.retired == {0}  # already retired: counted, not retired again
    cur.give_back([(0, 3), (0, 4)])  # in flight at a checkpoint: a retired prompt given back is skipped too
    got = cur.take(9)
    assert got[0] == (0, 4) and cur.skipped >= 1 + 2  # the given-back row 3, then rows 0 and 3 of epoch 1
    assert {i for _, i in got[1:]} == {1, 2, 4, 5}  # rows 0 and 3 are never handed out again
    # Nothing lost: every row the cursor passed was handed out or counted as skipped.
    assert len(got) - 1 + cur.skipped - 1 == (cur.epoch - 1) * 6 + cur.position
    resumed = PromptCursor(6, seed=0, keys=keys, retire_after=2)
    resumed.load_state_dict(cur.state_dict())
    assert (resumed.retired, resumed.solved_counts[0], resumed.skipped) == ({0}, 3, cur.skipped)
    assert resumed.take(5) == cur.take(5)
    for row in (1, 4, 2, 5):  # B and C reach two all-correct groups: nothing is left to hand out
        cur.solved(row)
    assert cur.exhausted and cur.take(3) == []


def test_cursor_without_retirement_never_retires():
    from async_dapo.data.rows import PromptCursor

    cur = PromptCursor(3, seed=0)
    assert [cur.solved(0) for _ in range(5)] == [False] * 5
    assert sorted(i for _, i in cur.take(3)) == [0, 1, 2] and cur.skipped == 0


def test_prompt_ids_are_equal_for_equal_prompts():
    from async_dapo.data.rows import prompt_ids

    rows = synthetic_rows("train", 6, levels=[1], heldout_fraction=0.3, seed=0)
    assert prompt_ids(rows + rows[:2]) == [0, 1, 2, 3, 4, 5, 0, 1]


def test_cursor_rejects_foreign_state():
    from async_dapo.data.rows import PromptCursor

    with pytest.raises(ValueError, match="another dataset"):
        PromptCursor(5, seed=2).load_state_dict(PromptCursor(6, seed=2).state_dict())


# --------------------------------------------------------------------- data.max_prompt_length / truncation
def _rows(k):
    return synthetic_rows("train", k, levels=[1], heldout_fraction=0.1, seed=0)


def test_fit_prompt_lengths_all_fit():
    assert fit_prompt_lengths(_rows(3), [5, 8, 1], max_len=8, truncation="error", source="d.jsonl") == [0, 0, 0]
    assert fit_prompt_lengths(_rows(3), [5, 8, 1], max_len=8, truncation="left", source="d.jsonl") == [0, 0, 0]
    assert fit_prompt_lengths([], [], max_len=8, truncation="error", source="d.jsonl") == []


def test_fit_prompt_lengths_error_names_source_and_first_long_row():
    with pytest.raises(DatasetError) as err:
        fit_prompt_lengths(_rows(4), [3, 9, 12, 2], max_len=8, truncation="error", source="/data/x.parquet")
    assert str(err.value) == (
        "/data/x.parquet: row 1: prompt: 9 tokens > data.max_prompt_length 8 "
        "(set data.truncation=left to keep the last 8 tokens)"
    )


def test_fit_prompt_lengths_left_drops_leading_tokens():
    drops = fit_prompt_lengths(_rows(4), [3, 9, 12, 8], max_len=8, truncation="left", source="synthetic:train")
    assert drops == [0, 1, 4, 0]
    ids = list(range(12))
    assert ids[drops[2]:] == [4, 5, 6, 7, 8, 9, 10, 11]  # the last max_len tokens are kept


def test_fit_prompt_lengths_rejects_misuse():
    with pytest.raises(ValueError, match="2 rows but 1 prompt lengths"):
        fit_prompt_lengths(_rows(2), [1], max_len=8, truncation="error", source="s")
    with pytest.raises(ValueError, match="data.truncation must be 'error' or 'left', got 'right'"):
        fit_prompt_lengths(_rows(1), [1], max_len=8, truncation="right", source="s")


def test_source_name():
    from async_dapo.config import load_config

    cfg = load_config(None)
    assert (source_name(cfg, "train"), source_name(cfg, "val")) == ("synthetic:train", "synthetic:val")
    cfg = load_config(None, ["data.train=/data/dapo-math-17k.parquet", "data.val=/data/aime-2024.parquet"])
    assert source_name(cfg, "train") == "/data/dapo-math-17k.parquet"
    assert source_name(cfg, "val") == "/data/aime-2024.parquet"
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        source_name(cfg, "test")


# ------------------------------------------------------------------------------------- walk task
def test_walk_rows_lengths_follow_the_lognormal_and_the_answer_is_the_rest_of_the_cycle():
    from async_dapo.data.rows import WALK_SOURCE, WALK_SYLLABLES, walk_rows

    assert len(WALK_SYLLABLES) == len(set(WALK_SYLLABLES)) == 200
    rows = walk_rows("train", 4000, median=25, sigma=0.8, heldout_fraction=0.3, seed=0)
    assert rows == walk_rows("train", 4000, median=25, sigma=0.8, heldout_fraction=0.3, seed=0)
    row = rows[0]
    k = row.extra_info["steps"]
    start = WALK_SYLLABLES[200 - k]
    assert row.data_source == WALK_SOURCE and row.prompt[0].content == f"Walk from {start}."
    assert row.ground_truth.split() == WALK_SYLLABLES[200 - k:] and row.ground_truth.split()[-1] == "zoo"
    steps = sorted(r.extra_info["steps"] for r in rows)
    median = steps[len(steps) // 2]
    assert 19 <= median <= 31  # lognormal median 25, less the held-out step counts
    # right-skewed: P(k > 5 x 25) = P(Z > ln 5 / 0.8 = 2.01) = 2.2 % of the lognormal
    assert 0.005 < sum(s > 125 for s in steps) / len(steps) < 0.05
    assert steps[-1] <= 200 and steps[0] >= 1


def test_walk_splits_are_disjoint_and_validation_rows_distinct():
    from async_dapo.data.rows import walk_rows

    train = {r.prompt[0].content for r in walk_rows("train", 3000, median=25, sigma=0.8, heldout_fraction=0.3, seed=0)}
    val = walk_rows("val", 1000, median=25, sigma=0.8, heldout_fraction=0.3, seed=0, distinct=True)
    texts = [r.prompt[0].content for r in val]
    assert len(texts) == len(set(texts)) and not set(texts) & train
    assert 30 < len(val) < 90  # the split's distinct problems (about 30 % of 200), fewer than asked
    assert len(walk_rows("val", 5, median=25, sigma=0.8, heldout_fraction=0.3, seed=0, distinct=True)) == 5


def test_walk_response_is_the_reference_answer():
    from async_dapo.data.rows import _is_heldout, synthetic_response, walk_rows

    split = "val" if _is_heldout("Walk from woo.", 0.3) else "train"  # the 3-step problem
    row = walk_rows(split, 1, median=3, sigma=0.0, heldout_fraction=0.3, seed=0)[0]
    assert synthetic_response(row, "steps") == row.ground_truth == "woo xoo zoo"
    other = "train" if split == "val" else "val"
    with pytest.raises(ValueError, match=f"walk_median 3, walk_sigma 0: .* {other} split"):
        walk_rows(other, 1, median=3, sigma=0.0, heldout_fraction=0.3, seed=0)
