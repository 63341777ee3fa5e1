"""``async-dapo from-verl``: a verl DAPO launch script's overrides as this project's config. The script's
shell variables expand as bash would; every key is mapped, derived or reported; the DAPO 32B recipe's
values convert to configs/dapo_qwen2.5_32b_16x8.yaml exactly, but for the fields no verl key sets
(``SET_BY_HAND``, listed in the report)."""

from pathlib import Path

import pytest

from async_dapo.cli import main
from async_dapo.config import config_from_mapping, load_config
from async_dapo.config.from_verl import SET_BY_HAND, arith, convert, parse_overrides, script_overrides

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""#!/usr/bin/env bash
set -xeuo pipefail
project_name='DAPO'   # a comment
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 20))
actor_len=$(((max_prompt_length + max_response_length) * 2))
NNODES=${NNODES:-16}
DATA_HOME=${DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${DATA_HOME}/models/Qwen2.5-32B"}
top_k=-1 # 0 for HF rollout
python3 -m recipe.dapo.main_dapo \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=$max_response_length \
    data.truncation='left' \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_len} \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.rollout.top_k="${top_k}" \
    +actor_rollout_ref.model.override_config.attention_dropout=0. \
    trainer.logger=['console','wandb'] \
    trainer.project_name="${project_name}" \
    trainer.nnodes="${NNODES}"
