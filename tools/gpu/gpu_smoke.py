"""GPU smoke test of one FSDP2 learner rank, driven directly (no Ray), for a single-GPU machine whose image
has torch and transformers but no sglang, ray or zmq. Writes ONE JSON; exits 1 if any check failed.

    python tools/gpu/gpu_smoke.py --out runs/gpu_smoke/gpu_smoke.json       # CUDA: Qwen2.5-0.5B shape
    python tools/gpu/gpu_smoke.py --device cpu --tiny --out /tmp/x.json     # the same code path on CPU (gloo)

``tools/gpu_smoke.sh`` wraps it for the device machine (installs the carried .whl/ wheels first). The model
is a randomly initialised Qwen2 built here from a ``transformers.Qwen2Config`` and saved as safetensors
(bf16, like the hub's checkpoints) into a scratch directory: nothing is downloaded, no tokenizer is needed.
Config: ``load_config(None, overrides)`` (tools/common.py's, async_dapo.config's) with model.bootstrap=null,
bf16 compute (FSDP2 MixedPrecisionPolicy, fp32 master weights), activation checkpointing, an NCCL (CPU: gloo)
world of 1.

Checks, in the order they run (each check's dict in the JSON has ``ok`` and ``error``):

startup      Construct LearnerWorker A (bf16). CUDA: memory_allocated / max_memory_allocated after
             construction; host RSS and its peak (VmRSS / VmHWM) either way.
grad_cosine  ``gradients(groups)`` of A on its fresh weights, later of a float32 worker B on the same
             weights (loaded from the same files) and the same batch: cosine of the flattened gradients,
             in float64. Passes at > 0.99: bf16 keeps 8 mantissa bits (relative rounding 2^-9 per operation);
             the rounding of activations and weights is mostly uncorrelated across the gradient's
             coordinates, so it turns the gradient by a small angle only, while a real fault (a wrong sign,
             a missing layer, a wrong token alignment) takes the cosine far below 0.99. The norm ratio is
             reported too (a cosine cannot see a wrong scale).
memory       One warm-up train_step (so AdamW's states exist), then for each sample length (CUDA: 4k, 8k,
             16k, 22.5k tokens) one group of G samples of that length, with learner.micro_batch_tokens set
             to the length (one sample per micro-batch): (a) a no-grad log-prob pass over the group's
             micro-batches (the learner's own ``plan`` and ``logprobs``, as its proximal pass runs
             them) and (b) one ``train_step``. Before each, the peak statistic is reset and the
             baseline read: CUDA: torch.cuda.max_memory_allocated - memory_allocated; CPU: the process's
             peak RSS (VmHWM, reset through /proc/self/clear_refs) - RSS, with glibc told to return large
             blocks to the system at once. ``bytes_per_token`` = (peak - baseline) / tokens of the largest
             micro-batch (the one that sets the peak): multiply by learner.micro_batch_tokens to size a
             micro-batch; ``fit`` also gives the least-squares slope and intercept of the deltas over the
             lengths (the intercept holds what does not grow with tokens, e.g. FSDP's unsharded bf16
             copy of the embedding). An out-of-memory error at a length is recorded there and the check
             fails.
dcp_resume   A trains a step, ``save_checkpoint``, trains the next step -> loss, grad_norm and a bit-level
             fingerprint (integer sum of the fp32 bit patterns) of every parameter and AdamW state tensor.
             A new worker C ``load_checkpoint``s (its state must equal A's at the save, bit for bit: that
             is the checkpoint itself) and trains the same next step: loss, grad_norm and the new state
             must be exactly equal. Both next steps run under torch.use_deterministic_algorithms(True)
             (strict: flash-attention backward and scatter-adds are otherwise free to reorder sums on CUDA),
             so a difference can only come from the checkpoint.
weight_push  A receiver PROCESS (multiprocessing spawn, not Ray) joins the weight-update group as rank 1
             (``weight_sync.open_update_group(..., rank=1)``), receives each bucket as ONE flat uint8
             ``dist.broadcast(src=0)`` in the order of the bucket plan (``plan_buckets`` over A's named
             parameters under ``sglang_name``, engine dtype bf16, weight_sync.bucket_mb), splits it into
             tensors exactly as SGLang's ``load_format="flattened_bucket"`` does
             (``FlattenedTensorBucket.empty`` + ``reconstruct_tensors``: byte offsets in plan order,
             ``.view(dtype).reshape(shape)``), and compares each with the expected full weight (written by
             this driver as safetensors before the push) byte for byte; both sides also put a sha256 of
             the bytes in plan order in the JSON (``expected_sha256``, ``receiver.sha256``). The learner side:
             ``open_weight_group(addr, port, 2, name, dtype="bfloat16")``, ``push_weights([], None,
             version)``, ``wait_push()``. Needs >= 2 buckets. One GPU cannot hold two NCCL ranks ("Duplicate
             GPU detected"), so with one GPU the weight group is gloo (the learner's CUDA tensors go through
             gloo's CUDA path) and the receiver receives into host memory; with >= 2 GPUs it is NCCL and
             the receiver uses cuda:1.
imports      ray, zmq, sglang (and sgl_kernel) were never imported. ``--forbid-imports`` makes any attempt
             raise ModuleNotFoundError (in the receiver too) and records where it came from.

The JSON also holds torch/CUDA/transformers versions, the GPU name, the model's shape and size, and the
wall seconds of every phase. A watchdog (--deadline-s) writes the JSON so far and exits 2 if the run
overstays; every wait inside is bounded too (process joins, collective and weight-group timeouts).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import json
import math
import os
import platform
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
# tools/: common.py (standard library only; it makes async_dapo importable from anywhere)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402


# Before CUDA starts: cuBLAS is deterministic under torch.use_deterministic_algorithms only with this.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
FORBIDDEN = ("ray", "zmq", "sglang", "sgl_kernel")
GROUP_NAME = "gpu_smoke_weights"

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
# Tiny, but its bf16 weights (4.2 MB) still make several buckets at the smallest bucket size (1 MB).
TINY = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=1024, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=1024,
            rms_norm_eps=1e-6)

PRESETS = {
    # lengths: memory phase sample lengths (prompt + response tokens); group: samples per group (G).
    "full": dict(shape=QWEN25_05B, lengths=[4096, 8192, 16384, 23040], group=4, small_len=1024,
                 micro_batch_tokens=4096, bucket_mb=64, deadline_s=330),
    "tiny": dict(shape=TINY, lengths=[64, 128, 256, 360], group=4, small_len=48,
                 micro_batch_tokens=128, bucket_mb=1, deadline_s=240),
}
PROMPT_LEN = 16
COSINE_MIN = 0.99


# ------------------------------------------------------------------------------------------ imports
class ForbidImports(importlib.abc.MetaPathFinder):
    """Make importing any of ``names`` fail as if it were not installed; remember who tried. Stricter than
    absence: an ``importlib.util.find_spec`` probe raises too (and is recorded) where an absent module
    would give None; the learner's import path makes no such probe for these names."""

    def __init__(self, names=FORBIDDEN) -> None:
        self.names = set(names)
        self.attempts: list[dict[str, str]] = []

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            stack = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                     if "importlib" not in f.filename]
            self.attempts.append({"module": fullname, "from": " <- ".join(reversed(stack[-4:]))})
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by gpu_smoke --forbid-imports)",
                                      name=fullname)
        return None


