"""Validation: k samples per held-out prompt through an SGLang engine -> avg@k, pass@k, maj@k."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from async_dapo.config import Config
from async_dapo.data import PromptRow, val_rows
from async_dapo.reward import INVALID_PRED, dapo_math_score


@dataclass(frozen=True)
class ValResult:
    # val/avg_at_k: mean accuracy over all k samples of all prompts; val/pass_at_k: fraction of prompts
    # with at least one correct sample; val/maj_at_k: fraction whose most frequent extracted answer is
    # correct; val/avg_at_k/<subset>: avg@k per level or data source.
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


def val_metrics(texts: list[list[str]], rows: list[PromptRow]) -> dict[str, float]:
    """``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` over all rows, plus ``val/avg_at_k/<subset>``
    per subset (see :func:`subset_of`) when there is more than one, so a run shows which level moved."""
    scores = prompt_scores(texts, [r.ground_truth for r in rows])
    names = ("avg_at_k", "pass_at_k", "maj_at_k")
    out = {f"val/{name}": sum(col) / len(col) for name, col in zip(names, zip(*scores))}
    subsets: dict[str, list[float]] = {}
    for row, (acc, _, _) in zip(rows, scores):
        subsets.setdefault(subset_of(row), []).append(acc)
    if len(subsets) > 1:
        out.update({f"val/avg_at_k/{name}": sum(v) / len(v) for name, v in sorted(subsets.items())})
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
