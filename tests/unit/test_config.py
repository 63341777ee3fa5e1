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


def test_cross_field_rule_is_reported():
    with pytest.raises(ConfigError, match="mini_batch_groups must divide"):
        load_config(None, ["algorithm.train_batch_groups=10", "learner.mini_batch_groups=4"])


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


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "dapo_qwen2.5_32b_16x8.yaml", "qwen2.5_7b_1x8.yaml"])
def test_shipped_configs_validate(name):
    cfg = load_config(CPU_CONFIG.parent / name)
    gpus = (cfg.placement.num_engines * cfg.placement.engine_gpus
            + cfg.placement.learner_ranks * cfg.placement.learner_gpus)
    if name.startswith("dapo_qwen2.5_32b"):
        # The paper's recipe, numbers from anchors.md section 1.
        a, lc, r = cfg.algorithm, cfg.learner, cfg.rollout
        assert (a.train_batch_groups, r.n, lc.mini_batch_groups) == (512, 16, 32)
        assert (a.clip_low, a.clip_high, lc.lr, lc.weight_decay, lc.grad_clip) == (0.2, 0.28, 1e-6, 0.1, 1.0)
        assert (cfg.data.max_prompt_length, r.max_response_length, cfg.reward.overlong_buffer_length) == \
            (2048, 20480, 4096)
        assert cfg.logging.val_top_p == 0.7 and cfg.logging.val_n == 32 and gpus == 128
    if name.startswith("qwen2.5_7b"):
        assert gpus == 8
    if cfg.placement.engine_gpus:
        assert cfg.placement.engine_gpus == cfg.rollout.engine.tp_size