def forbidden_loaded() -> list[str]:
    return sorted(m for m, mod in list(sys.modules.items()) if m.split(".")[0] in FORBIDDEN and mod is not None)


# ------------------------------------------------------------------------------------------ report
class Report:
    """The one JSON: written after every phase (atomically), so a watchdog exit still leaves the results."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data
        self.phase = "start"
        self.lock = threading.Lock()
        self.data.setdefault("phases_s", {})
        self.data.setdefault("checks", {})

    def check(self, name: str) -> dict[str, Any]:
        return self.data["checks"].setdefault(name, {"ok": False, "error": None})

    @contextlib.contextmanager
    def phase_timer(self, name: str):
        self.phase = name
        print(f"[gpu_smoke] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.data["phases_s"][name] = round(self.data["phases_s"].get(name, 0.0) + dt, 3)
            print(f"[gpu_smoke] {name}: {dt:.1f} s", flush=True)
            self.write()

    @contextlib.contextmanager
    def guarded(self, phase: str, check: str, worker):
        """Time ``phase``; an exception in it fails ``check`` and the smoke goes on. Without a worker (its
        start-up failed) the body fails on None, reported as that."""
        with self.phase_timer(phase):
            try:
                yield
            except Exception as exc:
                self.fail(check, RuntimeError("no bf16 worker (startup failed)") if worker is None else exc)

    def fail(self, name: str, exc: BaseException) -> None:
        c = self.check(name)
        c["ok"] = False
        msg = f"{type(exc).__name__}: {exc}"
        c["error"] = msg if not c.get("error") else f"{c['error']}; {msg}"
        c.setdefault("traceback", traceback.format_exc(limit=12)[-4000:])
        print(f"[gpu_smoke] {name} FAILED: {msg}", flush=True)

    def write(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            tmp.replace(self.path)


class Watchdog:
    """After ``seconds``: record the phase that overstayed, write the JSON, end stray children, exit 2."""

    def __init__(self, report: Report, seconds: float) -> None:
        self.report, self.seconds, self.children = report, seconds, []
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        r = self.report
        r.data["ok"] = False
        r.data["timed_out"] = f"deadline {self.seconds:.0f} s passed during phase {r.phase!r}"
        r.data["wall_s"] = round(time.perf_counter() - T0, 3)
        print(f"[gpu_smoke] {r.data['timed_out']}", flush=True)
        for proc in self.children:
            with contextlib.suppress(Exception):
                proc.kill()
        with contextlib.suppress(Exception):
            r.write()
        os._exit(2)

    def cancel(self) -> None:
        self.timer.cancel()


# ------------------------------------------------------------------------------------------ memory
def _proc_status_kb(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) if m else 0


def host_memory() -> dict[str, int]:
    return {"rss_bytes": _proc_status_kb("VmRSS") << 10, "peak_rss_bytes": _proc_status_kb("VmHWM") << 10}


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _return_large_blocks_to_os() -> None:
    """CPU mode: glibc otherwise keeps freed memory in its heap, and a later peak would not show in the RSS."""
    import ctypes

    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mmap'ed, unmapped when freed
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD: give a free heap top back above 128 KiB


class PeakMeter:
    """Peak memory above the baseline during one block. CUDA: the caching allocator's statistics. CPU: the
    RSS peak (VmHWM), or a 1 ms RSS sampler where it cannot be reset."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.method = "cuda.max_memory_allocated"
        if device == "cpu":
            self.method = "VmHWM" if _reset_peak_rss() else "rss_sampler"

    @contextlib.contextmanager
    def measure(self, out: dict[str, Any]):
        import torch

        gc.collect()
        sampler = stop = None
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _proc_status_kb("VmRSS") << 10
            if self.method == "VmHWM":
                _reset_peak_rss()
            else:
                stop, box = threading.Event(), [base]

                def sample() -> None:
                    while not stop.is_set():
                        box[0] = max(box[0], _proc_status_kb("VmRSS") << 10)
                        time.sleep(0.001)

                sampler = threading.Thread(target=sample, daemon=True)
                sampler.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sampler is not None:
                stop.set()
                sampler.join(timeout=5)
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        elif sampler is not None:
            peak = box[0]
        else:
            peak = _proc_status_kb("VmHWM") << 10
        out.update(seconds=round(time.perf_counter() - t0, 4), baseline_bytes=base, peak_bytes=peak,
                   delta_bytes=peak - base, method=self.method)


