"""Hides the CUDA-only ``flashinfer`` package from SGLang's CPU engine processes (see ../sgl_kernel).

Why: SGLang imports flashinfer (and, through it, NVIDIA's ``cutlass`` DSL) inside ``try/except ImportError``
at module level, for kernels its CPU path never calls (fp4 quantisation, fused activations, CUDA sampling).
Importing them costs each engine process about 4 of its ~25 s of imports on a 2-core machine, and an engine
starts three such processes (its actor, scheduler and detokenizer). Raising ImportError here takes SGLang's
own fallback, the one it takes wherever flashinfer is not installed. Only on CPU, only where
``async_dapo.device`` puts this directory first on the path (never on CUDA).
"""

raise ImportError("flashinfer is CUDA-only: hidden from SGLang's CPU engine by async_dapo/cpu_shim")
