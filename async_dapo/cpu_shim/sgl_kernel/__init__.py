"""Stand-in for SGLang's kernel package (``sgl_kernel``) on CPU-only machines.

Why: PyPI's sgl-kernel wheel is CUDA-only (it fails to import without libcuda), yet SGLang imports names
from it at module level. SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) with ``torch_native``
attention runs Qwen2/Qwen3-style dense models in plain torch and calls none of these kernels. This module
lets those imports succeed: every top-level attribute is a function that raises NotImplementedError
naming itself. Submodules (``sgl_kernel.scalar_type``, ...) are
deliberately absent: SGLang imports those inside ``try/except ImportError`` and falls back to pure-torch
code, which is exactly what the CPU path needs. If ``ASYNC_DAPO_SGL_KERNEL_SHIM_LOG`` is set, each
attempted call is also appended to that file, so tests can prove no kernel was ever called.

Limits: any model or feature that really needs a kernel (MoE, quantisation, MLA, flashinfer/triton
attention, LoRA kernels, speculative decoding) fails loudly with NotImplementedError at the first call.
Only ``async_dapo.device`` puts this directory on the path, and only on CPU when the real package does not
load; on CUDA it is never active.
"""

import os

__version__ = "0.0.0+async-dapo-cpu-stand-in"
_LOG_ENV = "ASYNC_DAPO_SGL_KERNEL_SHIM_LOG"


def _stand_in(qualname):
    def kernel(*args, **kwargs):
        path = os.environ.get(_LOG_ENV)
        if path:
            with open(path, "a") as f:
                f.write(qualname + "\n")
        raise NotImplementedError(
            f"{qualname} is a CPU stand-in (async_dapo/cpu_shim): this model/feature needs SGLang's "
            "CUDA kernel package; use a Qwen2/Qwen3-style model with attention_backend='torch_native'"
        )

    kernel.__name__ = kernel.__qualname__ = qualname.rsplit(".", 1)[-1]
    return kernel


def __getattr__(name):
    if name.startswith("__"):  # keep Python's protocol lookups (__path__, __file__, ...) honest
        raise AttributeError(name)
    return _stand_in(f"{__name__}.{name}")
