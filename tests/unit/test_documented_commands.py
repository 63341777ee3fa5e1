"""Every command that README.md and the user pages of docs/ tell a user to type is run by a test, so a
renamed flag, a moved tool or a config that no longer loads fails here rather than in a user's terminal.

The commands are read from the pages themselves: every line of a fenced ```bash block (continuations
joined, ``&&`` chains split, comments and redirections dropped), and every inline code span that starts
like a command (``async-dapo ...``, ``python tools/...``, ``bash tools/...``, ``tools/....sh``,
``python -m pytest ...``, ``ray start|job ...``, ``tensorboard ...``). Each must be covered in one of these
ways, tried in this order:

(a) RUN: cheap enough to run here, and this test runs it (``async-dapo`` in-process through
    ``async_dapo.cli.main``, tools as subprocesses), checking exit 0 and a piece of the output that shows it
    did its job; ``python -m pytest`` lines are checked against pyproject's markers and the paths they name;
(b) COVERED: too heavy for a unit test (a training run, a Ray job, a benchmark), listed with the test that
    runs it; that test function must exist and its source must name the command's key tokens;
(c) a tool under tools/ (whose ``--help`` tests/unit/test_tools_help.py runs): its ``--help`` is run here and
    every flag the page gives must be in it;
then, for ``async-dapo`` commands with placeholders (``RUN_DIR``, ``CONFIG``, ``[--set a.b=c ...]``) or no
arguments (a mention of a subcommand): ``async-dapo <sub> --help`` must exist and know every flag given;
(d) EXTERNAL: cannot run on this machine (real cluster nodes, a long-running viewer), with the reason.

Every ``async-dapo`` command is also checked against its subcommand's ``--help``, and a concrete
``async-dapo train`` line (no placeholders) must load its config with the overrides it gives. A command
that matches nothing fails, naming the page, the line and the command. Entries of RUN, COVERED and
EXTERNAL that no page uses fail too, so the tables stay the list of what the pages say.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import logging
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.test_tools_help import NOT_TOOLS  # what test_tools_help does not run: the tools are the rest

REPO = Path(__file__).resolve().parents[2]
# README, and the user pages of docs/README.md's reading path (architecture.md is for contributors;
# docs/results/ holds measurements, whose commands record how a table was made).
USER_PAGES = ("README.md", "docs/README.md", "docs/concepts.md", "docs/cluster.md", "docs/config.md",
              "docs/metrics.md", "docs/reliability.md", "docs/memory.md", "docs/planning.md", "docs/algorithm.md")
NOT_USER_PAGES = {"docs/architecture.md"}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # normalised: one line, no leading .venv/bin/ or env assignments, no redirection

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


# ---------------------------------------------------------------------------------------------------------
# Extraction

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
INLINE = re.compile(r"`([^`]+)`")
STARTS_LIKE_A_COMMAND = re.compile(
    r"^(async-dapo\b|python3?\s+(tools/|-m\s+pytest\b)|bash\s+tools/|tools/\S+\.sh\b|ray\s+(start|job)\b"
    r"|tensorboard\b)")


def _normalise(text: str) -> str:
    text = re.sub(r"\s+#\s.*$", "", text.strip())  # a trailing comment
    text = re.sub(r"\s+\d?>&?\s*\S+$", "", text)  # > file, 2>&1
    text = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", text)  # OMP_NUM_THREADS=1 ...
    text = re.sub(r"^\.venv/bin/", "", text)
    return " ".join(text.split())


def _split(text: str) -> list[str]:
    return [c for c in (_normalise(part) for part in text.split(" && ")) if c]


def extract(page: str) -> list[Command]:
    source = (REPO / page).read_text()
    found: list[Command] = []
    masked = list(source)
    for block in FENCE.finditer(source):
        masked[block.start():block.end()] = [c if c == "\n" else " " for c in block.group(0)]
        if block.group("lang") not in SHELL:
            continue
        first = source.count("\n", 0, block.start("body")) + 1
        lines, pending, start = block.group("body").splitlines(), "", 0
        for i, raw in enumerate(lines):
            line = raw.strip()
            if not pending:
                start = first + i
            if not line or (line.startswith("#") and not pending):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            found += [Command(page, start, c) for c in _split(pending + line)]
            pending = ""
    masked_text = "".join(masked)
    for span in INLINE.finditer(masked_text):
        text = " ".join(span.group(1).split())
        if STARTS_LIKE_A_COMMAND.match(re.sub(r"^\.venv/bin/", "", text)):
            line = masked_text.count("\n", 0, span.start()) + 1
            found += [Command(page, line, c) for c in _split(text)]
    return found


COMMANDS = [c for page in USER_PAGES for c in extract(page)]

# ---------------------------------------------------------------------------------------------------------
# What covers each command

# (a) run here: pattern -> a piece of the output that shows the command did its job.
RUN = {
    r"async-dapo train --config configs/[\w.]+\.yaml --print-config": "run_dir:",
    r"async-dapo config-reference": "# Config reference",
    r"async-dapo plan --profile configs/profiles/[\w.]+\.yaml --config configs/[\w.]+\.yaml": "## plan: profile",
    r"async-dapo plan --profile configs/profiles/cpu_tiny\.yaml --config configs/tiny_cpu\.yaml --recommend "
    r"--total-gpus \d+": "best: engines",
    r"python tools/cluster/memory_model\.py( configs/[\w.]+\.yaml)+( --set [\w.]+=\S+)*": "### Learner, one GPU",
    r"python tools/cluster/memory_model\.py --smoke": "gpu_smoke.json",
    r"python -m pytest( -m (gpu|\"not slow\"))?": "",  # checked against pyproject, not run (it is the suite)
    r"pip install -e \"\.\[dev\]\"": "",  # checked against pyproject's extras
}

# (b) run by another test: pattern -> (that test, the tokens its source must contain).
COVERED = {
    # The main command's training run: the CPU default through the real stack.
    r"async-dapo train --config configs/tiny_cpu\.yaml( --set \S+)*":
        ("tests/integration/test_train_e2e.py::test_async_run_end_to_end", ("train", "--config", "--set")),
    r"async-dapo train --config \S+ --resume \S+":
        ("tests/integration/test_faults_e2e.py::test_failing_groups_and_a_killed_learner_at_eta_0_then_resume_finishes",
         ("--resume",)),
    r"async-dapo eval --config \S+ --repeats \d+":
        ("tests/integration/test_bounded_starts.py::test_eval_engine_start_is_bounded", ('"eval"', "--config")),
    r"async-dapo scale \S+ --engines \S+( --wait-s \S+)?":
        ("tests/integration/test_fleet_e2e.py::test_a_fleet_scales_and_each_engine_fault_costs_the_learner_one_detection",
         ("_scale(",)),
    r"async-dapo stop \S+":
        ("tests/integration/test_fleet_e2e.py::test_a_fleet_scales_and_each_engine_fault_costs_the_learner_one_detection",
         ("_stop_and_finish(",)),
    r"async-dapo from-verl \S+":
        ("tests/unit/test_from_verl.py::test_the_command_prints_yaml_and_names_what_does_not_load",
         ('"from-verl"',)),
    r"async-dapo plan --profile \S+ --config \S+ --validate \S+":
        ("tests/unit/test_planner.py::test_cli_plan_prints_the_tables", ('"plan"', '"--validate"')),
    r"async-dapo plan --profile \S+ --config \S+ --recommend --total-gpus \d+( --max-mean-staleness \S+)?":
        ("tests/unit/test_planner.py::test_recommend_searches_the_split_and_keeps_the_staleness_bound",
         ("recommend(", "total_gpus", "max_mean_staleness")),
    r"tools/cluster/submit\.sh --address \S+ -- .*":
        ("tests/integration/test_multinode.py::test_job_trains_with_engine_and_learner_on_different_nodes",
         ("submit.sh", "--address")),
    r"ray job submit( .*)?":
        ("tests/integration/test_multinode.py::test_job_trains_with_engine_and_learner_on_different_nodes",
         ("submit.sh",)),
    r"python tools/bench/throughput\.py --preset .*":
        ("tests/integration/test_tools.py::test_bench_throughput_quick", ("tools/bench/throughput.py",)),
    r"python tools/bench/calibrate\.py --config .*":
        ("tests/integration/test_tools.py::test_calibrate_quick", ("tools/bench/calibrate.py", "--out")),
    r"python tools/study/ablate\.py --study .*":
        ("tests/integration/test_multinode.py::test_ablate_quick_runs_as_jobs_on_the_cluster",
         ("tools/study/ablate.py", "--study", "--address", "--out")),
}

# (d) cannot run here.
EXTERNAL = {
    r"ray start( .*)?": "starts a Ray node of a real cluster (tests/raycluster.py starts loopback nodes for the "
                     "multi-node tests, with test-only addresses and ports)",
    r"ray job stop \S+": "stops a job on a real cluster",
    r"tensorboard --logdir \S+": "a long-running viewer (tests/integration/test_train_e2e.py reads the event file "
                                 "it shows)",
    r"python3 -m venv \.venv": "creates the virtual environment this test runs in",
}


def _match(table: dict, text: str):
    return next((k for k in table if re.fullmatch(k, text)), None)


PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b|\.\.\.|\[")


def _is_form(cmd: Command) -> bool:
    """A syntax form or a mention (placeholders, optional parts, or a bare subcommand), not a command to run."""
    words = cmd.text.split()
    return bool(PLACEHOLDER.search(cmd.text)) or len(words) <= 2


def _tool(cmd: Command) -> Path | None:
    words = cmd.text.split()
    path = words[1] if words[0] in {"python", "python3", "bash"} and len(words) > 1 else words[0]
    p = REPO / path
    if path.startswith("tools/") and p.suffix in {".py", ".sh"} and p.name not in NOT_TOOLS:
        return p
    return None


def how_covered(cmd: Command) -> str | None:
    if key := _match(RUN, cmd.text):
        return f"run: {key}"
    if key := _match(COVERED, cmd.text):
        return f"covered: {key}"
    if _tool(cmd) is not None:
        return "tool --help"
    if cmd.text.startswith("async-dapo ") and _is_form(cmd):
        return "async-dapo --help"
    if key := _match(EXTERNAL, cmd.text):
        return f"external: {key}"
    return None


# ---------------------------------------------------------------------------------------------------------
# Running

def _cli(argv: list[str]) -> tuple[int, str]:
    """``async-dapo ARGV`` in this process: exit status and stdout + stderr."""
    from async_dapo.cli import main

    log = logging.getLogger("async_dapo")
    saved = log.handlers[:], log.level, log.propagate  # main() installs its own handler: put them back after
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse: --help, or a usage error
                rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
    return rc, out.getvalue()


@functools.cache
def _cli_help(sub: str) -> str:
    rc, out = _cli([sub, "--help"])
    assert rc == 0, f"async-dapo {sub} --help: exit {rc}\n{out[-2000:]}"
    return out


@functools.cache
def _tool_help(tool: Path) -> str:
    cmd = [sys.executable, str(tool), "--help"] if tool.suffix == ".py" else ["bash", str(tool), "--help"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("-") and w not in {"-", "--"}]


def _words(text: str) -> list[str]:
    return shlex.split(text.replace("[", " ").replace("]", " "))


def _check_cli(cmd: Command, words: list[str]) -> None:
    """An async-dapo command: its subcommand answers --help and knows every flag given; a concrete train
    command loads its config with its overrides."""
    sub = words[1] if len(words) > 1 else ""
    assert sub and not sub.startswith("-"), f"{cmd}: no subcommand"
    help_text = _cli_help(sub)
    unknown = [f for f in _flags(words[2:]) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
    assert not unknown, f"{cmd}: `async-dapo {sub} --help` does not know {unknown}"
    if sub == "train" and "--config" in words and "--print-config" not in words \
            and not PLACEHOLDER.search(" ".join(words)):
        argv = words[1:]
        if "--resume" in argv:  # the run directory it names exists only after a run
            i = argv.index("--resume")
            del argv[i:i + 2]
        rc, out = _cli(argv + ["--print-config"])
        assert rc == 0 and "run_dir:" in out, f"{cmd}: its config does not load:\n{out[-2000:]}"


def _check_tool_flags(cmd: Command, tool: Path) -> None:
    assert tool.is_file(), f"{cmd}: no tool {tool.relative_to(REPO)}"
    words = _words(cmd.text)
    words = words[words.index(next(w for w in words if w.endswith(tool.name))) + 1:]
    own, passed = (words[:words.index("--")], words[words.index("--") + 1:]) if "--" in words else (words, [])
    help_text = _tool_help(tool)
    unknown = [f for f in _flags(own) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]
    assert not unknown, f"{cmd}: `{tool.relative_to(REPO)} --help` does not know {unknown}"
    if passed and tool.name == "submit.sh":  # everything after -- goes to `async-dapo train`
        _check_cli(cmd, ["async-dapo", "train", *passed])


def _check_pytest(cmd: Command) -> None:
    markers = {m.split(":")[0].strip() for m in
               tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    words = _words(cmd.text)[3:]
    for i, w in enumerate(words):
        if w == "-m":
            named = set(re.findall(r"\w+", words[i + 1])) - {"not", "and", "or"}
            assert named <= markers, f"{cmd}: markers {sorted(named - markers)} are not in pyproject"
        elif not w.startswith("-") and (i == 0 or words[i - 1] != "-m"):
            assert (REPO / w.split("::")[0]).exists(), f"{cmd}: no {w}"


def _run(cmd: Command, expect: str) -> None:
    words = _words(cmd.text)
    if words[0] == "async-dapo":
        rc, out = _cli(words[1:])
    elif words[0] == "pip":
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert "dev" in extras, f"{cmd}: pyproject has no [dev] extra"
        return
    elif words[:3] == ["python", "-m", "pytest"]:
        return _check_pytest(cmd)
    else:
        tool = _tool(cmd)
        assert tool is not None, f"{cmd}: RUN knows async-dapo, pytest, pip and tools only"
        proc = subprocess.run([sys.executable, str(tool), *words[2:]], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    assert rc == 0, f"{cmd}: exit {rc}\n{out[-3000:]}"
    assert expect in out, f"{cmd}: {expect!r} not in its output:\n{out[-3000:]}"


def _function_source(ref: str) -> str:
    """The test's source, with the module-level helpers and constants it names (one level: what builds its
    command line)."""
    path, name = ref.split("::")
    source = (REPO / path).read_text()
    top = ast.parse(source).body
    fn = next((n for n in top if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert fn is not None, f"{ref}: no such test"
    named = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    helpers = [n for n in top if (isinstance(n, ast.FunctionDef) and n.name in named)
               or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id in named for t in n.targets))]
    return "\n".join(ast.get_source_segment(source, n) for n in [fn, *helpers])


@functools.cache
def _ran(text: str) -> bool:
    """Each distinct command runs once, however many pages give it (the 32B plan takes ~10 s)."""
    cmd = next(c for c in COMMANDS if c.text == text)
    _run(cmd, RUN[_match(RUN, text)])
    return True


# ---------------------------------------------------------------------------------------------------------
# Tests

def test_every_user_page_is_read():
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}
    assert pages - NOT_USER_PAGES == set(USER_PAGES) - {"README.md"}, "a page of docs/ is neither read here nor " \
        "listed as not a user page"


def test_extraction_finds_the_commands_the_pages_give():
    texts = {c.text for c in COMMANDS}
    # README's fenced main command, split at &&; a fenced command with a trailing comment; a continued inline span.
    assert {"python3 -m venv .venv", 'pip install -e ".[dev]"', "async-dapo train --config configs/tiny_cpu.yaml",
            "async-dapo train --config configs/tiny_cpu.yaml --print-config",
            "async-dapo plan --profile configs/profiles/h100_qwen2.5_32b.yaml --config "
            "configs/dapo_qwen2.5_32b_16x8_async.yaml --recommend --total-gpus 128"} <= texts, sorted(texts)
    assert {c.page for c in COMMANDS} >= {"README.md", "docs/cluster.md", "docs/planning.md", "docs/memory.md"}


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_documented_command(cmd: Command):
    words = _words(cmd.text)
    if words[0] == "async-dapo":
        _check_cli(cmd, words)
    if (tool := _tool(cmd)) is not None:
        _check_tool_flags(cmd, tool)
    how = how_covered(cmd)
    assert how is not None, (f"{cmd}\nnot covered: make it cheap enough to run here (RUN), name the test that "
                             f"runs it (COVERED), or say why it cannot run here (EXTERNAL)")
    if how.startswith("run: "):
        assert _ran(cmd.text)
    elif how.startswith("covered: "):
        ref, tokens = COVERED[how.removeprefix("covered: ")]
        source = _function_source(ref)
        missing = [t for t in tokens if t not in source]
        assert not missing, f"{cmd}: {ref} does not mention {missing}"


@pytest.mark.parametrize("table", ["RUN", "COVERED", "EXTERNAL"])
def test_every_entry_is_used_by_a_page(table: str):
    entries = {"RUN": RUN, "COVERED": COVERED, "EXTERNAL": EXTERNAL}[table]
    used = {key for c in COMMANDS if (key := (how_covered(c) or "").split(": ", 1)[-1]) in entries}
    assert not set(entries) - used, f"{table} entries no page uses: {sorted(set(entries) - used)}"


def test_the_covering_tests_exist():
    for ref, _ in COVERED.values():
        _function_source(ref)


TEST_REF = re.compile(r"`(?:tests/(?:unit|integration)/)?(test_\w+)(?:\.py)?::(\w+?)(\.\.\.)?`")


def test_tests_named_in_the_user_pages_exist():
    """The pages say which test holds each promise (reliability.md's table, ...): each must be there."""
    missing = []
    for page in USER_PAGES:
        text = (REPO / page).read_text()
        for m in TEST_REF.finditer(text):
            module, name, prefix = m.groups()
            files = list((REPO / "tests").rglob(f"{module}.py"))
            defs = {n.name for f in files for n in ast.walk(ast.parse(f.read_text()))
                    if isinstance(n, ast.FunctionDef)}
            if not (any(d.startswith(name) for d in defs) if prefix else name in defs):
                missing.append(f"{page}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not missing, missing


LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
DOC_PATH = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.(?:md|png))")


def test_links_and_doc_paths_resolve():
    """A page moved or renamed leaves no dangling link: every relative Markdown link of README and docs/
    (results included), and every docs/... path the user pages and architecture.md name, exists."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    dangling = []
    for page in pages:
        text = page.read_text()
        rel = page.relative_to(REPO).as_posix()
        targets = [(m.start(), page.parent / m.group(1)) for m in LINK.finditer(text)
                   if not re.match(r"\w+:", m.group(1))]
        if rel in USER_PAGES or rel in NOT_USER_PAGES:
            targets += [(m.start(), REPO / m.group(1)) for m in DOC_PATH.finditer(text)]
        dangling += [f"{rel}:{text.count(chr(10), 0, at) + 1}: {target}" for at, target in targets
                     if not target.exists()]
    assert not dangling, dangling
