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
    avg_at_k: float  # mean accuracy over all k samples of all prompts
    pass_at_k: float  # fraction of prompts with at least one correct sample
    maj_at_k: float  # fraction of prompts whose most frequent extracted answer is correct
    k: int
    prompts: int
    gen_tokens: int
    seconds: float


def score_groups(texts: list[list[str]], truths: list[str]) -> tuple[float, float, float]:
    """(avg@k, pass@k, maj@k) of k completions per prompt. Majority voting is over the extracted
    answers; ties go to the answer seen first."""
    accs, passes, majs = [], [], []
    for group, truth in zip(texts, truths):
        results = [dapo_math_score(t, truth) for t in group]
        accs += [r.acc for r in results]
        passes.append(any(r.acc for r in results))
        votes = Counter(r.pred for r in results if r.pred != INVALID_PRED)
        top = votes.most_common(1)[0][0] if votes else None
        majs.append(any(r.acc for r in results if r.pred == top) if top is not None else False)
    return sum(accs) / len(accs), sum(passes) / len(passes), sum(majs) / len(majs)


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
    avg, pas, maj = score_groups(texts, [r.ground_truth for r in rows])
    tokens = sum(len(s.output_ids) for g in groups for s in g)
    return ValResult(avg, pas, maj, lg.val_n, len(rows), tokens, seconds)
