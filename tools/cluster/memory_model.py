"""Per-GPU memory model of the FSDP2 learner and the SGLang engines, for a run config (docs/memory.md).

    python tools/cluster/memory_model.py configs/dapo_qwen2.5_32b_16x8.yaml configs/qwen2.5_7b_1x8.yaml
    python tools/cluster/memory_model.py CONFIG --shape Qwen2.5-7B --set learner.micro_batch_tokens=8192

Pure arithmetic (no torch, no GPU): every term is bytes on one GPU, written as a formula of the model
shape (``SHAPES``, keyed by the basename of ``model.path``; ``--shape`` overrides) and the config. Units:
GiB = 2^30 bytes. It prints one markdown report per config: the learner's terms, its peak per phase,
the engine's terms and KV-cache capacity, and for 80 GB and 141 GB GPUs whether each fits and the
largest ``learner.micro_batch_tokens`` that fits.

Learner (one rank; the rank-0 figures, which carry the push's extra buckets). N = micro_batch_tokens
(padded tokens of a micro-batch), W = placement.learner_ranks, c = bytes of the compute dtype (2 for
learner.param_dtype bfloat16, 4 for float32), P = parameters, P_layer / P_root = parameters of one decoder
layer / of the root FSDP unit (embedding, lm_head unless tied, final norm). What is on the GPU:

* always: fp32 master weights, fp32 gradients and AdamW's two fp32 states, all sharded (16 P / W); the
  weight push of the previous version, which runs beside the step (snapshot + gather/broadcast buffers);
  the NCCL communicators (estimate); the step's micro-batches, moved to the device at the start.
* one of four phases at a time; the peak is the largest phase:
  - loss head (end of a micro-batch's forward, start of its backward): every decoder layer's
    checkpointed input, the final norm, the bf16 logits of T-1 positions and their bf16 gradient, the
    chunked log-prob work (budget 4 fp32 chunks), the root unit's unsharded bf16 parameters (FSDP2
    does not reshard the root after forward), two layers' unsharded parameters;
  - layer backward (the first layer to be recomputed, when every checkpoint is still alive): the
    checkpoints, one layer's recomputed activations plus the gradients in flight, the layer unit's FSDP
    buffers (current and prefetched bf16 parameters, the prefetch's all-gather buffer, bf16 gradients,
    the fp32 reduce-scatter input), the root's parameters and its lm_head gradient (reduced only when
    the root's backward ends);
  - root reduce (end of backward): root parameters, their gradients and the fp32 reduce-scatter input;
  - optimizer step: AdamW's foreach temporary (one fp32 shard-sized tensor).

The layer's activation estimate, per token, bytes (HF Qwen2 with SDPA, activation checkpointing):
two RMSNorms keep their fp32 input and their output (2 x (4h + c h)); attention keeps q, k and v repeated
to all heads (a padded micro-batch passes a mask, and then transformers repeats k/v instead of SDPA's
GQA), the SDPA output and its contiguous copy for o_proj (5 c q_dim), the fp32 logsumexp (4 heads); the
MLP's peak is at the backward of gate*up: silu's input, silu(gate), up and three gradients of size I
(6 c I); two residual-stream gradients (2 c h). For bf16 and q_dim = h: 26 h + 12 I + 4 heads.
A micro-batch of several rows of different lengths also gets a [rows, 1, T, T] boolean mask (kept for the
micro-batch) that SDPA converts to the compute dtype for the layer it runs: rows x T^2 <= N x T with
T <= min(longest sample, N / 2).

Engines (one GPU of a TP group): bf16 weights / TP; SGLang sizes the KV cache to
mem_fraction_static x GPU minus what is already used when it measures (weights, CUDA context, its TP
communicator); KV bytes per token per GPU = 2 (K, V) x layers x kv_heads/TP (at least 1) x head_dim x
dtype bytes. Outside the static pool: CUDA graphs, activations, the weight-update communicator and the
received bucket.

Safety margin: a GPU's budget is 90 % of its memory (allocator fragmentation and caching) minus 1 GiB
(CUDA context, cuBLAS workspace). The NCCL figure is an estimate nobody measured here (1 GiB per
communicator; NVLS on NVSwitch nodes can take more, NCCL_NVLS_ENABLE=0 takes less).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: common.py
import common  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
# Total memory as nvidia-smi reports it: H100 SXM 80GB 81,559 MiB; H200 141GB 143,771 MiB.
GPUS = {"80 GB": 81_559 * MIB, "141 GB": 143_771 * MIB}
ALLOCATOR_MARGIN = 0.10  # fraction of the GPU kept free for fragmentation / the caching allocator
CUDA_CONTEXT = 1 * GIB  # CUDA context + cuBLAS/cuDNN workspaces, per process
NCCL_PER_COMM = 1 * GIB  # estimate per NCCL communicator (buffers; not measured here)
LOGPROB_CHUNKS = 4  # fp32 chunks of token_logprobs / entropy work (measured 2 fp32, 3-3.6 bf16 views)
STEP_BATCH_BYTES_PER_TOKEN = 45  # MicroBatch tensors on the device (int64 x3, bool, fp32 x2, int64) + prox fp32


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer of the Qwen2 family (q/k/v biases, SwiGLU MLP, RMSNorm)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool  # lm_head shares the embedding
    qkv_bias: bool = True

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen2.5-7B config.json: vocab_size 152064, hidden_size 3584, num_hidden_layers 28,
    # num_attention_heads 28, num_key_value_heads 4 (head_dim 3584 / 28 = 128), intermediate_size 18944,
    # tie_word_embeddings false. 7.62B parameters.
    "Qwen2.5-7B": ModelShape(152064, 3584, 28, 28, 4, 128, 18944, tied=False),
    # Qwen/Qwen2.5-32B config.json: vocab_size 152064, hidden_size 5120, num_hidden_layers 64,
    # num_attention_heads 40, num_key_value_heads 8 (head_dim 128), intermediate_size 27648,
    # tie_word_embeddings false. 32.76B parameters.
    "Qwen2.5-32B": ModelShape(152064, 5120, 64, 40, 8, 128, 27648, tied=False),
    # Qwen/Qwen2.5-0.5B (tools/gpu/gpu_smoke.py's shape): vocab_size 151936, hidden_size 896, 24 layers,
    # 14 heads, 2 kv heads (head_dim 64), intermediate_size 4864, tied embeddings. 494M parameters.
    "Qwen2.5-0.5B": ModelShape(151936, 896, 24, 14, 2, 64, 4864, tied=True),
}


# ------------------------------------------------------------------------------------------- shapes
def layer_params(s: ModelShape) -> int:
    """One decoder layer: q/k/v (with biases), o_proj (no bias), gate/up/down, two RMSNorm weights."""
    h, q, kv, i = s.hidden, s.q_dim, s.kv_dim, s.intermediate
    bias = (q + 2 * kv) if s.qkv_bias else 0
    return h * q + 2 * h * kv + bias + q * h + 3 * h * i + 2 * h


def root_params(s: ModelShape) -> int:
    """The root FSDP unit: embedding, lm_head (unless tied), final norm."""
    return s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden


def param_count(s: ModelShape) -> int:
    return s.layers * layer_params(s) + root_params(s)


def largest_tensor(s: ModelShape) -> int:
    """Elements of the largest single parameter (the embedding / lm_head, or an MLP matrix)."""
    return max(s.vocab * s.hidden, s.hidden * s.intermediate, s.hidden * s.q_dim)


def kv_heads_per_gpu(s: ModelShape, tp: int) -> int:
    """KV heads one TP rank holds: split when kv_heads >= tp, otherwise replicated (one per rank)."""
    return max(1, s.kv_heads // tp)


def kv_bytes_per_token(s: ModelShape, tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU of the TP group: K and V, every layer."""
    return 2 * s.layers * kv_heads_per_gpu(s, tp) * s.head_dim * dtype_bytes


