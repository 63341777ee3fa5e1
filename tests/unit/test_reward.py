"""Tests for async_dapo.data.reward: verl math_dapo semantics and the soft overlong penalty.

Tricky cases (every default-mode and strict-box expected value below was checked against verl's
``verl/utils/reward_score/math_dapo.py`` ``compute_score``; ``boxed_fallback`` is this project's
explicit extra, not verl):
  - only the last 300 characters count: an Answer line just outside the window is unseen, and
    a window starting inside the word "Answer" hides the line;
  - the LAST "Answer:" line wins; matching is case-insensitive, "Final Answer:" and
    "Answer :" match, "answers:" does not; "\\s*" after the colon crosses a newline;
  - no Answer line at all: wrong, pred "[INVALID]" (verl has no boxed fallback: "so \\boxed{42}"
    scores -1 by default);
  - "Answer: " with nothing after it extracts "" (wrong, and no boxed fallback even when it is
    switched on), while a bare "Answer:" at the very end is no match at all;
  - text after the last '=' is the answer ("x = 5" -> "5", "5 = x" -> "x");
  - thousands commas are dropped only when the rest is all digits: "1,000" == "1000" but
    "1,000.5" and "-1,000" keep their commas; "3, 4" collapses to "34" (so does "3,4");
  - "$...$" keeps the first math span ("The answer is $42$." -> "42"), but a bare trailing
    period is kept ("42." != "42"); "\\$42" -> "42";
  - units and words are removed as substrings (degrees, ^\\circ, ^{\\circ}, cm in \\text{ cm});
    "\\%", "\\," and "C" are not removed;
  - "\\frac12" -> "\\frac{1}{2}", "\\sqrt2" -> "\\sqrt{2}"; \\dfrac and \\tfrac are NOT mapped to
    \\frac (they only compare equal to themselves);
  - \\text{}, \\textbf{} and \\boxed{} wrappers are unwrapped inside an Answer line;
  - no arithmetic: "2^{10}" != "1024", "0042" != "42", "42.0" != "42";
  - boxed_fallback "exact" / "normalized" (no Answer line): the last \\boxed{} in the final 100
    characters, braces balanced ("\\boxed{\\frac{1}{2}}"), compared raw or normalised
    ("\\boxed{ 42 }" and "\\boxed{x=5}" pass only normalised); an unbalanced last box yields
    nothing even if an earlier box is complete;
  - strict_box_verify: the last box of the last 100 characters, its content equal to the raw
    ground truth exactly; Answer lines are ignored;
  - the ground truth is normalised too ("$42$", "1,000").
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_dapo.config import RewardConfig
from async_dapo.data.reward import (
    INVALID_PRED,
    RewardResult,
    UserScoreFn,
    dapo_math_score,
    last_boxed_content,
    load_score_fn,
    normalize_final_answer,
    overlong_penalty,
)

# (response, ground truth, expected acc, expected pred)
ANSWER_LINE_CASES = [
    ("Answer: 42", "42", True, "42"),
    ("answer: 42", "42", True, "42"),
    ("ANSWER:42", "42", True, "42"),
    ("Answer : 42", "42", True, "42"),
    ("Final Answer: 42", "42", True, "42"),
    ("answers: 42", "42", False, INVALID_PRED),
    ("Answer:\n42", "42", True, "42"),
    ("Answer: 41\nwait, recheck.\nAnswer: 42", "42", True, "42"),
    ("Answer: 42\nAnswer: 41", "42", False, "41"),
    ("Answer: 42\nThat is all.", "42", True, "42"),
    ("Answer: 42 ", "42", True, "42"),
    ("Answer: 4 2", "42", True, "42"),
    ("Answer: a 42", "42", True, "42"),
    # commas
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1000", "1,000", True, "1000"),
    ("Answer: 1{,}000", "1000", True, "1000"),
    ("Answer: \\$1,000", "1000", True, "1000"),
    ("Answer: 1,000.5", "1000.5", False, "1,000.5"),
    ("Answer: -1,000", "-1000", False, "-1,000"),
    ("Answer: 1\\,000", "1000", False, "1\\,000"),
    ("Answer: 3, 4", "3,4", True, "34"),
    # $...$ and periods
    ("Answer: $42$", "42", True, "42"),
    ("Answer: The answer is $42$.", "42", True, "42"),
    ("Answer: $42$.", "42", True, "42"),
    ("Answer: 42.", "42", False, "42."),
    ("Answer: \\$42", "42", True, "42"),
    ("Answer: 42", "$42$", True, "42"),
    # units, degrees, filler
    ("Answer: 42 degrees", "42", True, "42"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: 90^{\\circ}", "90", True, "90"),
    ("Answer: 5\\text{ cm}", "5", True, "5"),
    ("Answer: 42\\;", "42", True, "42"),
    ("Answer: 42^\\circ C", "42", False, "42C"),
    ("Answer: 10\\%", "10", False, "10\\%"),
    ("Answer: 42\\,", "42", False, "42\\,"),
    ("Answer: 12 cents and 5 cents", "125", False, "12and5"),
    # '='
    ("Answer: x = 5", "5", True, "5"),
    ("Answer: 2 + 3 = 5", "5", True, "5"),
    ("Answer: 5 = x", "5", False, "x"),
    # TeX shorthand and wrappers
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: \\tfrac12", "\\frac{1}{2}", False, "\\tfrac{1}{2}"),
    ("Answer: \\dfrac12", "\\dfrac{1}{2}", True, "\\dfrac{1}{2}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: \\text{(B)}", "(B)", True, "(B)"),
    ("Answer: \\textbf{42}", "42", True, "42"),
    ("Answer: \\boxed{42}", "42", True, "42"),
    # no arithmetic, string comparison only
    ("Answer: 2^{10}", "1024", False, "2^{10}"),
    ("Answer: 0042", "42", False, "0042"),
    ("Answer: 42.0", "42", False, "42.0"),
    ("Answer: 42", "", False, "42"),
    # empty answers: "Answer: " extracts "" and blocks the boxed fallback
    ("so \\boxed{42}\nAnswer: ", "42", False, ""),
]

BOXED_FALLBACK_CASES = [
    ("so \\boxed{42}\nAnswer:", "42", True, "42"),  # bare "Answer:" at the end: no match
    ("The result is \\boxed{42}.", "42", True, "42"),
    ("The result is \\boxed{ 42 }.", "42", True, "42"),
    ("\\boxed{x=5}", "5", True, "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{41} then \\boxed{42}", "42", True, "42"),
    ("\\boxed{41} then \\boxed{4", "41", False, INVALID_PRED),  # last box unbalanced
    ("\\boxed{42}" + "y" * 91, "42", False, INVALID_PRED),  # box starts before the last 100
    ("\\boxed{42}" + "y" * 90, "42", True, "42"),  # 10 + 90 = 100 characters: inside
    ("", "42", False, INVALID_PRED),
    ("I think it is 42", "42", False, INVALID_PRED),
]


@pytest.mark.parametrize(("response", "truth", "acc", "pred"), ANSWER_LINE_CASES)
def test_answer_line(response: str, truth: str, acc: bool, pred: str) -> None:
    result = dapo_math_score(response, truth)
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


@pytest.mark.parametrize(("response", "truth", "acc", "pred"), BOXED_FALLBACK_CASES)
def test_boxed_fallback_normalized_switch(response: str, truth: str, acc: bool, pred: str) -> None:
    result = dapo_math_score(response, truth, boxed_fallback="normalized")
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


@pytest.mark.parametrize(("response", "truth"), [(r, t) for r, t, _, _ in BOXED_FALLBACK_CASES])
def test_no_answer_line_is_wrong_by_default_as_in_verl(response: str, truth: str) -> None:
    # verl's math_dapo: no "Answer:" match -> extracted "[INVALID]" -> -1. No box is looked at.
    assert dapo_math_score(response, truth) == RewardResult(-1.0, False, INVALID_PRED)


def test_the_issue_example_so_boxed_42() -> None:
    # No Answer line: -1 in verl and here by default; +1 only with the explicit extra.
    assert dapo_math_score("so \\boxed{42}", "42") == RewardResult(-1.0, False, INVALID_PRED)
    assert dapo_math_score("so \\boxed{42}", "42", boxed_fallback="exact") == RewardResult(1.0, True, "42")
    assert dapo_math_score("so \\boxed{42}", "42", boxed_fallback="normalized") == RewardResult(1.0, True, "42")


@pytest.mark.parametrize(("response", "truth", "acc", "pred"), [
    ("The answer is \\boxed{ 3 }", "3", False, " 3 "),  # raw content vs raw ground truth
    ("The answer is \\boxed{3}", "3", True, "3"),
    ("\\boxed{x=5}", "5", False, "x=5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{41} then \\boxed{4", "41", False, INVALID_PRED),
    ("\\boxed{4}\nAnswer:  3", "3", True, "3"),  # an Answer line still decides first, normalised as in verl
    ("so \\boxed{42}\nAnswer: ", "42", False, ""),  # even an empty one
])
def test_boxed_fallback_exact(response: str, truth: str, acc: bool, pred: str) -> None:
    result = dapo_math_score(response, truth, boxed_fallback="exact")
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def test_unknown_boxed_fallback_is_refused() -> None:
    with pytest.raises(ValueError, match="boxed_fallback"):
        dapo_math_score("Answer: 1", "1", boxed_fallback="loose")


def test_reward_section_reaches_the_builtin_reward() -> None:
    verl, exact, normalized, strict = (
        load_score_fn(RewardConfig(**kw)) for kw in
        ({}, {"boxed_fallback": "exact"}, {"boxed_fallback": "normalized"}, {"strict_box_verify": True}))
    for response, expected in [  # (verl default, exact, normalized, strict) acc
        ("so \\boxed{ 3 }", (False, False, True, False)),
        ("so \\boxed{3}", (False, True, True, True)),
        ("Answer: 3", (True, True, True, False)),
    ]:
        got = tuple(fn("d", response, "3", {}).acc for fn in (verl, exact, normalized, strict))
        assert got == expected, response


def test_only_last_300_characters_count() -> None:
    # "Answer: 42\n" is 11 characters: + 289 = 300 keeps the whole line ...
    assert dapo_math_score("Answer: 42\n" + "z" * 289, "42").acc
    # ... + 290 cuts the "A" off, the line no longer matches and nothing else is there.
    assert dapo_math_score("Answer: 42\n" + "z" * 290, "42").pred == INVALID_PRED
    # A later wrong Answer line still wins over an earlier right one inside the window;
    # an earlier right one outside the window never counts.
    long_tail = "Answer: 42\n" + "reasoning " * 40 + "Answer: 7"
    assert dapo_math_score(long_tail, "42") == RewardResult(-1.0, False, "7")


def test_long_response_answer_at_end() -> None:
    response = "step " * 20_000 + "\nAnswer: 1,234"
    assert dapo_math_score(response, "1234") == RewardResult(1.0, True, "1234")


@pytest.mark.parametrize(("response", "truth", "acc", "pred"), [
    ("so \\boxed{42}", "42", True, "42"),
    ("Answer: \\boxed{42}", "42", True, "42"),
    ("so \\boxed{ 42 }", "42", False, " 42 "),  # exact: no normalisation at all
    ("\\boxed{x=5}", "5", False, "x=5"),
    ("\\boxed{42.}", "42", False, "42."),
    ("\\boxed{1,000}", "1000", False, "1,000"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),  # braces balanced
    ("\\boxed{41} then \\boxed{42}", "42", True, "42"),  # the last box
    ("\\boxed{42} then \\boxed{41}", "42", False, "41"),
    ("\\boxed{42} then \\boxed{4", "42", False, INVALID_PRED),  # last box unbalanced: nothing
    ("Answer: 42", "42", False, INVALID_PRED),  # the Answer line is ignored
    ("\\boxed{41}\nAnswer: 42", "42", False, "41"),
    ("\\boxed{42}" + "y" * 90, "42", True, "42"),  # 10 + 90 = 100 characters: the box is inside
    ("\\boxed{42}" + "y" * 91, "42", False, INVALID_PRED),  # "\\" is the 101st from the end: outside
    ("\\boxed{42}" + "y" * 88 + "\\boxed{7", "42", False, INVALID_PRED),
    ("", "42", False, INVALID_PRED),
])
def test_strict_box_verify(response: str, truth: str, acc: bool, pred: str) -> None:
    result = dapo_math_score(response, truth, strict_box_verify=True)
    assert result == RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)
    # boxed_fallback only shapes the Answer-line mode: it changes nothing here.
    assert dapo_math_score(response, truth, strict_box_verify=True, boxed_fallback="normalized") == result


def test_strict_box_window_is_the_last_100_characters_of_a_long_response() -> None:
    assert dapo_math_score("x" * 5000 + " so \\boxed{42}", "42", strict_box_verify=True).acc
    # A right box 200 characters from the end is inside verl's 300-character window but not in the 100.
    assert not dapo_math_score("\\boxed{42}" + "y" * 190, "42", strict_box_verify=True).acc


def test_invalid_literal_is_an_answer_like_any_other() -> None:
    # As verl: an Answer line decides; its text "[INVALID]" is compared with the ground truth, no fallback.
    assert dapo_math_score("Answer: [INVALID]\n\\boxed{42}", "42") == RewardResult(-1.0, False, INVALID_PRED)
    result = dapo_math_score("Answer: [INVALID]\n\\boxed{42}", "42", boxed_fallback="exact")
    assert result == RewardResult(-1.0, False, INVALID_PRED)


# ------------------------------------------------------------------------ picklable scorers

USER_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    pred = solution_str.strip()
    return {"score": 1.0 if pred == ground_truth else -1.0, "pred": pred}
"""


