"""Checks that need more than the config itself (the tokenizer, the user's files), run by the orchestrator
before anything is placed: a bad prompt file or reward function costs seconds, not a cluster start.
Each raises one error naming the field, file and row."""

from __future__ import annotations

from async_dapo.config import Config, ConfigError
from async_dapo.data.rows import fit_prompt_lengths, prompt_key, source_name, train_rows, val_rows


def check_reward_function(cfg: Config) -> None:
    """``reward.function`` must load here as it will in every rollout actor."""
    from async_dapo.data.reward import load_score_fn

    try:
        load_score_fn(cfg.reward)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_prompts(cfg: Config) -> None:
    """Every train and val row is loaded and validated here, in every ``data.truncation`` mode (a bad row
    or an empty file is DatasetError naming the file and row, before anything is placed); with
    ``truncation: error`` every prompt (chat template applied) must also fit ``data.max_prompt_length``. With
    ``left`` the rollout actors keep each long prompt's last max_prompt_length tokens: no length to check."""
    splits = (("train", train_rows(cfg)), ("val", val_rows(cfg)))
    if cfg.data.truncation != "error":
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    for split, rows in splits:
        lengths = _prompt_lengths(tokenizer, rows)
        fit_prompt_lengths(rows, lengths, max_len=cfg.data.max_prompt_length, truncation="error",
                           source=source_name(cfg, split))


def _prompt_lengths(tokenizer, rows) -> list[int]:
    """Token count of each row's prompt (chat template applied), each distinct prompt tokenized once: the
    synthetic training set cycles ~1,400 problems through 20,000 rows."""
    from async_dapo.data.rows import encode_prompt

    known: dict[tuple, int] = {}
    lengths = []
    for row in rows:
        key = prompt_key(row)
        if key not in known:
            known[key] = len(encode_prompt(tokenizer, row))
        lengths.append(known[key])
    return lengths