"""

# The DAPO paper's 32B recipe as verl's launch script gives it (values, not the script).
RECIPE_32B = """data.train_files=/data/dapo-math-17k.parquet data.val_files=/data/aime-2024.parquet data.prompt_key=prompt
data.truncation=left data.max_prompt_length=2048 data.max_response_length=20480 data.gen_batch_size=1536
data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo algorithm.kl_ctrl.kl_coef=0.0
actor_rollout_ref.actor.kl_loss_coef=0.0 actor_rollout_ref.actor.clip_ratio_low=0.2
actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0
actor_rollout_ref.actor.loss_agg_mode=token-mean algorithm.filter_groups.enable=True
algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc
actor_rollout_ref.model.path=/models/Qwen2.5-32B actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
reward_model.overlong_buffer.enable=True reward_model.overlong_buffer.len=4096
reward_model.overlong_buffer.penalty_factor=1.0 trainer.n_gpus_per_node=8 trainer.nnodes=16
trainer.val_before_train=True trainer.test_freq=5 trainer.save_freq=25 actor_rollout_ref.actor.fsdp_config.param_offload=True
trainer.default_local_dir=/shared/runs/dapo_qwen2.5_32b""".split()


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def test_the_script_expands_as_bash_would():
    found = script_overrides(SCRIPT, {"HOME": "/home/u", "DATA_HOME": "", "NNODES": "4"})
    assert found == {
        "data.max_prompt_length": "2048", "data.max_response_length": "20480", "data.truncation": "left",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "45056",  # (2048 + 20480) * 2
        "actor_rollout_ref.model.path": "/home/u/verl/models/Qwen2.5-32B",  # empty DATA_HOME: its default
        "actor_rollout_ref.rollout.top_k": "-1",
        "actor_rollout_ref.model.override_config.attention_dropout": "0.",
        "trainer.logger": "[console,wandb]", "trainer.project_name": "DAPO",
        "trainer.nnodes": "4",  # the environment's NNODES
    }
    assert arith("(7 + 1) * 3 / 2 - 10 % 4", {}) == 10


@pytest.mark.parametrize("line", ["x=$((2 +))", "x=$((2 ** 3))", "x=$((__import__('os')))", "x=$((1 + 2)"])
def test_shell_arithmetic_outside_plain_integers_is_refused(line):
    with pytest.raises(ValueError, match=r"unsupported shell arithmetic|unbalanced"):
        script_overrides(line, {})


def test_the_32b_recipe_converts_to_the_shipped_config_but_the_fields_no_verl_key_sets():
    converted = _flat(config_from_mapping(convert(parse_overrides(RECIPE_32B)).config).model_dump(mode="json"))
    shipped = _flat(load_config(REPO / "configs" / "dapo_qwen2.5_32b_16x8.yaml").model_dump(mode="json"))
    differ = {key for key in shipped if converted[key] != shipped[key]}
    assert differ == set(SET_BY_HAND), sorted(differ ^ set(SET_BY_HAND))


def test_every_key_is_mapped_or_reported_never_dropped():
    overrides = parse_overrides([*RECIPE_32B, "trainer.some_new_key=3"])
    conversion = convert(overrides)
    assert len(conversion.mapped) + len(conversion.unmapped) == len(overrides)
    assert "trainer.some_new_key=3: unknown to this converter (not mapped)" in conversion.unmapped
    assert "data.gen_batch_size=1536: admission refills what dynamic sampling drops, up to max_gen_rounds " \
           "batches' worth" in conversion.unmapped
    report = conversion.report()
    assert "placement.num_engines: 16 (half of the 128 GPUs generate, tp_size 4 each)" in report
    assert all(f"{key}: " in report for key in SET_BY_HAND)


def test_a_7b_script_with_the_other_overlong_keys_converts():
    overrides = parse_overrides(["reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                                 "reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
                                 "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                                 "reward_model.reward_kwargs.max_resp_len=8192", "data.max_response_length=8192",
                                 "data.max_prompt_length=2048",
                                 "trainer.total_training_steps=200", "trainer.nnodes=8",
                                 "trainer.default_local_dir=/shared/ckpt",
                                 "actor_rollout_ref.rollout.tensor_model_parallel_size=4"])
    cfg = config_from_mapping(convert(overrides).config)
    assert (cfg.reward.overlong_buffer_enable, cfg.reward.overlong_buffer_length) == (True, 4096)
    assert cfg.learner.total_steps == 200 and cfg.rollout.engine.context_length == 2048 + 8192
    assert (cfg.placement.num_engines, cfg.placement.learner_ranks) == (8, 32)  # 64 GPUs: 32 x tp 4, 32


def test_the_command_prints_yaml_and_names_what_does_not_load(capsys, tmp_path):
    assert main(["from-verl", *RECIPE_32B]) == 0
    out, err = capsys.readouterr()
    (tmp_path / "c.yaml").write_text(out)
    assert load_config(tmp_path / "c.yaml").algorithm.clip_high == 0.28 and "# no equivalent here:" in err
    assert main(["from-verl", "trainer.nnodes=2"]) == 2  # several nodes and no shared run_dir given
    assert "logging.run_dir (runs/tiny_cpu) must be an absolute path" in capsys.readouterr().err
    assert main(["from-verl", "algorithm.adv_estimator=gae"]) == 2
    assert "only grpo" in capsys.readouterr().err
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT.replace("trainer.nnodes=\"${NNODES}\"", "trainer.nnodes=1"))
    assert main(["from-verl", str(script)]) == 0


def test_what_the_overrides_leave_out_is_derived_from_this_projects_defaults():
    conversion = convert(parse_overrides(["actor_rollout_ref.rollout.dtype=float16"]))
    cfg = config_from_mapping(conversion.config)
    defaults = load_config()
    assert cfg.rollout.engine.dtype == "float16" and conversion.unmapped == []
    assert cfg.rollout.engine.context_length == defaults.data.max_prompt_length + defaults.rollout.max_response_length
    assert cfg.rollout.max_inflight_prompts == defaults.algorithm.train_batch_groups // cfg.placement.num_engines


def test_a_custom_reward_function_is_reward_function():
    conversion = convert(parse_overrides(["custom_reward_function.path=/rewards/math.py",
                                          "custom_reward_function.name=score"]))
    assert conversion.get("reward.function") == "/rewards/math.py:score"
    assert convert(parse_overrides(["custom_reward_function.path=/r.py"])).get("reward.function") == \
        "/r.py:compute_score"  # verl's default name
    builtin = convert(parse_overrides(["custom_reward_function.path=null", "custom_reward_function.name=compute_score"]))
    assert builtin.get("reward.function") is None and len(builtin.unmapped) == 1


@pytest.mark.parametrize("word", ["notakey", "data.x", "=3"])
def test_a_word_that_is_no_override_is_named(word):
    with pytest.raises(ValueError, match="not a key=value override"):
        parse_overrides([word])