def layer_activation_bytes_per_token(s: ModelShape, c: int) -> int:
    """One recomputed decoder layer at the peak of its backward, bytes per token (see module doc)."""
    h, q, i = s.hidden, s.q_dim, s.intermediate
    norms = 2 * (4 * h + c * h)
    attention = c * 5 * q + 4 * s.heads
    mlp = c * 6 * i
    residual_grads = c * 2 * h
    return norms + attention + mlp + residual_grads


# ------------------------------------------------------------------------------------------- setups
@dataclasses.dataclass(frozen=True)
class LearnerSetup:
    world: int
    compute_bytes: int  # c: 2 (bf16 MixedPrecisionPolicy) or 4 (fp32)
    micro_batch_tokens: int
    chunk_tokens: int
    max_seq_len: int  # max_prompt_length + max_response_length
    seqs_per_rank_step: int  # samples of one training step on one rank
    bucket_bytes: int
    push_bytes: int  # engine dtype itemsize (snapshot and gather)
    cpu_offload: bool = False
    nccl_comms: int = 3  # default group, the push's gather group, rank 0's weight-update group

    @classmethod
    def from_config(cls, cfg: Any) -> "LearnerSetup":
        lc, ro, pl = cfg.learner, cfg.rollout, cfg.placement
        on_gpu = pl.learner_gpus > 0
        engine = ro.engine.dtype if ro.engine.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
        backend = cfg.weight_sync.backend
        weight_nccl = backend == "nccl" or (backend == "auto" and on_gpu)
        return cls(
            world=pl.learner_ranks,
            compute_bytes=2 if lc.param_dtype == "bfloat16" else 4,
            micro_batch_tokens=lc.micro_batch_tokens,
            chunk_tokens=lc.logprob_chunk_tokens,
            max_seq_len=cfg.data.max_prompt_length + ro.max_response_length,
            seqs_per_rank_step=math.ceil(cfg.algorithm.train_batch_groups * ro.n / pl.learner_ranks),
            bucket_bytes=cfg.weight_sync.bucket_mb * MIB,
            push_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[engine],
            cpu_offload=lc.cpu_offload,
            nccl_comms=(2 + (1 if weight_nccl else 0)) if on_gpu else 0,
        )


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    tp: int
    mem_fraction_static: float
    dtype_bytes: int
    max_total_tokens: int | None
    concurrent_seqs: int  # rollout.max_inflight_prompts x rollout.n (one engine)
    max_seq_len: int
    num_engines: int
    bucket_bytes: int

    @classmethod
    def from_config(cls, cfg: Any) -> "EngineSetup":
        ro, eng = cfg.rollout, cfg.rollout.engine
        dtype = eng.dtype if eng.dtype != "auto" else "bfloat16"
        return cls(
            tp=eng.tp_size,
            mem_fraction_static=eng.mem_fraction_static,
            dtype_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[dtype],
            max_total_tokens=eng.max_total_tokens,
            concurrent_seqs=ro.max_inflight_prompts * ro.n,
            max_seq_len=cfg.data.max_prompt_length + ro.max_response_length,
            num_engines=cfg.placement.num_engines,
            bucket_bytes=cfg.weight_sync.bucket_mb * MIB,
        )


