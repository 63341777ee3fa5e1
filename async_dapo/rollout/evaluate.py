"""Validation metrics: k samples per distinct held-out prompt, drawn by the rollout actors' one sampling
path (``rollout.EngineSession.validate``, rows spread over every engine) -> avg@k, pass@k, maj@k (levels weighted
equally when the rows have levels, see :func:`val_metrics`)."""

from __future__ import annotations

from collections import Counter

from async_dapo.data.rows import PromptRow, prompt_key
from async_dapo.data.reward import INVALID_PRED, RewardResult


def subset_of(row: PromptRow) -> str:
    """The validation subset a prompt is reported under: its difficulty level when the dataset has one
    (``extra_info.level``, as the synthetic task does), else its ``data_source`` (verl's breakdown)."""
    level = row.extra_info.get("level")
    return f"L{level}" if level is not None else row.data_source


def result_scores(results: list[list[RewardResult]]) -> list[tuple[float, float, float]]:
    """Per prompt, from its k scored samples (the rollout actors score them in reward worker processes):
    (accuracy over its k samples, any sample correct, majority answer correct). Majority voting is over the
    extracted answers (``pred``); ties go to the answer seen first; a scorer that reports no ``pred`` gives
    no majority."""
    out = []
    for group in results:
        votes = Counter(r.pred for r in group if r.pred and r.pred != INVALID_PRED)
        top = votes.most_common(1)[0][0] if votes else None
        maj = any(r.acc for r in group if r.pred == top) if top is not None else False
        out.append((sum(r.acc for r in group) / len(group), float(any(r.acc for r in group)), float(maj)))
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


def val_metrics(scores: list[tuple[float, float, float]], rows: list[PromptRow]) -> dict[str, float]:
    """``val/avg_at_k``, ``val/pass_at_k``, ``val/maj_at_k`` from :func:`result_scores` (one per row, in
    order): the mean over levels of the per-level means when every row carries ``extra_info.level``, else
    the mean over rows; ``val/distinct_prompts``; and ``val/avg_at_k/<subset>`` (row mean per subset, see
    :func:`subset_of`) when there is more than one subset, so a run shows which level moved."""
    names = ("avg_at_k", "pass_at_k", "maj_at_k")
    out = {f"val/{name}": value for name, value in zip(names, _aggregate(scores, rows))}
    out["val/distinct_prompts"] = float(len({prompt_key(r) for r in rows}))
    subsets: dict[str, list[float]] = {}
    for row, (acc, _, _) in zip(rows, scores):
        subsets.setdefault(subset_of(row), []).append(acc)
    if len(subsets) > 1:
        out.update({f"val/avg_at_k/{name}": _mean(v) for name, v in sorted(subsets.items())})
    return out


def val_sampling_params(cfg) -> dict:
    """The validation's SGLang sampling parameters (the paper's: T = 1.0, top_p = 0.7)."""
    lg = cfg.logging
    return {"temperature": lg.val_temperature, "top_p": lg.val_top_p,
            "max_new_tokens": cfg.rollout.max_response_length}


def split_rows(rows: list[PromptRow], parts: int) -> list[list[int]]:
    """Row indices for each of ``parts`` engines (every part-th row: levels and sources stay mixed)."""
    return [list(range(i, len(rows), parts)) for i in range(parts)]


def merge_parts(parts: list[list[int]], results: list[dict], rows: list[PromptRow]) -> dict[str, float]:
    """One validation from the engines' results (each ``EngineSession.validate``'s dict for the rows ``parts``
    gave it): the metrics over all rows, the generated tokens, and the range of policy versions sampled."""
    scores: list = [None] * len(rows)
    for idx, res in zip(parts, results):
        for i, s in zip(idx, res["scores"]):
            scores[i] = tuple(s)
    done = [r for r in results if r["scores"]]
    return {**val_metrics(scores, rows), "val/gen_tokens": float(sum(r["gen_tokens"] for r in results)),
            "val/version": float(min(r["version_min"] for r in done)),
            "val/version_max": float(max(r["version_max"] for r in done))}
