"""Every config field must be read somewhere: a declared-but-unread field is a knob that does nothing.

The detector walks the Config model tree to its leaf fields (dotted paths) and looks, in the package's
sources other than config.py, for a read of each leaf's name: an attribute access ``.name`` (also inside
f-strings) or a string constant ``"name"`` (getattr / dict access). It parses the sources with ``ast``
rather than grepping, so a mention in a docstring or comment (``replay.max_staleness`` in prose) does not
count as a read. A name shared by two fields (e.g. ``seed``) counts for both: the check is a floor, not a
proof. There is deliberately no allow-list.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel, Field

from async_dapo.config import Config

PACKAGE = Path(__file__).resolve().parents[2] / "async_dapo"


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, field name) of every leaf field; nested models (also ``Model | None``) are walked."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = [a for a in (getattr(ann, "__args__", None) or (ann,))
               if isinstance(a, type) and issubclass(a, BaseModel)]
        if sub:
            out += leaf_fields(sub[0], f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", name))
    return out


def names_read(sources: list[str]) -> set[str]:
    """Attribute names accessed and string constants appearing as expressions in ``sources``."""
    seen: set[str] = set()
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                seen.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                seen.add(node.value)  # getattr(x, "name"), d["name"]; a docstring is never a bare identifier
    return seen


def unread_fields(model: type[BaseModel], sources: list[str]) -> list[str]:
    seen = names_read(sources)
    return [path for path, name in leaf_fields(model) if name not in seen]


def package_sources() -> list[str]:
    return [p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p.name != "config.py"
            or p.parent != PACKAGE]


def test_every_config_field_is_read():
    unread = unread_fields(Config, package_sources())
    assert not unread, f"{len(unread)} config field(s) declared but never read outside config.py: " + \
        ", ".join(unread)


# --------------------------------------------------------------------------- the detector itself
class _Inner(BaseModel):
    read_by_attribute: int = Field(0, description="x")
    zz_never_read_field: int = Field(0, description="x")


class _Synthetic(BaseModel):
    inner: _Inner | None = Field(default_factory=_Inner, description="x")
    read_by_string: int = Field(0, description="x")
    read_in_fstring: int = Field(0, description="x")
    only_in_prose: int = Field(0, description="x")


def test_detector_reports_unread_and_only_unread():
    sources = [
        '"""Docstring naming only_in_prose and cfg.only_in_prose."""\n'
        "# a comment: cfg.only_in_prose\n"
        "a = cfg.inner.read_by_attribute\n"
        "b = getattr(cfg, 'read_by_string')\n"
        "c = f'{cfg.read_in_fstring}'\n"
    ]
    assert leaf_fields(_Synthetic) == [
        ("inner.read_by_attribute", "read_by_attribute"), ("inner.zz_never_read_field", "zz_never_read_field"),
        ("read_by_string", "read_by_string"), ("read_in_fstring", "read_in_fstring"),
        ("only_in_prose", "only_in_prose"),
    ]
    assert unread_fields(_Synthetic, sources) == ["inner.zz_never_read_field", "only_in_prose"]


def test_detector_on_the_real_package():
    # The package never reads a field of this name, and does read a field everyone uses.
    assert unread_fields(_Synthetic, package_sources())[:2] == ["inner.read_by_attribute",
                                                                "inner.zz_never_read_field"]
    assert "learner.total_steps" not in unread_fields(Config, package_sources())
    assert len(leaf_fields(Config)) > 100 and len(package_sources()) > 10
