"""Validation: k samples per distinct held-out prompt through an SGLang engine -> avg@k, pass@k, maj@k
(levels weighted equally when the rows have levels, see :class:`ValResult`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from async_dapo.config import Config
from async_dapo.data import PromptRow, prompt_key, val_rows
from async_dapo.reward import INVALID_PRED, dapo_math_score


@dataclass(frozen=True)
class ValResult:
    # Per prompt: avg = accuracy over its k samples, pass = any sample correct, maj = its most frequent
    # extracted answer is correct. val/avg_at_k, val/pass_at_k, val/maj_at_k weight them as the run weights
    # its data: when every row carries extra_info.level (the synthetic task, which trains its levels
    # uniformly) the mean over levels of the per-level means, each level in the rows weighing 1/(number of
    # levels); otherwise the plain mean over rows (verl's convention for a file). val/avg_at_k/<subset>: the
    # row mean of avg per level or data source. val/distinct_prompts: how many distinct prompts were validated.
    metrics: dict[str, float]
    k: int
    prompts: int
    gen_tokens: int
    seconds: float


def subset_of(row: PromptRow) -> str:
    """The validation subset a prompt is reported under: its difficulty level when the dataset has one
    (``extra_info.level``, as the synthetic task does), else its ``data_source`` (verl's breakdown)."""
    level = row.extra_info.get("level")
    return f"L{level}" if level is not None else row.data_source


def prompt_scores(texts: list[list[str]], truths: list[str]) -> list[tuple[float, float, float]]:
    """Per prompt: (accuracy over its k samples, any sample correct, majority answer correct). Majority
    voting is over the extracted answers; ties go to the answer seen first."""
    out = []
    for group, truth in zip(texts, truths):
        results = [dapo_math_score(t, truth) for t in group]
        votes = Counter(r.pred for r in results if r.pred != INVALID_PRED)
        top = votes.most_common(1)[0][0] if votes else None
        maj = any(r.acc for r in results if r.pred == top) if top is not None else False
        out.append((sum(r.acc for r in results) / len(results), float(any(r.acc for r in results)), float(maj)))
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _aggregate(scores: list[tuple[float, float, float]], rows: list[PromptRow]) -> tuple[float, float, float]:
    # The synthetic task trains its levels round-robin, so each level weighs the same here too; a row mean
    # would let the level with the most held-out problems dominate (level 2 has ~11x level 1's).
    levels = [r.extra_info.get("level") for r in rows]
    if any(lv is None for lv in levels):
        return tuple(_mean(list(col)) for col in zip(*scores))
    by_level: dict[object, list[tuple[float, float, float]]] = {}
    for lv, s in zip(levels, scores):
        by_level.setdefault(lv, []).append(s)
    per_level = [tuple(_mean(list(col)) for col in zip(*group)) for group in by_level.values()]
    return tuple(_mean(list(col)) for col in zip(*per_level))


def val_metrics(texts: list[list[str]], rows: list[PromptRow]) -> dict[str, float]:
    """``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k``: the mean over levels of the per-level means
    when every row carries ``extra_info.level``, else the mean over rows; ``val/distinct_prompts``; and
    ``val/avg_at_k/<subset>`` (row mean per subset, see :func:`subset_of`) when there is more than one
    subset, so a run shows which level moved."""
    scores = prompt_scores(texts, [r.ground_truth for r in rows])
    names = ("avg_at_k", "pass_at_k", "maj_at_k")
    out = {f"val/{name}": value for name, value in zip(names, _aggregate(scores, rows))}
    out["val/distinct_prompts"] = float(len({prompt_key(r) for r in rows}))
    subsets: dict[str, list[float]] = {}
    for row, (acc, _, _) in zip(rows, scores):
        subsets.setdefault(subset_of(row), []).append(acc)
    if len(subsets) > 1:
        out.update({f"val/avg_at_k/{name}": _mean(v) for name, v in sorted(subsets.items())})
    return out


def validate(engine, tokenizer, cfg: Config, rows: list[PromptRow] | None = None) -> ValResult:
    """Sample ``logging.val_n`` completions per held-out prompt with the validation sampling params."""
    from async_dapo.bootstrap import encode_prompt
    from async_dapo.engine import sample_groups

    rows = rows if rows is not None else val_rows(cfg)
    lg = cfg.logging
    params = {"temperature": lg.val_temperature, "top_p": lg.val_top_p,
              "max_new_tokens": cfg.rollout.max_response_length}
    t0 = time.perf_counter()
    groups = sample_groups(engine, [encode_prompt(tokenizer, r) for r in rows], lg.val_n, params)
    seconds = time.perf_counter() - t0
    texts = [[tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in g] for g in groups]
    tokens = sum(len(s.output_ids) for g in groups for s in g)
    return ValResult(val_metrics(texts, rows), lg.val_n, len(rows), tokens, seconds)
