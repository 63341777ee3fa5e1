"""Rule-based math reward for DAPO and the soft overlong penalty.

Runs inside the rollout actors' reward worker processes, so it is pure Python + ``re`` (no torch
import) and every scorer :func:`load_score_fn` returns is picklable.

``dapo_math_score`` reproduces verl's ``math_dapo.compute_score`` (verl/utils/reward_score/math_dapo.py)
in its two modes, named as verl names them:

* default (``reward.strict_box_verify: false``): only the last 300 characters of the response are
  read; the LAST "Answer: ..." line (case-insensitive) is normalised and compared, as a string, with
  the normalised ground truth. A response without an Answer line is wrong (score -1, pred
  ``"[INVALID]"``): verl has NO boxed fallback.
* ``strict_box_verify``: only the last ``\\boxed{...}`` in the last 100 characters counts, compared
  character for character with the raw ground truth.

One extra, off by default and not in verl: ``reward.boxed_fallback`` ("exact" / "normalized") scores
a response that has no Answer line by its last ``\\boxed{}`` in the last 100 characters instead of -1.
The remaining differences from verl are listed in docs/algorithm.md.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the annotation: the reward workers need not import pydantic
    from async_dapo.config import RewardConfig

__all__ = [
    "BOXED_FALLBACKS",
    "INVALID_PRED",
    "RewardResult",
    "UserScoreFn",
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
# reward.boxed_fallback: "off" is verl (no fallback); the other two are an explicit extra.
BOXED_FALLBACKS = ("off", "exact", "normalized")

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
    """Outcome of scoring one response: ``score`` is +1.0/-1.0 (a user function may return any
    float), ``acc`` the correctness flag (what dynamic sampling filters on with its default
    ``metric: acc``), ``pred`` the normalised extracted answer (raw in strict-box mode), or
    ``INVALID_PRED`` when none was found."""

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
    solution: str, ground_truth: str, *, strict_box_verify: bool = False, boxed_fallback: str = "off"
) -> RewardResult:
    """Score a response against its ground truth with verl's ``math_dapo`` rules.

    Default mode (verl's): take the last 300 characters; if they contain an "Answer:" line, the
    last one decides (normalised string equality with the normalised ground truth); with no Answer
    line the response is wrong and ``pred`` is ``INVALID_PRED``, as in verl.

    ``strict_box_verify=True`` (verl's other mode): only the last ``\\boxed{}`` in the final 100
    characters counts and its content must equal the raw ground truth exactly (no normalisation:
    ``\\boxed{ 3 }`` is not ``3``); no box, or an unbalanced last box, is wrong with ``INVALID_PRED``.
    Answer lines are ignored.

    ``boxed_fallback`` (an extra, NOT verl; only in the default mode, ignored under
    ``strict_box_verify``): "off" = verl. "exact" / "normalized": a response with NO Answer line is
    scored by its last ``\\boxed{}`` in the final 100 of the 300 characters, equal to the raw ground
    truth ("exact", verl's strict-box comparison) or equal after normalising both ("normalized").
    An Answer line, even an empty one, always decides first.
    """
    if boxed_fallback not in BOXED_FALLBACKS:
        raise ValueError(f"boxed_fallback must be one of {BOXED_FALLBACKS}, got {boxed_fallback!r}")
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
    if boxed_fallback == "off":
        return _result(False, INVALID_PRED)

    boxed = last_boxed_content(window[-BOXED_WINDOW:])
    if boxed is None:
        return _result(False, INVALID_PRED)
    if boxed_fallback == "exact":
        return _result(boxed == ground_truth, boxed)
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


def walk_score(solution: str, ground_truth: str) -> RewardResult:
    """The walk task's rule (async_dapo.data.rows.walk_rows): correct iff the response's whitespace-separated
    words are exactly the ground truth's syllables. The whole sequence is checked, not a final answer, so a
    response cannot be right without being as long as the prompt asks."""
    words = solution.split()
    return _result(words == ground_truth.split(), words[-1] if words else INVALID_PRED)


def builtin_score(data_source: str, solution: str, ground_truth: str, extra_info: dict, *,
                  strict_box_verify: bool = False, boxed_fallback: str = "off") -> RewardResult:
    """The default scorer, chosen by data source as verl's ``default_compute_score`` does: the built-in walk
    task's :func:`walk_score`, else :func:`dapo_math_score` (verl's ``math_dapo`` in its Answer-line mode
    with the defaults)."""
    from async_dapo.data.rows import WALK_SOURCE

    if data_source == WALK_SOURCE:
        return walk_score(solution, ground_truth)
    return dapo_math_score(solution, ground_truth, strict_box_verify=strict_box_verify,
                           boxed_fallback=boxed_fallback)


def load_score_fn(reward: RewardConfig) -> ScoreFn:
    """The run's scorer, from the whole ``reward`` section: ``reward.function`` ('path/file.py:name' or
    'package.module:name', verl's custom_reward_function) when set, else :func:`builtin_score` with
    ``reward.strict_box_verify`` and ``reward.boxed_fallback`` (those two only shape the built-in reward).

    The result is picklable, so it can be sent to a reward worker process: the built-in one is a
    ``functools.partial`` of a module-level function and plain values; a user function is a
    :class:`UserScoreFn` that pickles as its spec and loads the function again in the receiving process
    (a file path is made absolute here first, so a worker with another working directory finds it).
    Raises ValueError naming the spec when the file, module or function cannot be loaded here."""
    if reward.function is None:
        return functools.partial(builtin_score, strict_box_verify=bool(reward.strict_box_verify),
                                 boxed_fallback=str(reward.boxed_fallback))
    return UserScoreFn(reward.function)


class UserScoreFn:
    """``reward.function`` as a picklable scorer: holds the spec, loads the function on construction (so a
    bad spec fails where the config is checked) and again, lazily, after unpickling in another process.
    Calls return :class:`RewardResult` (a float score means acc = score > 0, verl's dict keys 'score',
    'acc', 'pred' are read when present)."""

    def __init__(self, spec: str) -> None:
        target, sep, name = spec.rpartition(":")
        self.spec = f"{os.path.abspath(target)}:{name}" if sep and target.endswith(".py") else spec
        self._fn: Callable | None = _load_user_fn(self.spec, shown=spec)

    def __getstate__(self) -> dict:
        return {"spec": self.spec}  # the function object itself may not pickle (a file-loaded module)

    def __setstate__(self, state: dict) -> None:
        self.spec, self._fn = state["spec"], None

    def __repr__(self) -> str:
        return f"UserScoreFn({self.spec!r})"

    def __call__(self, data_source: str, solution: str, ground_truth: str, extra_info: dict) -> RewardResult:
        if self._fn is None:
            self._fn = _load_user_fn(self.spec)
        return _call_user_fn(self._fn, data_source, solution, ground_truth, extra_info)


def _load_user_fn(spec: str, shown: str | None = None) -> Callable:
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            module_name = f"async_dapo_user_reward_{hashlib.sha1(target.encode()).hexdigest()[:12]}"
            loader = importlib.util.spec_from_file_location(module_name, target)
            if loader is None or loader.loader is None:
                raise FileNotFoundError(target)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        fn = getattr(module, name)
        if not callable(fn):
            raise TypeError(f"{name} is a {type(fn).__name__}, not a function")
    except Exception as exc:
        raise ValueError(f"reward.function: cannot load {shown or spec!r}: {type(exc).__name__}: {exc}") from None
    return fn


def _call_user_fn(fn, data_source: str, solution: str, ground_truth: str, extra_info: dict) -> RewardResult:
    out = fn(data_source, solution, ground_truth, extra_info)
    if isinstance(out, RewardResult):
        return out
    if isinstance(out, dict):
        score = float(out["score"])
        return RewardResult(score=score, acc=bool(out.get("acc", score > 0)), pred=str(out.get("pred", "")))
    score = float(out)
    return RewardResult(score=score, acc=score > 0, pred="")
