"""Checks that need more than the config itself (the tokenizer, the user's files), run by the orchestrator
before anything is placed: a bad prompt file or reward function costs seconds, not a cluster start.
Each raises one error naming the field, file and row."""

from __future__ import annotations

from async_dapo.config import Config, ConfigError
from async_dapo.data import fit_prompt_lengths, source_name, train_rows, val_rows


def check_reward_function(cfg: Config) -> None:
    """``reward.custom_function`` must load here as it will in every rollout actor."""
    from async_dapo.reward import load_score_fn

    try:
        load_score_fn(cfg.reward.custom_function)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_prompts(cfg: Config) -> None:
    """``data.max_prompt_length`` with ``data.truncation: error``: every train and val prompt (chat template
    applied) must fit, else DatasetError naming the file and row. With ``left`` the rollout actors keep
    each long prompt's last max_prompt_length tokens, so there is nothing to check."""
    if cfg.data.truncation != "error":
        return
    from transformers import AutoTokenizer

    from async_dapo.bootstrap import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    for split, rows in (("train", train_rows(cfg)), ("val", val_rows(cfg))):
        lengths = [len(encode_prompt(tokenizer, row)) for row in rows]
        fit_prompt_lengths(rows, lengths, max_len=cfg.data.max_prompt_length, truncation="error",
                           source=source_name(cfg, split))
