"""The model classes SGLang's CPU engine registers at start (``SGLANG_EXTERNAL_MODEL_PACKAGE``, see ../sgl_kernel).

Why: at start SGLang's scheduler imports every module of ``sglang.srt.models`` (about 200, many failing
without CUDA kernels and logged as ignored) to build its registry of architectures: about 5 s of each
engine start on a 2-core machine. With this package named in ``SGLANG_EXTERNAL_MODEL_PACKAGE``, SGLang's
own fast start path registers only the dense Qwen2/Qwen3 classes the CPU path runs (the same classes, from
``sglang.srt.models``); a model of any other architecture still resolves, after SGLang loads the whole
registry as before. Only on CPU, only where ``async_dapo.device`` puts this directory on the path.
"""