# ------------------------------------------------------------------------------------------ inputs
def make_group(gid: str, length: int, n: int, vocab: int, seed: int):
    """One group of ``n`` samples of exactly ``length`` tokens (PROMPT_LEN prompt + the rest response),
    random token ids, half correct, behaviour logprobs near a uniform policy's (-log V)."""
    import numpy as np

    from async_dapo.stream.wire import Group, Sample

    rng = np.random.default_rng(seed)
    response = length - PROMPT_LEN
    samples = []
    for j in range(n):
        acc = j % 2 == 0
        samples.append(Sample(
            response_ids=rng.integers(0, vocab, size=response).astype(np.int32),
            logprobs=(-math.log(vocab) - 0.5 * rng.random(response)).astype(np.float32),
            versions=np.zeros(response, np.int32), reward=1.0 if acc else -1.0, score=1.0 if acc else -1.0,
            acc=acc, truncated=False, finish_reason="stop", gen_seconds=0.1))
    return Group(group_id=gid, prompt_index=seed, epoch=0, engine_rank=0,
                 prompt_ids=rng.integers(0, vocab, size=PROMPT_LEN).astype(np.int32), ground_truth="0",
                 data_source="gpu_smoke", samples=tuple(samples), created_at=time.time(), admitted_version=0)


def build_model(path: Path, shape: dict, device: str) -> dict[str, Any]:
    """A randomly initialised Qwen2 of ``shape`` saved as bf16 safetensors (config.json alongside)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"params": params, "bf16_bytes": 2 * params, **{k: v for k, v in shape.items()}}


def make_config(model_dir: Path, device: str, param_dtype: str, preset: dict, backend: str):
    """Defaults plus what the smoke test needs; one mini-batch per group, so a step of two groups makes two
    optimizer updates (the second one's proximal pass included)."""
    return common.load_config(None, [
        "model.bootstrap=null", f"model.path={model_dir}",
        f"learner.param_dtype={param_dtype}", "learner.activation_checkpointing=true",
        f"placement.learner_gpus={1 if device == 'cuda' else 0}",
        "algorithm.train_batch_groups=2", "learner.mini_batch_groups=1", f"rollout.n={preset['group']}",
        f"learner.micro_batch_tokens={preset['micro_batch_tokens']}",
        "learner.collective_timeout_s=120",
        f"weight_sync.bucket_mb={preset['bucket_mb']}", f"weight_sync.backend={backend}",
        "weight_sync.timeout_s=60",
    ])


def new_worker(cfg):
    from async_dapo.learner.rank import LearnerWorker
    from async_dapo.weights.sync import free_port

    return LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())


