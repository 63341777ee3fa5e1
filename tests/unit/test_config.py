"""Config tree: defaults, YAML + overrides, one-line errors naming the key."""

import subprocess
import sys

import pytest
import yaml

from async_dapo.config import Config, ConfigError, dump_config, load_config
from tests.conftest import CPU_CONFIG


def test_tiny_cpu_yaml_loads_and_overrides_apply():
    cfg = load_config(CPU_CONFIG, ["rollout.n=4", "algorithm.clip_c=null", "replay.max_staleness=0"])
    assert cfg.rollout.n == 4
    assert cfg.algorithm.clip_c is None
    assert cfg.replay.max_staleness == 0
    assert cfg.algorithm.clip_high == 0.28  # from the file


@pytest.mark.parametrize(
    "override, expected",
    [
        ("no.such.key=1", "no.such.key: unknown key 'no'"),
        ("rollout.engine.bogus=1", "rollout.engine.bogus: unknown key 'bogus'"),
        ("rollout.n=0", "rollout.n: Input should be greater than or equal to 1"),
        ("algorithm.loss_agg_mode=mean", "algorithm.loss_agg_mode: Input should be"),
        ("rollout.n.x=1", "rollout.n.x: 'n' is a value, not a section"),
        ("rollout.n", "rollout.n: override must look like section.key=value"),
    ],
)
def test_bad_override_names_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(CPU_CONFIG, [override])
    msg = str(err.value)
    assert msg.startswith(expected), msg
    assert "\n" not in msg


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("learner:\n  lr: 0.1\n  lrr: 0.2\n")
    with pytest.raises(ConfigError, match=r"^learner\.lrr: unknown key$"):
        load_config(p)


