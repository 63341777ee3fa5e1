"""Shared fixtures: one thread per process, and the bootstrapped tiny model (built once, cached)."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="session")
def cpu_config():
    from async_dapo.config import load_config

    # The default model ships in models/tiny_cpu (a cache hit: same weights on every machine).
    return load_config(CPU_CONFIG)


@pytest.fixture(scope="session")
def tiny_model(cpu_config) -> Path:
    from async_dapo.bootstrap import bootstrap

    return Path(bootstrap(cpu_config).path).resolve()
