"""The package's shape, checked on its source: the tree is one subpackage per subsystem, stacked so that
every import points down the stack (never up, never across to a sibling), with no cycle; no function is
longer than a screen; and each subsystem keeps to its home (the weight path's threads, streams and gathers
live in weights.sync, not in the learner; run-directory paths are built by checkpoint.run_dir, not by the
orchestrator)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "async_dapo"
MAX_FUNCTION_LINES = 60  # docstring excluded

# The stack, bottom first: a unit (a subpackage, or a module at the top of the package) may import its own
# modules and the units of lower layers only. Units of one layer are siblings and never import each other.
LAYERS = (
    ("config", "device", "waits"),  # what every part uses: the schema, the device, bounded waits
    ("stream", "data"),  # the wire schema and transport; prompts, rewards, scoring
    ("metrics",),  # reads groups (stream.wire)
    ("checkpoint",),  # the run directory, rank state, safe checkpoint loading
    ("weights",),  # the learner-to-engine weight path
    ("rollout", "replay", "learner", "planning"),  # the three stages of the pipeline, and its model
    ("fleet",),  # places and supervises the stages' actors
    ("bootstrap", "preflight"),  # the embedded default's model; checks before a run starts
    ("orchestrator",),  # the training loop
    ("cli",),  # the commands
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, ast.Module]:
    """Every module of the package by dotted name below async_dapo ("learner.rank", "cli")."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        if parts[0] == "cpu_shim":  # a stand-in sgl_kernel put on SGLang's path (device.py), not a module of ours
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(p.read_text())
    return out


def _unit(module: str) -> str:
    return module.split(".")[0]


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run: an annotation's import, not a dependency at run
    time; config.rules names the Config that runs it)."""
    return {id(n) for s in ast.walk(tree) if isinstance(s, ast.If) and getattr(s.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(s)}


def _imports(module: str, tree: ast.Module, names: set[str], run_time_only: bool = False) -> set[str]:
    """The package modules ``tree`` imports, at any depth (lazy imports count; type-only imports count unless
    ``run_time_only``)."""
    found, skip = set(), _type_only(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "async_dapo":
            base = node.module.removeprefix("async_dapo").removeprefix(".")
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                found.add(sub if sub in names else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("async_dapo.") for a in node.names if a.name.startswith("async_dapo.")}
    return (found & names) - {module}


def _graph(run_time_only: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, t, set(mods), run_time_only) for m, t in mods.items()}


def test_every_unit_has_a_place_in_the_stack():
    units = {_unit(m) for m in _modules() if m}
    assert units == set(LAYER), f"not in LAYERS: {sorted(units - set(LAYER))}; gone: {sorted(set(LAYER) - units)}"


def test_every_import_points_down_the_stack():
    up = [f"{m} -> {dep}" for m, deps in _graph().items() if m for dep in deps
          if _unit(dep) != _unit(m) and LAYER[_unit(dep)] >= LAYER[_unit(m)]]
    assert not up, f"imports of a unit in the same or a higher layer: {sorted(up)}"


def test_the_import_graph_has_no_cycle():
    graph = _graph(run_time_only=True)
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for dep in sorted(graph[m]):
            visit(dep)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = fn.body[0]
    doc = first.end_lineno - first.lineno + 1 if (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ) else 0
    return fn.end_lineno - fn.lineno + 1 - doc


def test_no_function_is_longer_than_a_screen():
    long = [f"{name}:{fn.lineno} {fn.name} ({_body_lines(fn)} lines)"
            for name, tree in _modules().items() for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(fn) > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstring excluded): {long}"


def _names_used(tree: ast.Module) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    mods = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    return names | attrs | mods


def test_the_learner_holds_no_thread_stream_or_gather_code():
    used = _names_used(_modules()["learner.rank"])
    banned = {"threading", "Thread", "Stream", "stream", "all_gather_into_tensor", "all_gather", "broadcast"}
    assert not used & banned, sorted(used & banned)


def test_the_orchestrator_builds_no_run_directory_path():
    """No ``path / "name"`` in the orchestrator: every file of a run is named by checkpoints.RunDir."""
    tree = _modules()["orchestrator"]
    joins = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
             and isinstance(n.right, (ast.Constant, ast.JoinedStr))]
    assert not joins, f"orchestrator.py builds paths at lines {joins}"
    for fs_call in ("mkdir", "rename", "unlink", "rmtree", "glob", "read_text"):
        assert fs_call not in _names_used(tree), fs_call
