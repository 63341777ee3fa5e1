"""Start an SGLang engine from the config, on CPU or CUDA. Sampling goes through the rollout actor's one
path (``rollout.EngineSession``: training groups, validation and ``async-dapo eval`` alike).

The engine runs in-process (``sglang.Engine``; its scheduler and detokenizer are subprocesses). On CPU,
:mod:`async_dapo.device` supplies the environment SGLang needs before ``sglang`` is imported.

Logprob semantics (SGLang 0.5.23 default, checked in its sampler): the returned token logprob is
``log_softmax(logits / temperature)`` of the sampled token, before top-p/top-k truncation. The learner
must therefore divide its logits by the same temperature to compare against behaviour logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_dapo.config import EngineConfig
from async_dapo.device import activate_sglang_env, assigned_gpu_ids, engine_dtype, resolve_device


def engine_kwargs(ec: EngineConfig, model_path: str | Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """sglang.Engine keyword arguments for ``ec`` (device-specific defaults resolved here)."""
    device = resolve_device(ec.device)
    kw: dict[str, Any] = {
        "model_path": str(model_path),
        "trust_remote_code": trust_remote_code,
        "device": device,
        "dtype": engine_dtype(device, ec.dtype),
        "tp_size": ec.tp_size,
        "mem_fraction_static": ec.mem_fraction_static,
        "random_seed": ec.random_seed,
        "skip_server_warmup": True,
        "log_level": "error",
        "disable_cuda_graph": (device == "cpu") if ec.disable_cuda_graph is None else ec.disable_cuda_graph,
        "sleep_on_idle": (device == "cpu") if ec.sleep_on_idle is None else ec.sleep_on_idle,
    }
    if device == "cuda" and (gpus := assigned_gpu_ids()):  # Ray left CUDA_VISIBLE_DEVICES alone (NVSwitch)
        kw["base_gpu_id"] = gpus[0]
    if ec.attention_backend is not None or device == "cpu":
        kw["attention_backend"] = ec.attention_backend or "torch_native"
    for name in ("max_total_tokens", "context_length", "max_running_requests"):
        if getattr(ec, name) is not None:
            kw[name] = getattr(ec, name)
    return {**kw, **ec.extra_args}


def start_engine(ec: EngineConfig, model_path: str | Path, trust_remote_code: bool = False):
    """Start an in-process sglang.Engine. Call from the main thread of a process (SGLang installs
    signal handlers) whose entry point has an ``if __name__ == "__main__":`` guard."""
    activate_sglang_env(resolve_device(ec.device))
    import sglang  # after the environment is set: the CPU path needs it at import time

    return sglang.Engine(**engine_kwargs(ec, model_path, trust_remote_code))