def stop_worker(worker, device: str) -> None:
    """Shut the worker down (destroys its process groups) and free its memory: the caller must hold no
    other reference to it."""
    if worker is None:
        return
    try:
        worker.shutdown()
    finally:
        del worker
        free_memory(device)


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def full(p):
    """The whole tensor of a (possibly sharded) parameter."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _bits(t) -> int:
    import torch

    # fp32 parameters and AdamW states are taken bit for bit; the step counter is a small whole number.
    return int(full(t).detach().float().contiguous().view(torch.int32).sum(dtype=torch.int64).item())


def fingerprint(worker) -> dict[str, list[int]]:
    """Bit-level fingerprints of the training state: per parameter, and per AdamW state tensor, the integer
    sum of its fp32 bit patterns (exact and order-free: equal iff the bits are, up to changes that cancel
    exactly in the sum)."""
    import torch

    with torch.no_grad():
        params = [p for _, p in worker.model.named_parameters()]
        optim = [_bits(v) for p in params for k, v in sorted(worker.optimizer.state.get(p, {}).items())
                 if isinstance(v, torch.Tensor)]
        return {"params": [_bits(p) for p in params], "optimizer": optim}


@contextlib.contextmanager
def deterministic(warn_only: bool = False):
    """Deterministic kernels (strict: flash/memory-efficient attention backward included; cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG, set before CUDA starts): the same step from the same state must give the same
    bits, so that a difference can only come from the checkpoint."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def next_step(worker, groups, mode: dict[str, Any], ckpt: Path) -> dict[str, float]:
    """``train_step`` under deterministic kernels: strict, unless an op of the step has no deterministic
    implementation (then the worker is put back to the checkpoint and the step runs warn-only, where
    attention's backward may reorder its sums: a differing next step then need not be the checkpoint's
    fault, and the state_* comparisons still judge the checkpoint)."""
    try:
        with deterministic(warn_only=mode.get("warn_only", False)):
            return worker.train_step(groups)
    except RuntimeError as exc:
        if "determinis" not in str(exc) or mode.get("warn_only"):
            raise
        mode.update(warn_only=True, strict_error=str(exc)[:1000])
        worker.load_checkpoint(str(ckpt))
        with deterministic(warn_only=True):
            return worker.train_step(groups)


