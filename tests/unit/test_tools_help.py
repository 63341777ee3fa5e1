"""Every tool under tools/ (found by walking the folder, so a new tool is covered without editing this file)
answers ``--help``: exit 0, and its output starts with a usage line that names the tool by its path. Python
tools are run by their path from another directory (as a user may run them) and must not import anything
heavy before they have parsed their arguments (no Ray, engine, torch or config start for a --help). And what
the tools import from async_dapo exists and is public (read from the source: a module renamed or a name
made private in the package fails here, not in a benchmark run days later)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
NOT_TOOLS = {"common.py", "__init__.py"}  # the shared helper; package markers
# Nothing of these may be imported by `--help` (the helper itself imports the standard library only).
HEAVY = {"torch", "transformers", "ray", "sglang", "sgl_kernel", "zmq", "pydantic", "numpy", "async_dapo"}


def _tools() -> list[Path]:
    return sorted(p for p in TOOLS.rglob("*") if p.is_file() and p.suffix in {".py", ".sh"}
                  and p.name not in NOT_TOOLS and "__pycache__" not in p.parts)


def test_discovery_finds_every_kind_of_tool():
    found = {p.relative_to(REPO).as_posix() for p in _tools()}
    # One of each folder, and the wrapper that must stay at its old path: discovery is not vacuous.
    assert {"tools/gpu_smoke.sh", "tools/gpu/gpu_smoke.py", "tools/bench/push.py", "tools/study/ablate.py",
            "tools/cluster/submit.sh"} <= found, sorted(found)
    assert "tools/common.py" not in found


@pytest.mark.parametrize("tool", _tools(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_tool_help(tool: Path, tmp_path: Path):
    rel = tool.relative_to(REPO).as_posix()
    if tool.suffix == ".py":
        cmd = [sys.executable, "-X", "importtime", str(tool), "--help"]
    else:
        cmd = ["bash", str(tool), "--help"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    first = proc.stdout.lstrip("\n").splitlines()[0] if proc.stdout.strip() else ""
    assert first.startswith("usage: ") and rel in first, proc.stdout[:500]
    if tool.suffix == ".py":
        # -X importtime writes one line per module imported: "import time: self | cumulative | name".
        imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                    for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert imported, proc.stderr[-2000:]  # the import log is there (so the check below means something)
        assert not imported & HEAVY, f"{rel} --help imported {sorted(imported & HEAVY)}"


def _defined(module: str) -> set[str] | None:
    """Top-level names of async_dapo module ``module`` ("async_dapo.x.y"), from its source; None if absent."""
    base = REPO.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.exists():
        return None
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every level: names bound in if/try blocks count too
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    if base.is_dir():
        names |= {p.stem for p in base.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    return names


@pytest.mark.parametrize("tool", [p for p in _tools() if p.suffix == ".py"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_tool_imports_only_public_names_that_exist(tool: Path):
    problems = []
    for node in ast.walk(ast.parse(tool.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "async_dapo":
            defined = _defined(node.module)
            if defined is None:
                problems.append(f"line {node.lineno}: no module {node.module}")
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    problems.append(f"line {node.lineno}: {node.module}.{alias.name} is private")
                elif alias.name not in defined:
                    problems.append(f"line {node.lineno}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Import):
            problems += [f"line {node.lineno}: no module {a.name}" for a in node.names
                         if a.name.split(".")[0] == "async_dapo" and _defined(a.name) is None]
    assert not problems, problems
