"""Rule-based math reward for DAPO and the soft overlong penalty.

Runs inside the rollout actors, so it is pure Python + ``re`` (no torch import).

``dapo_math_score`` reproduces the semantics of verl's ``math_dapo.compute_score``
(verl-project/verl main): only the last 300 characters of the response are read; the LAST
"Answer: ..." line (case-insensitive) is normalised and compared, as a string, with the
normalised ground truth. verl stops there (no Answer line = wrong); here, when the response has no
Answer line, the last ``\\boxed{...}`` in the last 100 characters of that window is compared instead,
exactly with the raw ground truth as verl's strict box check does (``reward.boxed_match: exact``), or
after normalising both (``normalized``, an explicit switch).
The deliberate differences from verl are listed in docs/algorithm.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "INVALID_PRED",
    "RewardResult",
    "dapo_math_score",
    "builtin_score",
    "last_boxed_content",
    "load_score_fn",
    "normalize_final_answer",
    "overlong_penalty",
]

# What ``pred`` holds when nothing could be extracted (verl's marker, kept for log parity).
INVALID_PRED = "[INVALID]"
# verl reads only the tail: "the longest answer in MATH-500 has 159 characters".
SOLUTION_WINDOW = 300
BOXED_WINDOW = 100

# Note ``\s*`` after the colon may cross a newline ("Answer:\n42" is read as "42").
_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOXED_OPEN = "\\boxed{"

# Plain substring rewrites, applied in this order (order matters: "an " before "a ",
# spaces are gone before the ``\text{...}`` patterns below are matched).
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Units, filler words and TeX decorations deleted as substrings (after the substitutions).
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)

# Regex rewrites, in order: keep only the first $...$ span, unwrap \text{} \textbf{}
# \overline{} (up to the first closing brace) and \boxed{} (up to the last one), then expand
# the shorthand \frac12 -> \frac{1}{2} and \sqrt2 -> \sqrt{2}.
_REGEX_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),
)


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one response: ``score`` is +1.0/-1.0, ``acc`` the correctness flag
    (the dynamic-sampling filter reads ``acc``, never the shaped score), ``pred`` the
    normalised extracted answer, or ``INVALID_PRED`` when none was found."""

    score: float
    acc: bool
    pred: str


def normalize_final_answer(answer: str) -> str:
    """Normalise a final answer string the way verl's ``normalize_final_answer`` does.

    Keeps the text after the last '=', applies the substitutions and removals above, unwraps
    TeX wrappers, expands ``\\frac``/``\\sqrt`` shorthand, drops '$', and drops commas when
    what remains is all digits ("1,000" -> "1000").
    """
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    for pattern, replacement in _REGEX_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    without_commas = answer.replace(",", "")
    if without_commas.isdigit():  # str.isdigit, as verl: "-1,000" and "1,000.5" keep commas
        answer = without_commas
    return answer.strip()


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, or None.

    Only the LAST opening ``\\boxed{`` is considered; if its braces never balance (e.g. the
    response was cut off) the result is None even when an earlier box is complete.
    """
    start = text.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOXED_OPEN) - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED_OPEN) : i]
    return None


def _result(correct: bool, pred: str) -> RewardResult:
    return RewardResult(score=1.0 if correct else -1.0, acc=correct, pred=pred)


def dapo_math_score(
    solution: str, ground_truth: str, *, strict_box_verify: bool = False, boxed_match: str = "exact"
) -> RewardResult:
    """Score a response against its ground truth with verl's ``math_dapo`` rules.

    Default mode: take the last 300 characters; if they contain an "Answer:" line, the last
    one decides (normalised string equality with the normalised ground truth). Otherwise the
    last ``\\boxed{}`` in the final 100 of those characters decides: equal to the raw ground truth
    (``boxed_match="exact"``, verl's strict box rule: ``\\boxed{ 3 }`` is not ``3``) or equal after
    normalising both (``"normalized"``); with neither, the response is wrong and ``pred`` is
    ``INVALID_PRED``.

    ``strict_box_verify=True``: only the boxed answer in the final 100 characters counts and it
    must equal the raw ground truth exactly (no normalisation), as in verl.
    """
    window = solution[-SOLUTION_WINDOW:]
    if strict_box_verify:
        boxed = last_boxed_content(window[-BOXED_WINDOW:])
        if boxed is None:
            return _result(False, INVALID_PRED)
        return _result(boxed == ground_truth, boxed)

    target = normalize_final_answer(ground_truth)
    answers = _ANSWER_LINE.findall(window)
    if answers:
        pred = normalize_final_answer(answers[-1])
        return _result(pred == target, pred)

    boxed = last_boxed_content(window[-BOXED_WINDOW:])
    if boxed is None:
        return _result(False, INVALID_PRED)
    if boxed_match == "exact":
        return _result(boxed == ground_truth, boxed)
    if boxed_match != "normalized":
        raise ValueError(f"boxed_match must be 'exact' or 'normalized', got {boxed_match!r}")
    pred = normalize_final_answer(boxed)
    return _result(pred == target, pred)


def overlong_penalty(
    response_length: int,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> float:
    """DAPO soft overlong punishment, added by the caller to the +1/-1 correctness score.

    With ``start = max_response_length - buffer_length``: 0 for ``length <= start``;
    ``(start - length) / buffer_length * penalty_factor`` for ``start < length < max``
    (linear, reaching -penalty_factor at ``max``); ``-penalty_factor`` at or beyond ``max``.
    """
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}], "
            f"got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if response_length < 0:
        raise ValueError(f"response_length must be >= 0, got {response_length}")

    start = max_response_length - buffer_length
    if response_length <= start:
        return 0.0
    if response_length >= max_response_length:
        return -float(penalty_factor)
    return (start - response_length) / buffer_length * penalty_factor


# ------------------------------------------------------------------------------ user reward functions
ScoreFn = Callable[[str, str, str, dict], RewardResult]


def builtin_score(data_source: str, solution: str, ground_truth: str, extra_info: dict, *,
                  boxed_match: str = "exact") -> RewardResult:
    """The default scorer: :func:`dapo_math_score` (the data source does not matter)."""
    return dapo_math_score(solution, ground_truth, boxed_match=boxed_match)


def load_score_fn(spec: str | None, boxed_match: str = "exact") -> ScoreFn:
    """``reward.function`` ('path/file.py:name' or 'package.module:name', verl's
    custom_reward_function) as a scorer returning :class:`RewardResult`; None = :func:`builtin_score`
    with ``boxed_match``. Raises ValueError naming the spec when the file, module or function cannot be
    loaded."""
    if spec is None:
        return functools.partial(builtin_score, boxed_match=boxed_match)
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            loader = importlib.util.spec_from_file_location(f"async_dapo_user_reward_{abs(hash(target))}", target)
            if loader is None or loader.loader is None:
                raise FileNotFoundError(target)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
    except Exception as exc:
        raise ValueError(f"reward.function: cannot load {spec!r}: {type(exc).__name__}: {exc}") from None
    return functools.partial(_call_user_fn, fn)


def _call_user_fn(fn, data_source: str, solution: str, ground_truth: str, extra_info: dict) -> RewardResult:
    out = fn(data_source, solution, ground_truth, extra_info)
    if isinstance(out, dict):
        score = float(out["score"])
        return RewardResult(score=score, acc=bool(out.get("acc", score > 0)), pred=str(out.get("pred", "")))
    score = float(out)
    return RewardResult(score=score, acc=score > 0, pred="")