def _user_file(tmp_path) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(USER_REWARD)
    return str(path)


def test_builtin_scorer_survives_a_pickle_round_trip() -> None:
    fn = load_score_fn(RewardConfig(boxed_fallback="exact"))
    again = pickle.loads(pickle.dumps(fn))
    assert again("d", "so \\boxed{42}", "42", {}) == RewardResult(1.0, True, "42")
    default = pickle.loads(pickle.dumps(load_score_fn(RewardConfig())))
    assert default("d", "so \\boxed{42}", "42", {}) == RewardResult(-1.0, False, INVALID_PRED)


def test_user_scorer_pickles_as_its_spec_and_reloads(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _user_file(tmp_path)
    fn = load_score_fn(RewardConfig(function="user_reward.py:compute_score"))  # relative to the cwd
    assert isinstance(fn, UserScoreFn) and fn.spec == f"{tmp_path / 'user_reward.py'}:compute_score"
    assert fn("d", " 42 ", "42", {}) == RewardResult(1.0, True, "42")  # acc defaults to score > 0
    state = pickle.dumps(fn)
    assert b"compute_score" in state and b"def " not in state
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))  # the path was made absolute
    assert pickle.loads(state)("d", "41", "42", {}) == RewardResult(-1.0, False, "41")


def test_bad_user_function_fails_where_the_config_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="missing.py:score"):
        load_score_fn(RewardConfig(function="missing.py:score"))
    with pytest.raises(ValueError, match="nope"):
        load_score_fn(RewardConfig(function=f"{_user_file(tmp_path)}:nope"))


