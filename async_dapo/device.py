"""The one device seam: everything that differs between CPU and CUDA is decided here.

Other modules ask this module for the device, the torch.distributed backend, dtypes, and the environment an
SGLang engine process needs. On CUDA the answers are the ordinary ones (NCCL, bf16, real ``sgl_kernel``).
On CPU, SGLang needs a stand-in for its kernel package — see :func:`sglang_process_env` and
``async_dapo/cpu_shim/sgl_kernel/__init__.py``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import torch

Device = Literal["cpu", "cuda"]

SHIM_DIR = Path(__file__).parent / "cpu_shim"
CPU_MODELS_PACKAGE = "sglang_cpu_models"  # in SHIM_DIR
# If set, the stand-in appends one line per attempted kernel call to this file, so tests can prove that
# no stand-in function was ever called (a call also raises NotImplementedError).
SHIM_LOG_ENV = "ASYNC_DAPO_SGL_KERNEL_SHIM_LOG"


def resolve_device(requested: str = "auto") -> Device:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    return requested  # type: ignore[return-value]


def dist_backend(device: Device, requested: str = "auto") -> str:
    """torch.distributed backend: NCCL on CUDA, gloo on CPU (unless forced)."""
    if requested != "auto":
        return requested
    return "nccl" if device == "cuda" else "gloo"


def learner_backend(device: Device) -> str:
    """The learners' default process group: gloo on CPU; on CUDA NCCL for CUDA tensors and gloo for CPU
    ones (CPU offload, DCP metadata, barriers), one group that serves both."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_gpu_ids() -> list[int] | None:
    """The GPUs Ray gave this actor, as indices into the devices this process sees, when Ray was told
    not to set CUDA_VISIBLE_DEVICES (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: every actor sees
    every GPU of its node, which NVSwitch/NVLink peer access needs). None when Ray sets the variable: then
    the actor's GPUs are simply 0..n-1. Called inside an actor (or a process that never used Ray)."""
    if not os.environ.get(NOSET_CUDA_ENV):
        return None
    import ray

    return sorted(int(i) for i in ray.get_gpu_ids())


def local_gpu_index() -> int:
    """The CUDA device this learner rank trains on."""
    ids = assigned_gpu_ids()
    return ids[0] if ids else 0


def engine_dtype(device: Device, requested: str = "auto") -> str:
    """Engine weight dtype. fp32 on CPU: the learner trains fp32 and behaviour logprobs then match it
    closely; bf16 on CUDA (the usual serving dtype)."""
    if requested != "auto":
        return requested
    return "bfloat16" if device == "cuda" else "float32"


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch in this process (logging.seed; each process adds its own offset)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pin_threads(n: int = 1) -> None:
    """One intra-op thread per busy process on small machines (2 busy x 2 threads ran 10-30x slower). Also
    for the processes this one starts (an in-process SGLang engine's scheduler): under Ray they inherit the
    actor's OMP_NUM_THREADS, outside Ray nothing else would set it."""
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@functools.lru_cache(maxsize=1)
def real_sgl_kernel_loads() -> bool:
    """Whether the installed ``sgl_kernel`` imports. Probed in a subprocess: a CUDA-only build can fail
    with an OSError, or abort, and must not leave a half-imported module in this process."""
    probe = subprocess.run(
        [sys.executable, "-c", "import sgl_kernel"], capture_output=True, timeout=120,
        env={**os.environ, "PYTHONPATH": _without_shim(os.environ.get("PYTHONPATH", ""))},
    )
    return probe.returncode == 0


def _without_shim(pythonpath: str) -> str:
    return os.pathsep.join(p for p in pythonpath.split(os.pathsep) if p and Path(p) != SHIM_DIR)


def sglang_process_env(device: Device) -> dict[str, str]:
    """Environment variables an SGLang engine process needs on ``device`` (empty on CUDA).

    On CPU with no loadable kernel package: ``SGLANG_USE_CPU_ENGINE=1`` and the stand-in directory first on
    PYTHONPATH (SGLang's scheduler subprocesses inherit both): the stand-in ``sgl_kernel``, a ``flashinfer``
    that refuses to import (SGLang falls back without it) and, unless the user names their own,
    ``SGLANG_EXTERNAL_MODEL_PACKAGE`` = the package registering SGLang's Qwen2/Qwen3 classes, SGLang's fast
    start path (it skips importing every architecture; any other one still resolves). The last two only
    shorten an engine's start (cpu_shim's docstrings). Nothing in site-packages is touched.
    """
    if device != "cpu" or real_sgl_kernel_loads():
        return {}
    rest = _without_shim(os.environ.get("PYTHONPATH", ""))
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join([str(SHIM_DIR)] + ([rest] if rest else [])),
        "SGLANG_EXTERNAL_MODEL_PACKAGE": os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") or CPU_MODELS_PACKAGE,
    }


def activate_sglang_env(device: Device) -> dict[str, str]:
    """Apply :func:`sglang_process_env` to this process (env + sys.path) before ``import sglang``."""
    env = sglang_process_env(device)
    os.environ.update(env)
    if env and str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    return env