# ------------------------------------------------------------------------------------------ checks
def check_startup(report: Report, cfg, device: str):
    import torch

    c = report.check("startup")
    if device == "cuda":
        c["cuda_memory_allocated_before_bytes"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    worker = new_worker(cfg)
    c["construct_s"] = round(time.perf_counter() - t0, 3)
    if device == "cuda":
        torch.cuda.synchronize()
        c.update(cuda_memory_allocated_bytes=torch.cuda.memory_allocated(),
                 cuda_max_memory_allocated_bytes=torch.cuda.max_memory_allocated(),
                 cuda_memory_reserved_bytes=torch.cuda.memory_reserved())
    c.update(host_memory())
    c["ok"] = True
    return worker


def flat_cosine(a: dict, b: dict, device: str) -> dict[str, Any]:
    import torch

    keys = sorted(a)
    if sorted(b) != keys:
        raise RuntimeError(f"gradient names differ: {sorted(set(a) ^ set(b))[:5]}")
    dot = na = nb = 0.0
    max_diff = max_fp32 = 0.0
    worst = (2.0, "")
    dev = "cuda" if device == "cuda" else "cpu"
    for k in keys:
        x, y = a[k].to(dev, torch.float64).reshape(-1), b[k].to(dev, torch.float64).reshape(-1)
        xy, xx, yy = (x @ y).item(), (x @ x).item(), (y @ y).item()
        dot, na, nb = dot + xy, na + xx, nb + yy
        max_diff = max(max_diff, (x - y).abs().max().item() if x.numel() else 0.0)
        max_fp32 = max(max_fp32, y.abs().max().item() if y.numel() else 0.0)
        if xx > 0 and yy > 0:
            worst = min(worst, (xy / math.sqrt(xx * yy), k))
    cos = dot / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")
    return {"cosine": cos, "norm_bf16": math.sqrt(na), "norm_fp32": math.sqrt(nb),
            "norm_ratio_bf16_over_fp32": math.sqrt(na / nb) if nb > 0 else float("nan"),
            "worst_tensor_cosine": worst[0], "worst_tensor": worst[1], "tensors": len(keys),
            "max_abs_diff": max_diff, "max_abs_fp32": max_fp32}


def check_memory(report: Report, worker, base_cfg, preset: dict, device: str, vocab: int) -> None:
    import torch

    c = report.check("memory")
    meter = PeakMeter(device)
    c.update(method=meter.method, group_size=preset["group"], logprob={}, train={})
    small = [make_group("warm", preset["lengths"][0], preset["group"], vocab, seed=100)]
    worker.cfg = base_cfg.model_copy(update={"learner": base_cfg.learner.model_copy(
        update={"micro_batch_tokens": preset["lengths"][0]})})
    t0 = time.perf_counter()
    worker.train_step(small)  # AdamW's states exist from here on: the measured steps see only activations
    c["warmup_step_s"] = round(time.perf_counter() - t0, 3)
    errors = []
    for i, length in enumerate(preset["lengths"]):
        key = str(length)
        worker.cfg = base_cfg.model_copy(update={"learner": base_cfg.learner.model_copy(
            update={"micro_batch_tokens": length})})
        groups = [make_group(f"mem{length}", length, preset["group"], vocab, seed=200 + i)]
        for kind in ("logprob", "train"):
            entry: dict[str, Any] = {"tokens_per_sample": length, "samples": preset["group"]}
            c[kind][key] = entry
            try:
                plan = worker.plan(groups)
                mbs = [mb for p in plan for mb in p.micro_batches]
                entry["micro_batches"] = len(mbs)
                entry["micro_batch_tokens"] = max(mb.input_ids.numel() for mb in mbs)
                if kind == "logprob":
                    worker.model.train()  # the mode the learner's proximal pass runs in
                    with meter.measure(entry), torch.no_grad():
                        for mb in mbs:
                            worker.logprobs(mb)
                else:
                    del plan, mbs
                    with meter.measure(entry):
                        stats = worker.train_step(groups)
                    entry.update(train_tokens=stats.get("train_tokens"), loss=stats.get("loss"),
                                 grad_norm=stats.get("grad_norm_max"), step_s=stats.get("train_s"))
                entry["bytes_per_token"] = entry["delta_bytes"] / entry["micro_batch_tokens"]
                print(f"[gpu_smoke]   {kind} {length}: {entry['delta_bytes'] / 2**20:.1f} MiB above baseline, "
                      f"{entry['bytes_per_token'] / 1024:.1f} KiB/token, {entry['seconds']:.2f} s", flush=True)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                errors.append(f"{kind} {length}: {type(exc).__name__}")
                print(f"[gpu_smoke]   {kind} {length} FAILED: {entry['error'][:300]}", flush=True)
                if device == "cuda":
                    gc.collect()
                    torch.cuda.empty_cache()
    worker.cfg = base_cfg
    c["fit"] = {}
    for kind in ("logprob", "train"):  # delta = intercept + slope * tokens, least squares over the lengths
        pts = [(e["micro_batch_tokens"], e["delta_bytes"]) for e in c[kind].values() if "delta_bytes" in e]
        if len(pts) >= 2:
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx) ** 2 for x, _ in pts)
            slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")
            c["fit"][kind] = {"slope_bytes_per_token": slope, "intercept_bytes": my - slope * mx}
    values = [e.get("bytes_per_token") for kind in ("logprob", "train") for e in c[kind].values()]
    c["ok"] = not errors and all(v is not None and v > 0 for v in values)
    if errors:
        c["error"] = "; ".join(errors)
    elif not c["ok"]:
        c["error"] = "a memory-per-token value is not > 0"


