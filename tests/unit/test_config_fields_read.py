"""Every config field must be read somewhere: a declared-but-unread field is a knob that does nothing.

The detector walks the Config model tree to its leaf fields (dotted paths such as ``rollout.engine.tp_size``)
and looks, in the package's sources other than the schema (async_dapo/config/ but its reference and
from_verl), for a read of each leaf *through its section*: an
attribute access ``<x>.tp_size`` (or ``getattr(<x>, "tp_size")``) where ``<x>`` is an expression known to
hold the ``rollout.engine`` section. A bare name match is not enough: ``device``, ``dtype``, ``path``,
``seed`` or ``port`` occur all over the package on objects that are not config sections, so counting any
``.device`` would let the real read of ``rollout.engine.device`` be deleted unnoticed.

What "holds a section" means is decided per module with ``ast`` (so prose in docstrings and comments never
counts), to a fixed point:

* the root Config: a parameter, variable or attribute annotated ``Config``, the result of ``load_config(...)``,
  and, by the package's convention, any name or attribute called ``cfg`` (several functions take an
  unannotated ``cfg``; ``bootstrap.py`` also binds a ``Qwen2Config`` to ``cfg``, which is harmless: reads
  must still name a real ``<section>.<field>`` chain);
* ``<holder of S>.<sub>`` holds ``S.<sub>`` when ``sub`` is a nested section of ``S``;
* a name or ``self.<attr>`` bound (plain, tuple or walrus assignment, or a class-level annotation) from a
  holder, or annotated with the section's class (``ec: EngineConfig``), holds that section
  (``rc = self.cfg.replay; rc.max_staleness``); ``<holder>.model_copy(...)`` holds the same section;
* ``getattr(<holder>, name)`` reads ``name`` when it is a string constant, or a loop variable iterating over
  a tuple/list of string constants (``engine.py``'s optional SGLang arguments).

Bindings are per module, not per function scope (a name bound to a section anywhere in a module counts as
that section everywhere in it): the check is a floor, sound against deleting a read, not a proof of use.
Only loads count: assigning ``cfg.x.y = ...`` is not a read, nor is ``model_dump()`` (a field that only ever
travels inside a dump is allow-listed below with the reason).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel, Field

from async_dapo.config import Config

PACKAGE = Path(__file__).resolve().parents[2] / "async_dapo"

# Fields read only as a whole dump; each entry says where and why. Keep this short: a new entry needs a reason
# that a reader can check in the code.
DUMP_ONLY: dict[str, str] = {}

ROOT_NAMES = {"cfg"}  # the package's name for the root Config (see the module docstring)


def _section_types(model: type[BaseModel]) -> list[type[BaseModel]]:
    return [a for a in (getattr(model, "__args__", None) or (model,)) if isinstance(a, type) and issubclass(a, BaseModel)]


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, field name) of every leaf field; nested models (also ``Model | None``) are walked."""
    out = []
    for name, field in model.model_fields.items():
        sub = _section_types(field.annotation)
        if sub:
            out += leaf_fields(sub[0], f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", name))
    return out


def section_tree(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel]]:
    """Dotted path of every section ('' = the root) -> its model class."""
    out = {prefix.rstrip("."): model}
    for name, field in model.model_fields.items():
        sub = _section_types(field.annotation)
        if sub:
            out.update(section_tree(sub[0], f"{prefix}{name}."))
    return out


