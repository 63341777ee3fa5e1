"""The config reference is generated from the schema and kept in sync: docs/config.md equals what
``async-dapo config-reference`` prints, and every field, bound, default, unit and rule shows in it.
``async-dapo train --print-config`` prints a config that loads back to the same run."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from async_dapo.config import reference as config_reference
from async_dapo.cli import main
from async_dapo.config import CROSS_FIELD_RULES, Config, load_config
from async_dapo.config.reference import keys, reference, sections

REPO = Path(__file__).resolve().parents[2]


def _row(text: str, section: str, field: str) -> list[str]:
    """The cells of ``field``'s row in ``section``'s table."""
    part = text.split(f"## `{section}`\n", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in part.splitlines() if ln.startswith(f"| `{field}` |"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_docs_config_md_is_the_generated_reference():
    assert (REPO / "docs" / "config.md").read_text() == reference(), (
        "docs/config.md is stale: run `async-dapo config-reference > docs/config.md`")


def test_every_field_of_every_section_has_a_row():
    text = reference()
    for section, model in sections():
        for name in model.model_fields:
            assert _row(text, section, name)[0] == f"`{name}`"
    rows = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert len(rows) == sum(len(m.model_fields) for _, m in sections())
    assert {"placement.health_check_timeout_s", "rollout.engine", "rollout.engine.tp_size"} <= keys()


def test_rows_give_type_bounds_default_unit_and_rules():
    text = reference()
    assert _row(text, "placement", "health_check_timeout_s")[1:4] == ["float > 0", "`30`", "seconds"]
    staleness = _row(text, "replay", "max_staleness")
    assert staleness[1:4] == ["int ≥ 0, ≤ 1000", "`1`", ""]
    assert "[weight_sync_within_staleness](#rule-weight-sync-within-staleness)" in staleness[5]
    assert "[capacity_holds_staleness_window](#rule-capacity-holds-staleness-window)" in staleness[5]
    assert _row(text, "model.bootstrap", "sft_target_accuracy")[1:3] == ["float > 0, ≤ 1, or null", "`null`"]
    assert _row(text, "rollout", "engine")[1:5] == ["section", "(section)", "", "section: see `rollout.engine`"]
    assert "### rule: hung_engine_replaced_before_silence" in text


def test_every_rule_and_section_check_says_what_it_checks():
    undocumented = [r.__name__ for r in CROSS_FIELD_RULES if not (r.__doc__ or "").strip()]
    for _, model in [("", Config), *sections()]:
        decorators = model.__pydantic_decorators__
        undocumented += [f"{model.__name__}.{name}" for name, d in
                         {**decorators.model_validators, **decorators.field_validators}.items()
                         if not (d.func.__doc__ or "").strip()]
    assert not undocumented, f"the reference cannot state these (no docstring): {undocumented}"


def test_the_command_prints_the_reference(capsys):
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == reference()


def test_print_config_prints_a_config_that_loads_back_to_the_same_run(capsys, tmp_path):
    cfg_file = REPO / "configs" / "tiny_cpu.yaml"
    sets = ["learner.total_steps=3", "placement.health_check_timeout_s=12", f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["train", "--config", str(cfg_file), *[a for s in sets for a in ("--set", s)], "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "resolved.yaml").write_text(printed)
    assert load_config(tmp_path / "resolved.yaml") == load_config(cfg_file, sets)
    assert "health_check_timeout_s: 12.0" in printed and not (tmp_path / "run").exists()  # nothing ran


@pytest.mark.parametrize("name, unit", [("request_timeout_s", "seconds"), ("max_message_bytes", "bytes"),
                                        ("bucket_mb", "MiB"), ("total_steps", "steps"), ("seed", "")])
def test_units_come_from_the_name_suffix(name, unit):
    assert config_reference.unit(name) == unit


def test_sub_model_finds_a_section_also_when_optional():
    class S(BaseModel):
        x: int = 0

    assert config_reference.sub_model(S | None) is S and config_reference.sub_model(int | None) is None