# ------------------------------------------------------------------------------------------- learner
@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    formula: str
    bytes: float
    phase: str  # "always" or one of PHASES


PHASES = ("loss head", "layer backward", "root reduce", "optimizer step")


def mask_row_len(setup: LearnerSetup, tokens: int) -> int:
    """Longest row of a micro-batch that has a padding mask (>= 2 rows): min(longest sample, N / 2)."""
    return min(setup.max_seq_len, tokens // 2)


def push_buffers(s: ModelShape, setup: LearnerSetup, rank0: bool = True) -> float:
    """Gather/broadcast buffers of the push on one rank (async_dapo.weights.sync.WeightSender._gather_and_broadcast).

    A bucket holds up to bucket_bytes; a larger tensor gets a bucket of its own (B_max). A multi-tensor
    bucket is gathered into [W, S] and unpad copies it out (2 x bucket while unpadding); a single-tensor
    bucket is a view. Rank 0 also keeps the previous bucket's gathered tensors and its flat copy (being
    broadcast) while gathering the next: 2 B_max + max(2 bucket, B_max). Other ranks: the previous
    tensors and the new gather. World 1: no gather, two flat copies."""
    b_max = max(setup.bucket_bytes, largest_tensor(s) * setup.push_bytes)
    gather_new = max(2 * setup.bucket_bytes, b_max)
    if setup.world == 1:
        return 2 * b_max if rank0 else 0.0
    held = 2 * b_max if rank0 else b_max
    return held + gather_new + b_max / setup.world


def learner_terms(s: ModelShape, setup: LearnerSetup, tokens: int | None = None) -> list[Term]:
    """Every term of one learner GPU (rank 0) at ``tokens`` micro-batch tokens (default: the config's)."""
    n = setup.micro_batch_tokens if tokens is None else tokens
    c, w = setup.compute_bytes, setup.world
    p, pl, pr = param_count(s), layer_params(s), root_params(s)
    h, v, L = s.hidden, s.vocab, s.layers
    states = 0 if setup.cpu_offload else 1
    t_mask = mask_row_len(setup, n)
    chunk = min(setup.chunk_tokens, n)
    return [
        Term("fp32 master weights (sharded)", "4 P / W", states * 4 * p / w, "always"),
        Term("fp32 gradients (sharded)", "4 P / W", states * 4 * p / w, "always"),
        Term("AdamW exp_avg + exp_avg_sq (sharded)", "8 P / W", states * 8 * p / w, "always"),
        Term("push snapshot (engine dtype)", "e P / W", setup.push_bytes * p / w, "always"),
        Term("push gather/broadcast buffers, rank 0", "2 B_max + max(2 bucket, B_max) + B_max / W",
             push_buffers(s, setup), "always"),
        Term("NCCL communicators (estimate)", f"{setup.nccl_comms} x 1 GiB", setup.nccl_comms * NCCL_PER_COMM,
             "always"),
        Term("step's micro-batches on the device", "45 x seqs/rank x max_len",
             STEP_BATCH_BYTES_PER_TOKEN * setup.seqs_per_rank_step * setup.max_seq_len, "always"),
        # loss head
        Term("checkpointed layer inputs", "L x c h x N", L * c * h * n, "loss head"),
        Term("final norm + lm_head input", "(4h + 2c h) x N", (4 * h + 2 * c * h) * n, "loss head"),
        Term("logits, T-1 positions", "c V x N", c * v * n, "loss head"),
        Term("logits gradient", "c V x N", c * v * n, "loss head"),
        Term("log-prob chunks (fp32)", "4 x 4 V x chunk", LOGPROB_CHUNKS * 4 * v * chunk, "loss head"),
        Term("rotary cos/sin + position ids", "(2c hd + 8) x N", (2 * c * s.head_dim + 8) * n, "loss head"),
        Term("padding mask (bool)", "N x T_mask", n * t_mask, "loss head"),
        Term("root unit unsharded (embed, lm_head, norm)", "c P_root", c * pr, "loss head"),
        Term("two layers' unsharded params", "2 c P_layer", 2 * c * pl, "loss head"),
        # layer backward
        Term("checkpointed layer inputs", "L x c h x N", L * c * h * n, "layer backward"),
        Term("one recomputed layer + its gradients", "a_layer x N",
             layer_activation_bytes_per_token(s, c) * n, "layer backward"),
        Term("rotary cos/sin + position ids", "(2c hd + 8) x N", (2 * c * s.head_dim + 8) * n, "layer backward"),
        Term("padding mask (bool + compute-dtype copy)", "(1 + c) x N x T_mask", (1 + c) * n * t_mask,
             "layer backward"),
        Term("root unit unsharded", "c P_root", c * pr, "layer backward"),
        Term("lm_head gradient (unsharded until the root's backward ends)", "c V h", c * v * h,
             "layer backward"),
        Term("layer unit: params + prefetch + its all-gather + grads + fp32 reduce-scatter",
             "(3c + c + 4) P_layer", (4 * c + 4) * pl, "layer backward"),
        # root reduce
        Term("root unit unsharded params + grads", "2c P_root", 2 * c * pr, "root reduce"),
        Term("root fp32 reduce-scatter input", "4 P_root", 4 * pr, "root reduce"),
        # optimizer
        Term("AdamW foreach temporary (sqrt of exp_avg_sq)", "4 P / W", states * 4 * p / w, "optimizer step"),
    ]


def learner_peak(s: ModelShape, setup: LearnerSetup, tokens: int | None = None) -> tuple[float, str, dict[str, float]]:
    """(peak bytes, the phase that sets it, always + each phase's bytes)."""
    terms = learner_terms(s, setup, tokens)
    always = sum(t.bytes for t in terms if t.phase == "always")
    phases = {ph: sum(t.bytes for t in terms if t.phase == ph) for ph in PHASES}
    worst = max(PHASES, key=lambda ph: phases[ph])
    return always + phases[worst], worst, {"always": always, **phases}


def gpu_budget(gpu_bytes: float) -> float:
    """Usable bytes: 90 % of the GPU minus the CUDA context."""
    return (1 - ALLOCATOR_MARGIN) * gpu_bytes - CUDA_CONTEXT


def max_micro_batch_tokens(s: ModelShape, setup: LearnerSetup, budget: float, limit: int = 1 << 24) -> int:
    """Largest N whose learner peak fits ``budget`` (0 if none). The peak grows with N (linear terms plus
    the padding mask, quadratic while N / 2 < the longest sample), so bisection finds the boundary."""
    if learner_peak(s, setup, 1)[0] > budget:
        return 0
    lo, hi = 1, limit
    if learner_peak(s, setup, hi)[0] <= budget:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if learner_peak(s, setup, mid)[0] <= budget:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------------------------- engine
def engine_terms(s: ModelShape, e: EngineSetup, gpu_bytes: float) -> dict[str, Any]:
    """One GPU of an engine's TP group on a GPU of ``gpu_bytes``."""
    weights = param_count(s) * e.dtype_bytes / e.tp
    tp_comm = NCCL_PER_COMM if e.tp > 1 else 0
    static = e.mem_fraction_static * gpu_bytes
    kv = static - weights - CUDA_CONTEXT - tp_comm
    per_token = kv_bytes_per_token(s, e.tp, e.dtype_bytes)
    capacity = max(0, int(kv // per_token))
    if e.max_total_tokens is not None:
        capacity = min(capacity, e.max_total_tokens)
    b_max = max(e.bucket_bytes, largest_tensor(s) * e.dtype_bytes)
    outside = (1 - e.mem_fraction_static) * gpu_bytes
    update = NCCL_PER_COMM + b_max + largest_tensor(s) * e.dtype_bytes // e.tp
    return {
        "weights": weights, "tp_comm": tp_comm, "static": static, "kv_bytes": max(0.0, kv),
        "kv_bytes_per_token": per_token, "kv_tokens": capacity,
        "full_length_seqs": capacity // e.max_seq_len, "concurrent_seqs": e.concurrent_seqs,
        "concurrent_tokens_worst": e.concurrent_seqs * e.max_seq_len,
        "mean_len_all_fit": capacity / e.concurrent_seqs,
        "outside_static": outside, "weight_update": update, "outside_left": outside - update,
        "fits": kv > 0 and capacity >= e.max_seq_len and outside > update,
    }


# ------------------------------------------------------------------------------------------- start-up
def startup_bytes(s: ModelShape, world: int, file_bytes: int = 2) -> float:
    """Peak of one rank's sharded start-up (async_dapo.weights.shards.load_local_shards): its fp32 shard (4 P / W)
    plus the slice of one checkpoint tensor being copied in (the largest: largest / W x the file's dtype
    bytes). On CUDA the shard is GPU memory and the slice host memory; on CPU both are host memory."""
    return 4 * param_count(s) / world + largest_tensor(s) * file_bytes / world


# ------------------------------------------------------------------------------------------- smoke
def phase_slopes(s: ModelShape, setup: LearnerSetup, tokens: int = 1 << 14) -> dict[str, float]:
    """Bytes per extra micro-batch token of each phase, for micro-batches of one row (no padding mask),
    past the log-prob chunk: what tools/gpu/gpu_smoke.py's memory check fits as its slope."""
    one_row = dataclasses.replace(setup, max_seq_len=0)  # T_mask = 0: a single row has no mask
    lo = learner_peak(s, one_row, tokens)[2]
    hi = learner_peak(s, one_row, tokens + 1024)[2]
    return {ph: (hi[ph] - lo[ph]) / 1024 for ph in PHASES}


def smoke_setup() -> LearnerSetup:
    """tools/gpu/gpu_smoke.py's learner: one rank, bf16 compute, one sample per micro-batch, 64 MiB buckets."""
    return LearnerSetup(world=1, compute_bytes=2, micro_batch_tokens=4096, chunk_tokens=1024, max_seq_len=0,
                        seqs_per_rank_step=4, bucket_bytes=64 * MIB, push_bytes=2, nccl_comms=1)


# ------------------------------------------------------------------------------------------- report
def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def shape_for(cfg: Any, name: str | None) -> tuple[str, ModelShape]:
    key = name or Path(str(cfg.model.path)).name
    if key not in SHAPES:
        raise SystemExit(f"memory_model: no shape for '{key}' (known: {', '.join(SHAPES)}); pass --shape NAME")
    return key, SHAPES[key]


def report(path: str, cfg: Any, key: str, s: ModelShape) -> str:
    ls, es = LearnerSetup.from_config(cfg), EngineSetup.from_config(cfg)
    p = param_count(s)
    lines = [f"## {path}: {key}", "",
             f"{p:,} parameters (P_layer {layer_params(s):,} x {s.layers} layers, P_root {root_params(s):,}); "
             f"learner W = {ls.world} ranks, c = {ls.compute_bytes} B, N = micro_batch_tokens = "
             f"{ls.micro_batch_tokens:,}, chunk = {ls.chunk_tokens}, longest sample = {ls.max_seq_len:,} tokens "
             f"(T_mask = {mask_row_len(ls, ls.micro_batch_tokens):,}), bucket = {ls.bucket_bytes // MIB} MiB "
             f"(B_max = {gib(max(ls.bucket_bytes, largest_tensor(s) * ls.push_bytes))} GiB), "
             f"a_layer = {layer_activation_bytes_per_token(s, ls.compute_bytes):,} B/token.", "",
             "### Learner, one GPU (rank 0)", "", "| phase | term | formula | GiB |", "|---|---|---|---|"]
    for t in learner_terms(s, ls):
        lines.append(f"| {t.phase} | {t.name} | `{t.formula}` | {gib(t.bytes)} |")
    peak, worst, parts = learner_peak(s, ls)
    lines += ["", "| | GiB |", "|---|---|", f"| always | {gib(parts['always'])} |"]
    lines += [f"| always + {ph} | {gib(parts['always'] + parts[ph])} |" for ph in PHASES]
    lines += [f"| **peak** ({worst}) | **{gib(peak)}** |", ""]
    lines += [f"Start-up (sharded load, before the optimizer exists): {gib(4 * p / ls.world)} GiB of GPU per rank "
              f"(the fp32 shard, `4 P / W`) plus one checkpoint tensor's slice in host memory at a time "
              f"({largest_tensor(s) * 2 / ls.world / MIB:.0f} MiB for a bf16 checkpoint).", ""]
    lines += ["| GPU | budget (0.9 x GPU - 1 GiB) | learner peak | fits | max micro_batch_tokens | "
              "max / configured |", "|---|---|---|---|---|---|"]
    for name, size in GPUS.items():
        budget = gpu_budget(size)
        mx = max_micro_batch_tokens(s, ls, budget)
        lines.append(f"| {name} ({gib(size)} GiB) | {gib(budget)} | {gib(peak)} | "
                     f"{'yes' if peak <= budget else 'NO'} | {mx:,} | {mx / ls.micro_batch_tokens:.2f} |")
    lines += ["", f"### Engine, one GPU of a TP-{es.tp} group "
              f"({es.num_engines} engines, mem_fraction_static {es.mem_fraction_static})", "",
              "| term | formula | " + " | ".join(f"{g} GiB" for g in GPUS) + " |",
              "|---|---|" + "---|" * len(GPUS)]
    rows = [("weights", "e P / TP", "weights"),
            ("TP communicator (estimate)", "1 GiB if TP > 1", "tp_comm"),
            ("static pool", "mem_fraction_static x GPU", "static"),
            ("KV cache", "static - weights - 1 GiB context - TP comm", "kv_bytes"),
            ("outside the static pool", "(1 - mem_fraction_static) x GPU", "outside_static"),
            ("weight update: communicator + bucket + one tensor's slice", "1 GiB + B_max + 2 V h / TP",
             "weight_update"),
            ("left for CUDA graphs + activations", "outside - weight update", "outside_left")]
    per_gpu = {g: engine_terms(s, es, size) for g, size in GPUS.items()}
    for label, formula, k in rows:
        lines.append(f"| {label} | `{formula}` | " + " | ".join(gib(per_gpu[g][k]) for g in GPUS) + " |")
    kvpt = per_gpu[next(iter(GPUS))]["kv_bytes_per_token"]
    lines += ["", f"KV bytes per token per GPU = 2 x {s.layers} x {kv_heads_per_gpu(s, es.tp)} x {s.head_dim} "
              f"x {es.dtype_bytes} = {kvpt:,} B. Concurrent sequences per engine = max_inflight_prompts x n = "
              f"{es.concurrent_seqs:,}, each up to {es.max_seq_len:,} tokens "
              f"({es.concurrent_seqs * es.max_seq_len / 1e6:.1f} M tokens at full length).", "",
              "| GPU | KV tokens per engine | full-length sequences at once | share of the concurrent | "
              "mean length for all to fit | fits |", "|---|---|---|---|---|---|"]
    for g in GPUS:
        e = per_gpu[g]
        lines.append(f"| {g} | {e['kv_tokens']:,} | {e['full_length_seqs']:,} | "
                     f"{e['full_length_seqs'] / es.concurrent_seqs:.1%} | {e['mean_len_all_fit']:,.0f} | "
                     f"{'yes' if e['fits'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def smoke_report() -> str:
    s = SHAPES["Qwen2.5-0.5B"]
    slopes = phase_slopes(s, smoke_setup())
    worst = max(slopes, key=slopes.get)
    lines = ["## tools/gpu/gpu_smoke.py memory check: Qwen2.5-0.5B, one rank, bf16, one sample per micro-batch", "",
             "| phase | bytes per token | KiB per token |", "|---|---|---|"]
    lines += [f"| {ph} | {slopes[ph]:,.0f} | {slopes[ph] / 1024:.1f} |" for ph in PHASES]
    n = 1 << 14
    one_row = dataclasses.replace(smoke_setup(), max_seq_len=0)
    intercept = learner_peak(s, one_row, n)[2][worst] - slopes[worst] * n
    lines += ["", f"Predicted train slope (the largest phase, {worst}): {slopes[worst]:,.0f} B/token = "
              f"{slopes[worst] / 1024:.1f} KiB/token; intercept (what does not grow with tokens: log-prob "
              f"chunks, root unit, two layers) {gib(intercept)} GiB. gpu_smoke.json "
              "memory.fit.train.slope_bytes_per_token / intercept_bytes check them. Start-up: "
              f"memory_allocated after construction = 4 P = {gib(4 * param_count(s))} GiB (world 1)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("configs", nargs="*", metavar="CONFIG", help="run config(s) (YAML), one report each")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: basename of model.path)")
    common.add_sets(ap)
    ap.add_argument("--smoke", action="store_true", help="also print what tools/gpu/gpu_smoke.py should measure")
    args = ap.parse_args(argv)
    if not args.configs and not args.smoke:
        ap.error("give at least one config (or --smoke)")
    if args.smoke:
        print(smoke_report())
    for path in args.configs:
        cfg = common.load_config(path, args.overrides)
        key, shape = shape_for(cfg, args.shape)
        print(report(path, cfg, key, shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