def _annotation_names(node: ast.expr | None) -> set[str]:
    """Class names an annotation mentions: ``EngineConfig``, ``"Config"``, ``Config | None``, ``Optional[X]``."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


class _Module:
    """Section holders and field reads of one module's source."""

    def __init__(self, text: str, model: type[BaseModel]) -> None:
        self.tree = ast.parse(text)
        self.sections = section_tree(model)
        self.by_class = defaultdict(set)
        for path, cls in self.sections.items():
            self.by_class[cls.__name__].add(path)
        self.names: dict[str, set[str]] = defaultdict(set)  # variable name -> section paths it may hold
        self.attrs: dict[str, set[str]] = defaultdict(set)  # self.<attr> / obj.<attr> -> section paths
        for n in ROOT_NAMES:
            self.names[n].add("")
            self.attrs[n].add("")
        self.loop_strings: dict[str, set[str]] = defaultdict(set)  # `for name in ("a", "b")` -> {"a", "b"}
        self._bind_to_fixed_point()

    # ------------------------------------------------------------------ what an expression holds
    def holds(self, node: ast.expr) -> set[str]:
        if isinstance(node, ast.Name):
            return set(self.names.get(node.id, ()))
        if isinstance(node, ast.Attribute):
            out = {f"{p}.{node.attr}".lstrip(".") for p in self.holds(node.value)}
            return {p for p in out if p in self.sections} | set(self.attrs.get(node.attr, ()))
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "load_config":
                return {""}
            if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) >= 2:
                return {f"{p}.{s}".lstrip(".") for p in self.holds(node.args[0]) for s in self._getattr_names(node)
                        if f"{p}.{s}".lstrip(".") in self.sections}
            if isinstance(f, ast.Attribute) and f.attr == "model_copy":
                return self.holds(f.value)
            return set()
        if isinstance(node, ast.IfExp):
            return self.holds(node.body) | self.holds(node.orelse)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.holds(v) for v in node.values))
        if isinstance(node, ast.NamedExpr):
            return self.holds(node.value)
        return set()

    def _getattr_names(self, call: ast.Call) -> set[str]:
        arg = call.args[1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return {arg.value}
        if isinstance(arg, ast.Name):
            return set(self.loop_strings.get(arg.id, ()))
        return set()

    # ------------------------------------------------------------------ bindings
    def _bind(self, target: ast.expr, paths: set[str]) -> bool:
        table, key = (self.names, target.id) if isinstance(target, ast.Name) else \
            (self.attrs, target.attr) if isinstance(target, ast.Attribute) else (None, None)
        if table is None or paths <= table[key]:
            return False
        table[key] |= paths
        return True

    def _bind_pairs(self, target: ast.expr, value: ast.expr) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            return any([self._bind_pairs(t, v) for t, v in zip(target.elts, value.elts)])
        return self._bind(target, self.holds(value))

    def _bind_annotation(self, target: ast.expr, annotation: ast.expr | None) -> bool:
        paths = set().union(*(self.by_class.get(n, set()) for n in _annotation_names(annotation)))
        return bool(paths) and self._bind(target, paths)

    def _bind_to_fixed_point(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                    and isinstance(node.iter, (ast.Tuple, ast.List)):
                consts = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if len(consts) == len(node.iter.elts):
                    self.loop_strings[node.target.id] |= set(consts)
        changed = True
        while changed:
            changed = False
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        changed |= self._bind_pairs(t, node.value)
                elif isinstance(node, ast.AnnAssign):
                    changed |= self._bind_annotation(node.target, node.annotation)
                    if node.value is not None:
                        changed |= self._bind_pairs(node.target, node.value)
                elif isinstance(node, ast.NamedExpr):
                    changed |= self._bind(node.target, self.holds(node.value))
                elif isinstance(node, ast.arg):
                    changed |= self._bind_annotation(ast.Name(id=node.arg), node.annotation)

    # ------------------------------------------------------------------ reads
    def reads(self) -> set[str]:
        """Dotted paths of the leaf fields this module reads through a holder of their section."""
        out: set[str] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                out |= {f"{p}.{node.attr}".lstrip(".") for p in self.holds(node.value)}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2:
                out |= {f"{p}.{s}".lstrip(".") for p in self.holds(node.args[0]) for s in self._getattr_names(node)}
        return out - set(self.sections)


def fields_read(model: type[BaseModel], sources: list[str]) -> set[str]:
    return set().union(*(_Module(text, model).reads() for text in sources))


def unread_fields(model: type[BaseModel], sources: list[str], allowed: dict[str, str] | None = None) -> list[str]:
    seen = fields_read(model, sources) | set(allowed or {})
    return [path for path, _ in leaf_fields(model) if path not in seen]


def package_sources() -> list[str]:
    schema = PACKAGE / "config"
    return [p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
            if p.parent != schema or p.name in ("reference.py", "from_verl.py")]


def test_every_config_field_is_read():
    unread = unread_fields(Config, package_sources(), DUMP_ONLY)
    assert not unread, f"{len(unread)} config field(s) declared but never read through their section " \
        "outside the schema (async_dapo/config/): " + ", ".join(unread)


def test_allow_list_names_real_fields_that_are_really_unread_otherwise():
    # A stale entry (renamed field, or one that gained a real read) would silently widen the allow-list.
    leaves = {p for p, _ in leaf_fields(Config)}
    read = fields_read(Config, package_sources())
    assert {k for k in DUMP_ONLY if k not in leaves or k in read} == set()


# --------------------------------------------------------------------------- the detector itself
class _EngineLike(BaseModel):
    device: str = Field("cpu", description="x")
    dtype: str = Field("auto", description="x")
    by_loop_getattr: int = Field(0, description="x")


class _Inner(BaseModel):
    read_by_attribute: int = Field(0, description="x")
    read_by_alias: int = Field(0, description="x")
    read_by_self_alias: int = Field(0, description="x")
    read_by_tuple_alias: int = Field(0, description="x")
    zz_never_read_field: int = Field(0, description="x")
    only_assigned: int = Field(0, description="x")
    engine: _EngineLike = Field(default_factory=_EngineLike)


class _Synthetic(BaseModel):
    inner: _Inner | None = Field(default_factory=_Inner, description="x")
    read_by_string: int = Field(0, description="x")
    read_in_fstring: int = Field(0, description="x")
    only_in_prose: int = Field(0, description="x")
    seed: int = Field(0, description="x")


SYNTHETIC_SOURCE = (
    '"""Docstring naming only_in_prose and cfg.only_in_prose."""\n'
    "# a comment: cfg.only_in_prose\n"
    "a = cfg.inner.read_by_attribute\n"
    "b = getattr(cfg, 'read_by_string')\n"
    "c = f'{cfg.read_in_fstring}'\n"
    "def f(cfg):\n"
    "    rc = cfg.inner\n"
    "    return rc.read_by_alias\n"
    "class A:\n"
    "    def __init__(self, cfg):\n"
    "        self.cfg = cfg\n"
    "        self.ic = self.cfg.inner\n"
    "    def g(self):\n"
    "        x, ic = 1, self.cfg.inner\n"
    "        return self.ic.read_by_self_alias + ic.read_by_tuple_alias\n"
    "def h(ec: '_EngineLike', other):\n"
    "    cfg.inner.only_assigned = 3\n"  # a store, not a read
    "    for name in ('by_loop_getattr',):\n"
    "        getattr(ec, name)\n"
    "    return ec.device, other.dtype, other.seed\n"  # .dtype/.seed off an unknown object: no read
)


def test_detector_reports_unread_and_only_unread():
    assert leaf_fields(_Synthetic)[:2] == [("inner.read_by_attribute", "read_by_attribute"),
                                           ("inner.read_by_alias", "read_by_alias")]
    assert unread_fields(_Synthetic, [SYNTHETIC_SOURCE]) == [
        "inner.zz_never_read_field", "inner.only_assigned", "inner.engine.dtype", "only_in_prose", "seed"]
    # Each binding form is what makes its field count: drop the alias and the field is unread again.
    without_alias = SYNTHETIC_SOURCE.replace("    rc = cfg.inner\n", "    rc = object()\n")
    assert "inner.read_by_alias" in unread_fields(_Synthetic, [without_alias])
    without_annotation = SYNTHETIC_SOURCE.replace("ec: '_EngineLike'", "ec")
    assert {"inner.engine.device", "inner.engine.by_loop_getattr"} <= set(
        unread_fields(_Synthetic, [without_annotation]))
    # The allow-list covers exactly its entries.
    assert unread_fields(_Synthetic, [SYNTHETIC_SOURCE], {"seed": "why"})[-1] == "only_in_prose"


def test_detector_on_the_real_package():
    # None of the synthetic names is read through a synthetic section in the package (its `.device`,
    # `.dtype`, `.seed` are other objects'), and real reads in each style the package uses are found.
    assert unread_fields(_Synthetic, package_sources()) == [p for p, _ in leaf_fields(_Synthetic)]
    read = fields_read(Config, package_sources())
    assert {
        "learner.total_steps",            # self.cfg.learner.total_steps / lc = cfg.learner
        "rollout.engine.tp_size",         # cfg.rollout.engine.tp_size, ec: EngineConfig
        "rollout.engine.max_total_tokens",  # getattr(ec, name) over a tuple of names
        "placement.num_engines",          # p = cfg.placement
        "replay.max_staleness",           # rc = self.cfg.replay
    } <= read
    assert len(leaf_fields(Config)) > 100 and len(package_sources()) > 10
