"""The replay queue's modules import without torch (the driver / queue node may be CPU-only).

A fresh interpreter puts a finder first on ``sys.meta_path`` that refuses ``torch`` and every
``torch.*`` module and records each attempt, then imports the queue actor's modules one after the
other, leaves first (an attempt is charged to the first of them that pulled it in). Any top-level
``import torch`` in them, or in anything they import at top level, fails this test, and so does a
guarded ``try: import torch`` (the attempt is recorded even if it is caught).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The queue actor and its policy; the wire format and zmq transport the queue receives with.
QUEUE_MODULES = ("async_dapo.replay.queue", "async_dapo.replay.policy")
TRANSPORT_MODULES = ("async_dapo.stream.transport", "async_dapo.stream.wire")

_PROBE = r"""
import importlib, json, sys

class RefuseTorch:
    def __init__(self):
        self.attempts = []  # (module being imported, torch module asked for)
        self.importing = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            self.attempts.append([self.importing, name])
            raise ImportError(f"torch is refused in this test (asked for {name!r})")
        return None

finder = RefuseTorch()
sys.meta_path.insert(0, finder)
results = {}
for module in sys.argv[1:]:
    finder.importing = module
    try:
        importlib.import_module(module)
        error = None
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    results[module] = {"error": error, "attempts": [a for a in finder.attempts if a[0] == module]}
print(json.dumps({"results": results, "torch_in_modules": sorted(m for m in sys.modules
                                                                 if m == "torch" or m.startswith("torch."))}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    leaves_first = ("async_dapo.stream.wire", "async_dapo.stream.transport", "async_dapo.replay.policy", "async_dapo.replay.queue")
    assert sorted(leaves_first) == sorted(QUEUE_MODULES + TRANSPORT_MODULES)
    proc = subprocess.run([sys.executable, "-c", _PROBE, *leaves_first], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", QUEUE_MODULES + TRANSPORT_MODULES)
def test_module_imports_without_torch(probe: dict, module: str) -> None:
    result = probe["results"][module]
    assert result["error"] is None, f"importing {module} with torch refused: {result['error']}"
    assert result["attempts"] == [], f"importing {module} tried to import torch: {result['attempts']}"


def test_no_torch_module_was_loaded(probe: dict) -> None:
    assert probe["torch_in_modules"] == []