def test_scorers_run_in_a_spawned_worker(tmp_path) -> None:
    builtin = load_score_fn(RewardConfig(boxed_fallback="exact"))
    user = load_score_fn(RewardConfig(function=f"{_user_file(tmp_path)}:compute_score"))
    module = load_score_fn(RewardConfig(function="async_dapo.data.reward:builtin_score"))
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(os.getpid).result() != os.getpid()
        assert pool.submit(builtin, "d", "so \\boxed{42}", "42", {}).result() == RewardResult(1.0, True, "42")
        assert pool.submit(user, "d", "42", "42", {}).result() == RewardResult(1.0, True, "42")
        assert pool.submit(user, "d", "7", "42", {}).result() == RewardResult(-1.0, False, "7")
        # A module spec: verl's default-mode scorer, called with verl's signature.
        assert pool.submit(module, "d", "so \\boxed{42}", "42", {}).result() == RewardResult(-1.0, False, INVALID_PRED)


def test_result_is_frozen() -> None:
    result = dapo_math_score("Answer: 1", "1")
    with pytest.raises(AttributeError):
        result.score = -1.0  # type: ignore[misc]


def test_normalize_and_boxed_helpers() -> None:
    assert normalize_final_answer("  The answer is $\\frac12$ ") == "\\frac{1}{2}"
    assert normalize_final_answer("\\text{5 units}") == "5"
    assert last_boxed_content("\\boxed{a{b}c} and \\boxed{d}") == "d"
    assert last_boxed_content("\\boxed{a{b}c}") == "a{b}c"
    assert last_boxed_content("no box") is None


