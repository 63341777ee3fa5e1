"""The config reference, generated from the schema (async_dapo.config): every section and field with its
type and range, default, unit, what it does, and the load-time rules that name it. ``async-dapo
config-reference`` prints it; docs/config.md is that output, and a test keeps the two equal, so the reference
cannot go stale.
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from typing import Any, get_args

from pydantic import BaseModel

from async_dapo.config import CROSS_FIELD_RULES, Config

# A field's unit, from its name's suffix (the schema's naming convention; descriptions say the rest).
UNITS = (("_s", "seconds"), ("_bytes", "bytes"), ("_mb", "MiB"), ("_steps", "steps"), ("_tokens", "tokens"),
         ("_length", "tokens"), ("_groups", "groups"), ("_prompts", "prompts"), ("_cpus", "CPUs"),
         ("_gpus", "GPUs"))
_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
_KEY = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")

HEADER = """# Config reference

Generated from the schema (`async_dapo/config/`) by `async-dapo config-reference > docs/config.md`; a test
keeps this file equal to that output. A run's config is a YAML file of these sections (`configs/` has
examples); `--set section.field=value` overrides one key, and `async-dapo train --config FILE --print-config`
prints the resolved config of a run without starting it. An unknown key or a value out of range stops the
command at once, naming the key. The rules at the end are checked when a config loads, in that order; the
first broken one is reported.
"""


def sub_model(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (also inside ``X | None``), or None for a plain value."""
    for a in get_args(annotation) or (annotation,):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def sections(model: type[BaseModel] = Config, prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted name, class) of every section, depth first in the schema's order."""
    for name, field in model.model_fields.items():
        sub = sub_model(field.annotation)
        if sub is not None:
            yield prefix + name, sub
            yield from sections(sub, f"{prefix}{name}.")


def keys() -> set[str]:
    """Every dotted key of the schema (fields and sections)."""
    found = set()
    for section, model in [("", Config), *sections()]:
        found |= {f"{section}.{n}" if section else n for n in model.model_fields}
    return found


def rules_by_key() -> dict[str, list[str]]:
    """The names of the cross-field rules whose source names each dotted key."""
    known, found = keys(), {}
    for rule in CROSS_FIELD_RULES:
        for key in sorted(set(_KEY.findall(inspect.getsource(rule))) & known):
            found.setdefault(key, []).append(rule_name(rule))
    return found


def rule_name(rule) -> str:
    return rule.__name__.removeprefix("rule_")


def type_text(field) -> str:
    """The field's type and its bounds, e.g. ``float > 0, ≤ 1`` or ``"cpu" | "cuda"``."""
    text = re.sub(r"<class '([^']+)'>", r"\1", str(field.annotation))
    text = re.sub(r"typing\.|pathlib\.", "", text)
    text = re.sub(r"Literal\[([^]]*)\]", lambda m: " | ".join(m.group(1).replace("'", '"').split(", ")), text)
    optional = text.endswith(" | None")
    bounds = [f"{_BOUNDS[k]} {getattr(m, k)}" for m in field.metadata for k in _BOUNDS if hasattr(m, k)]
    return text.removesuffix(" | None") + (" " + ", ".join(bounds) if bounds else "") + (", or null" if optional else "")


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field.default}`" if field.default is not None else "`null`"


def unit(name: str) -> str:
    return next((u for suffix, u in UNITS if name.endswith(suffix)), "")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _prose(doc: str | None) -> str:
    """A docstring as one Markdown paragraph (reST ``literals`` as Markdown ones)."""
    return " ".join((doc or "").split()).replace("``", "`")


def section_checks(model: type[BaseModel]) -> list[str]:
    """The section's own load-time checks (its validators), one line each."""
    decorators = model.__pydantic_decorators__
    found = [*decorators.model_validators.values(), *decorators.field_validators.values()]
    return [f"- {_prose(d.func.__doc__)}" for d in found if d.func.__doc__]


def section_table(section: str, model: type[BaseModel], rules: dict[str, list[str]]) -> list[str]:
    checks = section_checks(model)
    lines = [f"## `{section}`", "", _prose(model.__doc__), "", *(["Checked on load:", "", *checks, ""] if checks else []),
             "| field | type | default | unit | what it does | rules |", "|---|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if sub_model(field.annotation) is not None and field.default_factory is not None:
            what, kind = f"section: see `{section}.{name}`", "section"
        else:
            what, kind = field.description or "", type_text(field)
        named = ", ".join(f"[{r}](#rule-{r.replace('_', '-')})" for r in rules.get(f"{section}.{name}", []))
        lines.append(f"| `{name}` | {_cell(kind)} | {_cell(default_text(field))} | {unit(name)} | {_cell(what)} "
                     f"| {named} |")
    return [*lines, ""]


def rules_text() -> list[str]:
    lines = ["## Rules checked when a config loads", ""]
    for rule in CROSS_FIELD_RULES:
        lines += [f"### rule: {rule_name(rule)}", "", _prose(rule.__doc__), ""]
    return lines


def reference() -> str:
    """docs/config.md's text."""
    rules = rules_by_key()
    lines = [HEADER]
    for section, model in sections():
        lines += section_table(section, model, rules)
    return "\n".join(lines + rules_text()).rstrip() + "\n"