def test_extra_args_is_a_free_dict():
    cfg = load_config(None, ["rollout.engine.extra_args.chunked_prefill_size=512"])
    assert cfg.rollout.engine.extra_args == {"chunked_prefill_size": 512}


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(CPU_CONFIG, ["learner.lr=3e-5"])
    dump_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(tmp_path / "run" / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["learner"]["lr"] == 3e-5


def test_every_field_is_documented():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            sub = [a for a in (getattr(ann, "__args__", None) or (ann,)) if hasattr(a, "model_fields")]
            if sub:
                yield from walk(sub[0], f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field.description

    undocumented = [k for k, d in walk(Config) if not d]
    assert undocumented == []


def test_cli_exits_nonzero_naming_the_key():
    proc = subprocess.run(
        [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(CPU_CONFIG),
         "--set", "no.such.key=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no.such.key: unknown key")


SHIPPED = ["tiny_cpu.yaml", "dapo_qwen2.5_32b_16x8.yaml", "dapo_qwen2.5_32b_16x8_async.yaml", "qwen2.5_7b_1x8.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name):
    cfg = load_config(CPU_CONFIG.parent / name)
    gpus = (cfg.placement.num_engines * cfg.placement.engine_gpus
            + cfg.placement.learner_ranks * cfg.placement.learner_gpus)
    if name.startswith("qwen2.5_7b"):
        assert gpus == 8
    if cfg.placement.engine_gpus:
        assert cfg.placement.engine_gpus == cfg.rollout.engine.tp_size


@pytest.mark.parametrize("name", ["dapo_qwen2.5_32b_16x8.yaml", "dapo_qwen2.5_32b_16x8_async.yaml"])
def test_32b_configs_hold_every_hyper_parameter_of_the_papers_recipe(name):
    """anchors.md section 1 and verl-recipe dapo/run_dapo_qwen2.5_32b.sh, key by key."""
    cfg = load_config(CPU_CONFIG.parent / name)
    a, lc, r, rw, lg = cfg.algorithm, cfg.learner, cfg.rollout, cfg.reward, cfg.logging
    assert (a.train_batch_groups, r.n, lc.mini_batch_groups, lc.epochs) == (512, 16, 32, 1)
    assert (lc.lr, lc.warmup_steps, lc.weight_decay, lc.grad_clip, lc.betas) == (1e-6, 10, 0.1, 1.0, (0.9, 0.999))
    assert (a.clip_low, a.clip_high, a.clip_c, a.loss_agg_mode, a.scale_adv_by_std) == \
        (0.2, 0.28, 10.0, "token-mean", True)
    assert (a.dynamic_sampling.enable, a.dynamic_sampling.max_gen_rounds, a.overlong_filtering) == (True, 10, False)
    assert (cfg.data.max_prompt_length, cfg.data.truncation, r.max_response_length) == (2048, "left", 20480)
    assert (rw.overlong_buffer_enable, rw.overlong_buffer_length, rw.overlong_penalty_factor, rw.function) == \
        (True, 4096, 1.0, None)  # the built-in math_dapo reward
    assert (r.temperature, r.top_p, r.top_k) == (1.0, 1.0, -1)
    assert (lg.val_temperature, lg.val_top_p, lg.val_n, lg.val_prompts, lg.val_before_train) == (1.0, 0.7, 32, 30, True)
    assert (lg.val_every_steps, cfg.checkpoint.every_steps) == (5, 25)  # test_freq, save_freq
    assert cfg.placement.nnodes == 16 and cfg.logging.run_dir.is_absolute()
    assert cfg.placement.num_engines * cfg.placement.engine_gpus + cfg.placement.learner_ranks == 128
    assert (cfg.rollout.engine.tp_size, cfg.learner.param_dtype) == (4, "bfloat16")


def test_the_32b_recipe_is_synchronous_and_its_async_sibling_lists_every_difference():
    sync = load_config(CPU_CONFIG.parent / "dapo_qwen2.5_32b_16x8.yaml")
    assert (sync.replay.max_staleness, sync.algorithm.correction.mode) == (0, "none")

    def flat(tree, prefix=""):
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return out

    path = CPU_CONFIG.parent / "dapo_qwen2.5_32b_16x8_async.yaml"
    a, b = flat(sync.model_dump(mode="json")), flat(load_config(path).model_dump(mode="json"))
    differ = {k for k in a if a[k] != b[k]}
    assert differ == {"replay.max_staleness", "algorithm.correction.mode", "rollout.update_mode",
                      "rollout.max_inflight_prompts"}
    header = path.read_text().split("\nmodel:")[0]
    for key in differ:
        assert f"#   {key}: {b[key]}" in header, key  # the header names the key and its value


def test_aime_shaped_validation_file_gives_all_30_problems(tmp_path):
    """verl's AIME-2024 parquet repeats each of its 30 problems 32 times: with val_prompts = 30 the run must
    validate all 30 distinct problems (deduplicated at load, then n = val_n samples each), not the first 30
    rows (one problem)."""
    from async_dapo.data.rows import synthetic_rows, val_rows, write_rows

    problems = synthetic_rows("val", 30, levels=[3], heldout_fraction=0.5, seed=0)
    path = tmp_path / "aime.parquet"
    write_rows([p for p in problems for _ in range(32)], path)
    cfg = load_config(CPU_CONFIG.parent / "dapo_qwen2.5_32b_16x8.yaml", [f"data.val={path}"])
    assert val_rows(cfg) == problems


# ----------------------------------------------------------------------------- cross-field rules
# One case per rule, at its boundary: tests/unit/test_config_rules.py. Here: how the CLI reports one.
def test_cross_rule_message_through_cli_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "async_dapo.cli", "train", "--config", str(CPU_CONFIG),
         "--set", "replay.capacity_groups=100"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: replay.capacity_groups (100) must be >= (replay.max_staleness + 1) * "
        "algorithm.train_batch_groups = (2 + 1) * 64 = 192"
    )


# ------------------------------------------------------------------------ new fields: default + bound
NEW_FIELDS = [  # dotted key, default, a rejected value, the start of its one-line message
    ("data.truncation", "error", "right", "data.truncation: Input should be 'error' or 'left'"),
    ("rollout.request_timeout_s", 600, 0, "rollout.request_timeout_s: Input should be greater than 0"),
    ("rollout.max_abort_retries", 3, -1, "rollout.max_abort_retries: Input should be greater than or equal to 0"),
    ("rollout.drain_timeout_s", 300, 0, "rollout.drain_timeout_s: Input should be greater than 0"),
    ("rollout.temperature", 1.0, 0, "rollout.temperature: Input should be greater than 0"),
    ("replay.ticket_ttl_s", 1800, 0, "replay.ticket_ttl_s: Input should be greater than 0"),
    ("replay.silence_timeout_s", 900, -1, "replay.silence_timeout_s: Input should be greater than 0"),
    ("placement.start_timeout_s", 900, 0, "placement.start_timeout_s: Input should be greater than 0"),
    ("placement.call_timeout_s", 1800, 0, "placement.call_timeout_s: Input should be greater than 0"),
    ("placement.health_check_interval_s", 10, 0,
     "placement.health_check_interval_s: Input should be greater than 0"),
    ("placement.health_check_timeout_s", 30, 0, "placement.health_check_timeout_s: Input should be greater than 0"),
    ("placement.max_engine_restarts", 3, -1,
     "placement.max_engine_restarts: Input should be greater than or equal to 0"),
    ("learner.collective_timeout_s", 600, 0, "learner.collective_timeout_s: Input should be greater than 0"),
    ("logging.val_timeout_s", 1800, 0, "logging.val_timeout_s: Input should be greater than 0"),
]


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("key, default, bad, expected", NEW_FIELDS, ids=[f[0] for f in NEW_FIELDS])
def test_new_field_default_and_bound(key, default, bad, expected):
    value = _get(load_config(None), key)
    assert value == default and type(value) is type(default), (key, value)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={bad}"])
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)


def test_truncation_left_and_fractional_temperature_load():
    cfg = load_config(None, ["data.truncation=left", "rollout.temperature=0.01", "placement.max_engine_restarts=0",
                             "rollout.max_abort_retries=0"])
    assert cfg.data.truncation == "left" and cfg.rollout.temperature == 0.01
    assert cfg.placement.max_engine_restarts == 0 and cfg.rollout.max_abort_retries == 0


def test_checkpoint_every_steps_may_be_zero():
    assert load_config(None, ["checkpoint.every_steps=0"]).checkpoint.every_steps == 0


def _yaml_leaves(tree, prefix=""):
    """(dotted key, value) of every leaf of a parsed YAML mapping."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _yaml_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize("path", sorted(CPU_CONFIG.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_in_configs_loads(path, tmp_path):
    cfg = load_config(path)
    # Every value the file sets is the value the run gets (nothing dropped, renamed or reset by a validator) ...
    dumped = cfg.model_dump(mode="json")
    leaves = list(_yaml_leaves(yaml.safe_load(path.read_text())))
    assert leaves, path  # an empty file would check nothing below
    for key, value in leaves:
        got = dumped
        for part in key.split("."):
            got = got[part]
        if isinstance(got, float) and not isinstance(value, bool):
            value = float(value)  # YAML reads "1e-4" as a string and "1" as an int; the field is a float
        assert got == value, (key, got, value)
    # ... and the resolved config written out (what a run records) loads back to the same config.
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg
