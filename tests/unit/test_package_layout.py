"""The package's shape, checked on its source: the import graph has no cycle, no function is longer than a
screen, and each subsystem keeps to its home (the weight path's threads, streams and gathers live in
weight_sync, not in the learner; run-directory paths are built by checkpoints, not by the orchestrator)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "async_dapo"
MAX_FUNCTION_LINES = 60  # docstring excluded


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in PKG.glob("*.py")}


def _imports(tree: ast.Module, names: set[str]) -> set[str]:
    """The package modules ``tree`` imports, at any depth (lazy imports inside functions count too)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "async_dapo":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("async_dapo.")}
    return found & names


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = fn.body[0]
    doc = first.end_lineno - first.lineno + 1 if (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ) else 0
    return fn.end_lineno - fn.lineno + 1 - doc


def test_the_import_graph_has_no_cycle():
    mods = _modules()
    graph = {m: _imports(t, set(mods)) - {m} for m, t in mods.items()}
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


def test_no_function_is_longer_than_a_screen():
    long = [f"{name}.py:{fn.lineno} {fn.name} ({_body_lines(fn)} lines)"
            for name, tree in _modules().items() for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(fn) > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstring excluded): {long}"


def _names_used(tree: ast.Module) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    mods = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    return names | attrs | mods


def test_the_learner_holds_no_thread_stream_or_gather_code():
    used = _names_used(_modules()["learner"])
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