def push_receiver(addr: str, port: int, name: str, backend: str, timeout_s: float, plan: list, expected: str,
                  result: str, device: str, forbid: bool) -> None:
    """Rank 1 of the weight-update group, standing in for an SGLang engine: one flat uint8 broadcast per
    bucket, split like SGLang's flattened_bucket, compared byte for byte with ``expected``."""
    if forbid:
        sys.meta_path.insert(0, ForbidImports())
    import hashlib

    out: dict[str, Any] = {"ok": False, "buckets": 0, "tensors": 0, "bytes": 0, "mismatched": [], "missing": []}
    digest = hashlib.sha256()  # over every received byte, in plan order: the driver hashes what it expects
    t0 = time.perf_counter()
    try:
        import torch
        import torch.distributed as dist
        from safetensors.torch import load_file

        from async_dapo.weights.sync import close_update_group, open_update_group

        torch.set_num_threads(1)
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        want = load_file(expected)
        pg = open_update_group(addr, port, 2, name, backend, timeout_s, rank=1)
        out["joined_s"] = round(time.perf_counter() - t0, 3)
        seen = set()
        for names, dtypes, shapes in plan:
            # FlattenedTensorBucket.empty: byte offsets in plan order, each aligned to its dtype's itemsize.
            meta, offset = [], 0
            for n, d, s in zip(names, dtypes, shapes, strict=True):
                dtype = getattr(torch, d)
                if offset % dtype.itemsize:
                    raise ValueError(f"unaligned tensor {n}: byte offset {offset}, dtype {d}")
                size = math.prod(s) * dtype.itemsize
                meta.append((n, dtype, torch.Size(s), offset, offset + size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=pg)
            out["buckets"] += 1
            out["bytes"] += offset
            flat = flat.cpu()
            digest.update(flat.numpy().tobytes())
            for n, dtype, shape, start, end in meta:  # FlattenedTensorBucket.reconstruct_tensors
                got = flat[start:end].view(dtype).reshape(shape)
                out["tensors"] += 1
                seen.add(n)
                ref = want.get(n)
                if ref is None or ref.dtype != dtype or ref.shape != shape or not torch.equal(
                        got.view(torch.uint8), ref.contiguous().view(torch.uint8)):
                    out["mismatched"].append(n)
        out["missing"] = sorted(set(want) - seen)
        out["ok"] = not out["mismatched"] and not out["missing"] and out["buckets"] == len(plan)
        with contextlib.suppress(Exception):
            close_update_group(pg)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out["sha256"] = digest.hexdigest()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["mismatched"] = out["mismatched"][:20]
    Path(result).write_text(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the result is written; skip a teardown that can abort in gloo's threads after a timeout


def check_push(report: Report, worker, cfg, device: str, work: Path, watchdog: Watchdog, forbid: bool) -> None:
    import hashlib
    import multiprocessing as mp

    import torch
    from safetensors.torch import save_file

    from async_dapo.learner.rank import sglang_name
    from async_dapo.weights.sync import free_port, plan_buckets

    c = report.check("weight_push")
    dtype = torch.bfloat16
    ngpu = torch.cuda.device_count() if device == "cuda" else 0
    backend = "nccl" if ngpu >= 2 else "gloo"
    recv_device = "cuda:1" if backend == "nccl" else "cpu"
    if cfg.weight_sync.backend != backend:
        raise RuntimeError(f"config weight_sync.backend {cfg.weight_sync.backend} != {backend}")
    named = list(worker.model.named_parameters())
    buckets = plan_buckets([(sglang_name(n), dtype, tuple(p.shape)) for n, p in named],
                           cfg.weight_sync.bucket_mb << 20)
    plan = [(list(b.names), list(b.dtypes), [list(s) for s in b.shapes]) for b in buckets]
    if backend == "gloo" and device == "cuda":
        c["backend_note"] = ("one GPU: NCCL refuses two ranks on the same device ('Duplicate GPU detected'), so "
                             "the weight group is gloo (CUDA tensors on the learner side)")
    c.update(backend=backend, receiver_device=recv_device, dtype="bfloat16", buckets=len(buckets),
             tensors=sum(len(b.names) for b in buckets),
             plan_bytes=sum(b.nbytes for b in buckets), bucket_mb=cfg.weight_sync.bucket_mb)
    t0 = time.perf_counter()
    with torch.no_grad():
        expected = {sglang_name(n): full(p).detach().to(dtype).cpu().contiguous() for n, p in named}
    digest = hashlib.sha256()  # the learner's weights as the receiver must see them: plan order, back to back
    for names, _, _ in plan:
        for n in names:
            digest.update(expected[n].view(torch.uint8).numpy().tobytes())
    c["expected_sha256"] = digest.hexdigest()
    expected_path, result_path = work / "expected_weights.safetensors", work / "push_result.json"
    save_file(expected, str(expected_path))
    del expected
    c["expected_write_s"] = round(time.perf_counter() - t0, 3)

    timeout = cfg.weight_sync.timeout_s
    port = free_port()
    proc = mp.get_context("spawn").Process(
        target=push_receiver, daemon=True,
        args=("127.0.0.1", port, GROUP_NAME, backend, timeout, plan, str(expected_path), str(result_path),
              recv_device, forbid))
    proc.start()
    watchdog.children.append(proc)
    pushed = False
    try:
        t0 = time.perf_counter()
        try:
            worker.open_weight_group("127.0.0.1", port, 2, GROUP_NAME, dtype="bfloat16")
            c["dtype_argument"] = True
        except TypeError as exc:  # the API the brief asks for is not there (yet): say so, still test the bytes
            c["dtype_argument"] = False
            c["api_error"] = f"open_weight_group(..., dtype='bfloat16'): {exc}"
            worker.open_weight_group("127.0.0.1", port, 2, GROUP_NAME)
        c["open_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        version = int(worker.version)
        c["learner_push"] = worker.push_weights([], None, version)
        c["push_call_s"] = round(time.perf_counter() - t0, 3)
        c["wait_push_s"] = round(worker.wait_push(), 3)
        c["push_total_s"] = round(time.perf_counter() - t0, 3)
        c["last_push"] = worker.last_push()
        pushed = True
    finally:
        # After a clean push the receiver only has its comparison left; after a failed one it may sit in a
        # broadcast that never comes (until the group's timeout): do not wait for that.
        proc.join(timeout=timeout + 30 if pushed else 5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
            c["receiver_killed"] = True
        c["receiver_exitcode"] = proc.exitcode
        with contextlib.suppress(Exception):
            worker.close_weight_group()
        recv = json.loads(result_path.read_text()) if result_path.exists() else {"error": "receiver wrote no result"}
        c["receiver"] = recv
        expected_path.unlink(missing_ok=True)
    c["byte_identical"] = bool(recv.get("ok"))
    problems = []
    if not recv.get("ok"):
        problems.append(f"receiver: {recv.get('error') or 'bytes differ'} (mismatched {recv.get('mismatched')}, "
                        f"missing {recv.get('missing', [])[:5]})")
    if len(buckets) < 2:
        problems.append(f"only {len(buckets)} bucket(s); the check needs >= 2")
    if c["last_push"].get("error"):
        problems.append(f"learner's push: {c['last_push']['error']}")
    if not c["dtype_argument"]:
        problems.append(c["api_error"])
    c["ok"] = not problems
    c["error"] = "; ".join(problems) or None


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": device, "hostname": platform.node(),
           "cpus": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   gpu_memory_bytes=props.total_memory, sm=f"{props.major}.{props.minor}")
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_smoke/gpu_smoke.json"))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen2 and short samples (the CPU test's preset)")
    ap.add_argument("--work-dir", type=Path, default=None, help="scratch (model, checkpoint); default a temp dir")
    ap.add_argument("--deadline-s", type=float, default=None, help="watchdog: write the JSON and exit 2 after this")
    ap.add_argument("--forbid-imports", action="store_true", help="make importing ray/zmq/sglang fail (and record it)")
    args = ap.parse_args(argv)

    blocker = None
    if args.forbid_imports:
        blocker = ForbidImports()
        sys.meta_path.insert(0, blocker)
    preset = PRESETS["tiny" if args.tiny else "full"]
    report = Report(args.out, {"ok": False, "argv": sys.argv[1:], "preset": "tiny" if args.tiny else "full",
                               "lengths": preset["lengths"], "group_size": preset["group"]})
    watchdog = Watchdog(report, args.deadline_s or preset["deadline_s"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.device == "cpu":
        _return_large_blocks_to_os()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_smoke_"))
    work.mkdir(parents=True, exist_ok=True)
    device = args.device
    workers: dict[str, Any] = {}
    try:
        with report.phase_timer("environment"):
            import torch

            if device == "cuda" and not torch.cuda.is_available():
                raise SystemExit("gpu_smoke: --device cuda but torch sees no GPU (use --device cpu --tiny)")
            torch.set_num_threads(1 if device == "cpu" else min(8, os.cpu_count() or 1))
            report.data["environment"] = environment(device)
            import async_dapo.learner.rank  # noqa: F401  (an import failure here fails every check below)

        ngpu = torch.cuda.device_count() if device == "cuda" else 0
        backend = "nccl" if ngpu >= 2 else "gloo"
        model_dir = work / "model"
        with report.phase_timer("build_model"):
            report.data["model"] = build_model(model_dir, preset["shape"], device)
            free_memory(device)
        vocab = preset["shape"]["vocab_size"]
        bf16 = make_config(model_dir, device, "bfloat16", preset, backend)
        fp32 = make_config(model_dir, device, "float32", preset, backend)
        report.data["config"] = {"param_dtype": "bfloat16", "activation_checkpointing": True,
                                 "weight_sync.bucket_mb": preset["bucket_mb"], "weight_sync.backend": backend,
                                 "learner.micro_batch_tokens": preset["micro_batch_tokens"],
                                 "learner.mini_batch_groups": 1}
        cos_groups = [make_group("cos", preset["small_len"], preset["group"], vocab, seed=1)]
        dcp_a = [make_group(f"a{i}", preset["small_len"], preset["group"], vocab, seed=10 + i) for i in range(2)]
        dcp_b = [make_group(f"b{i}", preset["small_len"], preset["group"], vocab, seed=20 + i) for i in range(2)]
        ckpt = work / "ckpt"
        det_mode: dict[str, Any] = {}
        grads_bf16 = None
        dcp_expected: dict[str, Any] | None = None

        with report.phase_timer("startup"):
            try:
                workers["A"] = check_startup(report, bf16, device)
            except Exception as exc:
                report.fail("startup", exc)
        a = workers.get("A")

        with report.guarded("grad_bf16", "grad_cosine", a):
            grads_bf16 = a.gradients(cos_groups)

        with report.guarded("memory", "memory", a):
            check_memory(report, a, bf16, preset, device, vocab)

        with report.guarded("dcp_save", "dcp_resume", a):
            a.cfg = bf16
            a.train_step(dcp_a)
            t0 = time.perf_counter()
            a.save_checkpoint(str(ckpt))
            save_s = time.perf_counter() - t0
            saved = {"saved_version": a.version, "state": fingerprint(a)}
            stats = next_step(a, dcp_b, det_mode, ckpt)
            dcp_expected = {**saved, "loss": stats["loss"], "grad_norm": stats["grad_norm_max"],
                            "version": stats["version"], "next_state": fingerprint(a), "save_s": save_s}

        with report.guarded("weight_push", "weight_push", a):
            check_push(report, a, bf16, device, work, watchdog, args.forbid_imports)

        with report.phase_timer("stop_A"):
            a = None
            with contextlib.suppress(Exception):
                stop_worker(workers.pop("A", None), device)

        with report.phase_timer("grad_fp32"):
            try:
                if grads_bf16 is None:
                    raise RuntimeError("no bf16 gradient to compare with")
                workers["B"] = new_worker(fp32)
                grads_fp32 = workers["B"].gradients(cos_groups)
                stop_worker(workers.pop("B"), device)
                c = report.check("grad_cosine")
                c.update(flat_cosine(grads_bf16, grads_fp32, device), threshold=COSINE_MIN,
                         tokens=preset["small_len"] * preset["group"])
                c["ok"] = c["cosine"] > COSINE_MIN
                if not c["ok"]:
                    c["error"] = f"cosine {c['cosine']:.6f} <= {COSINE_MIN}"
                del grads_bf16, grads_fp32
            except Exception as exc:
                report.fail("grad_cosine", exc)
                with contextlib.suppress(Exception):  # the next worker needs the process group gone
                    stop_worker(workers.pop("B", None), device)

        with report.phase_timer("dcp_load"):
            try:
                if dcp_expected is None:
                    raise RuntimeError("the save half did not complete")
                workers["C"] = new_worker(bf16)
                w = workers["C"]
                t0 = time.perf_counter()
                loaded = w.load_checkpoint(str(ckpt))
                load_s = time.perf_counter() - t0
                state = fingerprint(w)
                stats = next_step(w, dcp_b, det_mode, ckpt)
                got = {"loss": stats["loss"], "grad_norm": stats["grad_norm_max"], "version": stats["version"],
                       "next_state": fingerprint(w)}
                w = None
                stop_worker(workers.pop("C"), device)
                c = report.check("dcp_resume")
                # state_*: the checkpoint itself (no kernel determinism involved); the rest: the next step.
                same = {"loaded_version": loaded == dcp_expected["saved_version"],
                        "state_params": state["params"] == dcp_expected["state"]["params"],
                        "state_optimizer": state["optimizer"] == dcp_expected["state"]["optimizer"],
                        **{k: got[k] == dcp_expected[k] for k in ("loss", "grad_norm", "version")},
                        "next_params": got["next_state"]["params"] == dcp_expected["next_state"]["params"],
                        "next_optimizer": got["next_state"]["optimizer"] == dcp_expected["next_state"]["optimizer"]}
                c.update(identical=same, loss_saved_run=dcp_expected["loss"], loss_resumed=got["loss"],
                         grad_norm_saved_run=dcp_expected["grad_norm"], grad_norm_resumed=got["grad_norm"],
                         version=got["version"], saved_version=dcp_expected["saved_version"],
                         optimizer_tensors=len(state["optimizer"]),
                         # the fingerprints compared above, so a reader can check them without the flags
                         state_saved_run=dcp_expected["state"], state_resumed=state,
                         next_state_saved_run=dcp_expected["next_state"], next_state_resumed=got["next_state"],
                         deterministic_algorithms="warn_only" if det_mode.get("warn_only") else "strict",
                         strict_error=det_mode.get("strict_error"),
                         save_s=round(dcp_expected["save_s"], 3), load_s=round(load_s, 3),
                         checkpoint_bytes=sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()))
                c["ok"] = all(same.values()) and len(state["optimizer"]) > 0
                if not c["ok"]:
                    c["error"] = f"resumed state or step differs: {[k for k, v in same.items() if not v]}"
            except Exception as exc:
                report.fail("dcp_resume", exc)
                w = None
                with contextlib.suppress(Exception):
                    stop_worker(workers.pop("C", None), device)

        c = report.check("imports")
        c["loaded"] = forbidden_loaded()
        c["attempts"] = blocker.attempts if blocker else []
        c["blocked"] = bool(blocker)
        c["ok"] = not c["loaded"] and not c["attempts"]
        if not c["ok"]:
            c["error"] = f"imported or tried: {c['loaded'] or [x['module'] for x in c['attempts']]}"
    except SystemExit as exc:
        report.data["error"] = str(exc)
    except Exception as exc:
        report.data["error"] = f"{type(exc).__name__}: {exc}"
        report.data["traceback"] = traceback.format_exc(limit=12)
    finally:
        for key in list(workers):
            with contextlib.suppress(Exception):
                stop_worker(workers.pop(key), device)
        if args.work_dir is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    checks = report.data["checks"]
    expected_checks = ("startup", "grad_cosine", "memory", "dcp_resume", "weight_push", "imports")
    report.data["failed"] = [k for k in expected_checks if not checks.get(k, {}).get("ok")]
    report.data["ok"] = not report.data["failed"] and "error" not in report.data
    report.data["wall_s"] = round(time.perf_counter() - T0, 3)
    watchdog.cancel()
    report.write()
    print(f"[gpu_smoke] {'PASS' if report.data['ok'] else 'FAIL ' + str(report.data['failed'])} in "
          f"{report.data['wall_s']:.1f} s -> {args.out}", flush=True)
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