def test_reward_module_does_not_import_torch() -> None:
    import ast
    import inspect

    from async_dapo.data import reward

    imported: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(reward))):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported and "numpy" not in imported


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.text(max_size=20))
def test_score_never_raises_and_is_consistent(response: str, truth: str) -> None:
    for kwargs in ({}, {"strict_box_verify": True}, {"boxed_fallback": "exact"}, {"boxed_fallback": "normalized"}):
        result = dapo_math_score(response, truth, **kwargs)
        assert result.score in (1.0, -1.0)
        assert result.acc == (result.score == 1.0)
        assert isinstance(result.pred, str)
    if not re.search(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:]):  # verl's pattern: no box is read
        assert dapo_math_score(response, truth) == RewardResult(-1.0, False, INVALID_PRED)


# ----------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (16, 0.0),  # exactly max - buffer = 20 - 4
        (17, -0.25),  # one past: (16 - 17) / 4
        (18, -0.5),  # (16 - 18) / 4
        (19, -0.75),
        (20, -1.0),  # exactly max
        (25, -1.0),  # beyond max: clamped at -factor
    ],
)
def test_overlong_penalty_boundaries(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_response_length=20, buffer_length=4) == pytest.approx(
        expected, abs=0.0
    )


def test_overlong_penalty_factor_scales() -> None:
    # (16 - 17) / 4 * 0.5 = -0.125; at and beyond max: -0.5.
    assert overlong_penalty(17, 20, 4, penalty_factor=0.5) == -0.125
    assert overlong_penalty(20, 20, 4, penalty_factor=0.5) == -0.5
    assert overlong_penalty(1000, 20, 4, penalty_factor=0.5) == -0.5
    # buffer == max: the ramp starts at 0; (0 - 1) / 20 = -0.05.
    assert overlong_penalty(1, 20, 20) == -0.05


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"buffer_length": 0}, "buffer_length"),
        ({"buffer_length": -1}, "buffer_length"),
        ({"buffer_length": 21}, "buffer_length"),
        ({"max_response_length": 0}, "max_response_length"),
        ({"penalty_factor": -1.0}, "penalty_factor"),
        ({"response_length": -1}, "response_length"),
    ],
)
def test_overlong_penalty_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    args = {"response_length": 5, "max_response_length": 20, "buffer_length": 4} | kwargs
    with pytest.raises(ValueError, match=name):
        overlong_penalty(**args)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5000),
    st.data(),
    st.floats(0.0, 10.0, allow_nan=False),
)
def test_overlong_penalty_is_monotone_and_bounded(max_len: int, data, factor: float) -> None:
    buffer = data.draw(st.integers(1, max_len))
    a = data.draw(st.integers(0, 2 * max_len))
    b = data.draw(st.integers(a, 2 * max_len))
    pa, pb = (overlong_penalty(x, max_len, buffer, factor) for x in (a, b))
    assert -factor <= pb <= pa <= 0.0


def test_walk_score_wants_the_whole_sequence() -> None:
    from async_dapo.data.rows import WALK_SOURCE
    from async_dapo.data.reward import builtin_score, walk_score

    truth = "voo woo xoo zoo"
    assert walk_score("voo woo xoo zoo", truth) == RewardResult(1.0, True, "zoo")
    assert walk_score(" voo  woo\nxoo zoo ", truth).acc  # whitespace is not the task
    assert walk_score("voo xoo zoo", truth) == RewardResult(-1.0, False, "zoo")  # a skipped step
    assert walk_score("voo woo xoo", truth).acc is False  # truncated
    assert walk_score("", truth) == RewardResult(-1.0, False, INVALID_PRED)
    assert builtin_score(WALK_SOURCE, "voo woo xoo zoo", truth, {}).acc
    assert not builtin_score("async_dapo/arith", "voo woo xoo zoo", truth, {}).acc  # math rules elsewhere
