"""rollout: the SGLang engines and how each rollout actor drives its engine."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from async_dapo.config.section import Section


class EngineConfig(Section):
    """SGLang engine arguments (one engine per rollout actor). Defaults are the CPU recipe."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' = cuda when torch sees a GPU, else cpu."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Engine weights dtype; 'auto' = float32 on cpu, bfloat16 on cuda."
    )
    attention_backend: str | None = Field(
        None, description="SGLang attention backend; None = 'torch_native' on cpu, SGLang default on cuda."
    )
    tp_size: int = Field(1, ge=1, le=64, description="Tensor-parallel GPUs per engine.")
    mem_fraction_static: float = Field(
        0.3, gt=0, le=0.95, description="Fraction of device memory SGLang reserves for weights + KV."
    )
    max_total_tokens: int | None = Field(
        16384, ge=256, description="KV-cache token capacity (None = SGLang decides from memory)."
    )
    context_length: int | None = Field(2048, ge=16, description="Max prompt+response tokens.")
    max_running_requests: int | None = Field(None, ge=1, description="SGLang scheduler cap.")
    disable_cuda_graph: bool | None = Field(None, description="None = True on cpu, False on cuda.")
    random_seed: int = Field(0, ge=0, description="Engine sampling seed.")
    sleep_on_idle: bool | None = Field(
        None, description="SGLang's sleep_on_idle (None = True on cpu, False on cuda). Without it the "
        "scheduler busy-polls whenever it has nothing to run, which on a CPU engine takes a core from the "
        "learner.",
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Passed verbatim to sglang.Engine (escape hatch)."
    )


class RolloutConfig(Section):
    """Sampling of G responses per prompt by the SGLang rollout actors."""

    n: int = Field(8, ge=1, le=1024, description="G: responses sampled per prompt (group size).")
    temperature: float = Field(
        1.0, gt=0, le=10, description="Training sampling temperature (> 0: behaviour logprobs are "
        "log_softmax(logits / T), so T = 0 would make every update a NaN step).",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Training nucleus sampling.")
    top_k: int = Field(-1, ge=-1, description="Training top-k (-1 = off).")
    max_response_length: int = Field(
        32, ge=1, le=1_048_576, description="L_max: responses are truncated at this many tokens."
    )
    max_inflight_prompts: int = Field(
        64, ge=1, description="Prompts a rollout actor keeps in flight (each with n samples)."
    )
    update_mode: Literal["inflight", "drain", "abort"] = Field(
        "inflight",
        description="How an engine takes new weights: pause+retract+continue, finish running first, "
        "or abort and resample.",
    )
    partial_rollout: bool = Field(
        False, description="update_mode=abort: a sample an update aborted keeps its tokens, log-probs and "
        "per-token versions and is continued from prompt + those tokens on the new weights (verl's partial "
        "rollout), instead of resampled from scratch; a kept prefix whose oldest token is already more than "
        "replay.max_staleness versions old is thrown away (its samples would be dropped as stale).",
    )
    partial_every_s: float = Field(
        0.0, ge=0, description="Every this many seconds each rollout actor reports the progress of its groups "
        "in flight (each sample's tokens, log-probs and versions so far, one signed message per group that "
        "moved) to the replay queue, which keeps the latest: when the engine leaves the fleet (dies, hangs or "
        "is scaled down) another engine continues those samples instead of starting them again. With it, "
        "update_mode inflight aborts the running requests and continues each from its tokens after the load "
        "(SGLang tells an unfinished request's per-token versions only when it finishes). 0 = off: a "
        "leaving engine's in-flight tokens are lost.",
    )
    partial_every_tokens: int = Field(
        50, ge=1, description="With rollout.partial_every_s > 0: how often (in generated tokens per sample) "
        "the engine hands a running sample's new tokens to its rollout actor (the streamed request's "
        "stream_interval), which is the finest progress a report can hold.",
    )
    request_timeout_s: float = Field(
        600, gt=0, description="Bound (seconds) on one engine request (a group's n samples go as ONE batched "
        "request; a redrawn sample as one more) and on queueing the finished group for sending: on expiry the "
        "request is aborted and the group abandoned (replay/abandoned/timeout or send_timeout; the prompt goes "
        "back to the cursor).",
    )
    max_abort_retries: int = Field(
        3, ge=0, description="A sample whose request the engine aborted (not by our own weight update) is "
        "resampled at most this many times, then its group is abandoned.",
    )
    drain_timeout_s: float = Field(
        300, gt=0, description="update_mode=drain: longest wait (seconds) for running requests to finish "
        "before the weight update fails; update_mode=abort: the same bound on the aborted requests leaving "
        "the engine.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)
