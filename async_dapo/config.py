"""The one typed configuration tree of a run.

Every field is documented and bounded where it is defined; unknown keys are errors (``extra="forbid"``).
A run's config = a YAML file + ``--set a.b=c`` overrides (values parsed as YAML scalars/lists), validated
once by :func:`load_config`. Any problem raises :class:`ConfigError` whose message is one line naming the
dotted key and the problem; the CLI prints it and exits non-zero.

Sections follow the data flow: model -> data -> rollout -> reward -> algorithm -> replay -> learner ->
weight_sync -> placement -> transport -> logging -> checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config problem, formatted as one line: ``<dotted.key>: <problem>``."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------- model
class TinyModelConfig(_Section):
    """Shape and warm-start of the tiny Qwen2 model that ``async-dapo bootstrap`` builds (no hub)."""

    hidden_size: int = Field(128, ge=16, le=4096, description="Transformer width.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, le=64, description="Attention heads (also key/value heads).")
    intermediate_size: int = Field(256, ge=16, le=16384, description="MLP hidden width.")
    sft_steps: int = Field(
        600, ge=1, le=100_000, description="Most warm-start optimizer steps: exactly this many without "
        "`sft_target_accuracy`; with it, the warm start stops once the target is reached (and held, see "
        "`sft_target_checks`)."
    )
    sft_target_accuracy: float | None = Field(
        None, gt=0, le=1, description="Greedy accuracy (fraction of problems, 0-1) that stops the warm start: "
        "it stops at the first check where accuracy on the training problems of `sft_target_level` reaches "
        "this (for `sft_target_checks` checks in a row); at most `sft_steps` steps either way. None = run "
        "exactly `sft_steps`.",
    )
    sft_target_checks: int = Field(
        1, ge=1, le=100, description="With `sft_target_accuracy`: consecutive checks at which the target level "
        "must be at or above the target before the warm start stops (a count; more than 1 keeps a single "
        "check's spike from stopping it).",
    )
    sft_target_level: int | None = Field(
        None, description="Synthetic level whose training problems the target is checked on (None = the "
        "easiest configured level)."
    )
    sft_level_floor: float | None = Field(
        None, ge=0, le=1, description="With `sft_target_accuracy`: stop only once every other configured level "
        "also has at least this greedy accuracy (fraction, 0-1) on its training problems (checked when the "
        "target level is there), so that every level gives RL some mixed groups. None = no floor.",
    )
    sft_check_every: int = Field(
        25, ge=1, le=10_000, description="Warm-start steps between two checks of the target."
    )
    sft_schedule_steps: int | None = Field(
        None, ge=1, description="Horizon of the cosine LR schedule (None = sft_steps). Longer than sft_steps "
        "stops the warm start mid-schedule: a half-trained policy, where RL has something to improve.",
    )
    sft_batch_size: int = Field(64, ge=1, le=4096, description="Warm-start batch size (examples).")
    sft_lr: float = Field(3e-3, gt=0, le=1.0, description="Warm-start peak AdamW learning rate (cosine).")
    eval_prompts: int = Field(
        400, ge=10, description="Prompts per split for the warm-start accuracy report (greedy)."
    )
    seed: int = Field(0, ge=0, description="Seed of tokenizer corpus, init and warm start.")


class ModelConfig(_Section):
    """Which policy to train. ``path`` is an HF-format directory (config, tokenizer, safetensors)."""

    path: Path = Field(
        Path("runs/tiny_model"),
        description="HF-format model directory. With `bootstrap`, the tiny model is built here.",
    )
    bootstrap: TinyModelConfig | None = Field(
        default_factory=TinyModelConfig,
        description="Build a tiny model at `path` if absent (CPU default). null = `path` must exist.",
    )
    trust_remote_code: bool = Field(False, description="Passed to transformers/SGLang loaders.")


# ---------------------------------------------------------------------------------------------- data
class SyntheticTaskConfig(_Section):
    """The built-in task: integer arithmetic with difficulty levels (see async_dapo.data.LEVELS), or a walk
    along a cycle of syllables with a long tail of response lengths (async_dapo.data.walk_rows)."""

    task: Literal["arith", "walk"] = Field(
        "arith", description="'arith': 'What is 47+8?', answered in 3-5 tokens (or ~16 with response_style "
        "'steps'). 'walk': 'Walk from qoo.', answered by every syllable from there to the end of a fixed "
        "cycle of 200 (about 2 tokens each), so the prompt sets the needed response length; the number of "
        "steps is lognormal (walk_median, walk_sigma), the right-skewed shape of long-CoT RL responses, and "
        "a response budget truncates the longest. The reward wants the exact sequence "
        "(async_dapo.reward.walk_score).",
    )
    walk_median: float = Field(
        25, ge=1, le=200, description="task 'walk': median number of steps (syllables) of a problem.")
    walk_sigma: float = Field(
        0.8, ge=0, le=3, description="task 'walk': sigma of the log of the number of steps (0 = every "
        "problem has walk_median steps).")
    levels: list[int] = Field(
        [1, 2, 3, 4], min_length=1, description="Difficulty levels to mix uniformly (1..4)."
    )
    heldout_fraction: float = Field(
        0.1, gt=0, lt=1, description="Fraction of the problem space held out (by hash) for validation."
    )
    response_style: Literal["answer", "steps"] = Field(
        "answer", description="The warm start's reference response. 'answer': the answer line only "
        "('Answer: 52', 3-5 tokens). 'steps': problems with a carry or a borrow first show it ('7+5=12, "
        "carry 1. Answer: 52'), so response length grows with difficulty and a response budget can truncate "
        "the harder ones (the DAPO ablation's overlong rows need that). The reward reads the answer line "
        "either way.",
    )

    @model_validator(mode="after")
    def _levels_known(self) -> "SyntheticTaskConfig":
        """`levels` are among 1, 2, 3, 4; task `walk` has level 1 only."""
        bad = [lv for lv in self.levels if lv not in (1, 2, 3, 4)]
        if bad:
            raise ValueError(f"unknown level(s) {bad}; known levels are 1, 2, 3, 4")
        if self.task == "walk" and self.levels != [1]:
            raise ValueError(f"task 'walk' has one level: levels must be [1], got {self.levels}")
        return self


class DataConfig(_Section):
    """Where prompts come from: the built-in synthetic task, or DAPO-Math-17k-schema parquet/JSONL."""

    train: str = Field(
        "synthetic", description="'synthetic' or a path to a .parquet/.jsonl file of verl-style rows."
    )
    val: str = Field(
        "synthetic", description="'synthetic' (held-out split) or a path to a .parquet/.jsonl file."
    )
    synthetic: SyntheticTaskConfig = Field(default_factory=SyntheticTaskConfig)
    max_prompt_length: int = Field(
        256, ge=8, le=1_048_576, description="Most prompt tokens (chat template applied); what happens to "
        "a longer prompt is set by `truncation`.",
    )
    truncation: Literal["error", "left"] = Field(
        "error", description="verl's name: what happens to a prompt longer than max_prompt_length tokens. "
        "'error' = reject it at load, naming the file and row; 'left' = keep its last max_prompt_length "
        "tokens.",
    )
    shuffle_seed: int = Field(0, ge=0, description="Seed of the epoch-wise prompt order.")
    replay_batches: Path | None = Field(
        None, description="Debugging/determinism: train on the batches recorded by an earlier run "
        "(logging.record_batches) from this directory instead of the replay queue.",
    )


# ------------------------------------------------------------------------------------------- rollout
class EngineConfig(_Section):
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


class RolloutConfig(_Section):
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
        "before the weight update fails.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig)


# -------------------------------------------------------------------------------------------- reward
class RewardConfig(_Section):
    """Rule-based math reward (+1/-1) and DAPO's soft overlong punishment."""

    @model_validator(mode="after")
    def _one_box_rule(self) -> "RewardConfig":
        """`boxed_fallback` is `off` with `strict_box_verify` (the strict mode scores the box alone: a fallback
        for a missing Answer line would mean nothing)."""
        if self.strict_box_verify and self.boxed_fallback != "off":
            raise ValueError("reward.boxed_fallback must be 'off' with reward.strict_box_verify: true (the strict "
                             "mode scores only the box)")
        return self

    overlong_buffer_enable: bool = Field(True, description="Add the soft overlong penalty.")
    overlong_buffer_length: int = Field(
        8, ge=1, description="L_cache: penalty ramps over the last this-many tokens before L_max."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, le=100, description="Penalty at L_max.")
    function: str | None = Field(
        None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="The reward function, verl's custom_reward_function (path + name) as one string: "
        "'path/to/file.py:name' or 'package.module:name'. Called in the rollout actors as "
        "name(data_source, solution_str, ground_truth, extra_info) with the decoded response and the row's "
        "reward_model.ground_truth and extra_info; returns a float score, or a dict with 'score' and "
        "optionally 'acc' (default score > 0) and 'pred', as verl's. None = the built-in DAPO math reward "
        "(math_dapo rules). An exception abandons that group (counted as replay/abandoned/score_error) and "
        "its prompt goes back to the cursor; the run goes on.",
    )
    strict_box_verify: bool = Field(
        False, description="verl's math_dapo strict_box_verify: the built-in reward scores only the last "
        "\\boxed{} in the response's last 100 characters, compared exactly with the ground truth, instead of the "
        "last 'Answer:' line (the default, verl's).",
    )
    boxed_fallback: Literal["off", "exact", "normalized"] = Field(
        "off", description="An extra, not in verl: in the default (Answer-line) mode, a response with no "
        "'Answer:' line is scored by its last \\boxed{} in the last 100 characters instead of -1, equal to the "
        "ground truth exactly ('exact') or after normalising both ('normalized'). 'off' = verl: -1. Shapes only "
        "the built-in reward; ignored under strict_box_verify.",
    )
    timeout_s: float = Field(
        30, gt=0, le=3600, description="Bound (seconds) on scoring one group (its G responses) or one "
        "validation prompt: the reward function runs in a worker process off the engine's event loop, and a "
        "worker still busy after this is killed and replaced; the group is abandoned as "
        "replay/abandoned/score_timeout and its prompt goes back to the cursor.",
    )
    workers: int = Field(
        1, ge=1, le=64, description="Reward worker processes per rollout actor (groups are scored in parallel "
        "up to this many).",
    )
    max_score_failures: int = Field(
        3, ge=1, le=1000, description="A training row whose groups failed scoring (timeout or exception) this "
        "many times is quarantined: never issued again for the rest of the run, counted as "
        "replay/quarantined_prompts, logged once with its row; checkpointed with the cursor.",
    )


# ----------------------------------------------------------------------------------------- algorithm
class CorrectionConfig(_Section):
    """Off-policy correction for stale samples (see async_dapo.loss.importance_weights)."""

    mode: Literal["decoupled", "naive", "none"] = Field(
        "decoupled",
        description="decoupled: clip around recomputed proximal logprobs x capped behaviour weight; "
        "naive: clip around behaviour logprobs; none: on-policy loss, stale samples uncorrected.",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate = min(w, cap) (TIS); mask = zero outside [low, cap] (IcePop)."
    )
    is_level: Literal["token", "sequence"] = Field("token", description="Weight per token or sequence.")
    is_cap: float = Field(2.0, gt=1, description="Upper cap C of the importance weight.")
    is_low: float | None = Field(
        None, gt=0, lt=1, description="Lower bound for mask mode (None = 1/is_cap)."
    )


class DynamicSamplingConfig(_Section):
    """Keep only prompt groups whose `metric` values are not all equal (default accuracy: 0 < #correct < G)."""

    enable: bool = Field(True, description="Drop groups whose `metric` values are all equal (all-correct and "
                         "all-wrong groups under the default `acc`).")
    max_gen_rounds: int = Field(
        10, ge=1, description="Give up (error) after this many generation rounds' worth of groups "
        "without filling a batch.",
    )
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = Field(
        "acc", description="verl's algorithm.filter_groups.metric: the per-sample value whose spread decides "
        "whether a group is kept (kept when not all equal). acc = correctness; score = the reward function's "
        "score; seq_reward = score + overlong penalty (the trained reward); seq_final_reward = the same (no KL "
        "term is ever added to the reward here). Unlike verl, a group of one sample is always dropped; a uniform "
        "group is counted as all-correct / all-wrong by its accuracies, or as replay/dropped_uniform when they "
        "are mixed.",
    )
    retire_solved_after: int = Field(
        0, ge=0, le=1000, description="Retire a training prompt once this many of its groups came back "
        "all-correct: the prompt cursor skips its rows (every row with the same prompt) for the rest of the "
        "run, so generation is not spent on prompts the policy has solved (prime-rl's easy-prompt filter; "
        "Polaris and Skywork-OR1 drop solved prompts). Counted as replay/retired_prompts and "
        "replay/skipped_retired; checkpointed with the cursor. 0 = never. Needs `enable`.",
    )

    @model_validator(mode="after")
    def _retire_needs_filter(self) -> "DynamicSamplingConfig":
        """`retire_solved_after` needs `enable` (only dynamic sampling classifies a group as all-correct;
        without it nothing would ever retire)."""
        if self.retire_solved_after and not self.enable:
            raise ValueError("algorithm.dynamic_sampling.retire_solved_after needs "
                             "algorithm.dynamic_sampling.enable: true")
        return self


class AlgorithmConfig(_Section):
    """DAPO loss: Clip-Higher, dual clip, token-level aggregation, overlong filtering, correction."""

    train_batch_groups: int = Field(
        16, ge=1, description="B: prompt groups per training step (train_prompt_bsz)."
    )
    clip_low: float = Field(0.2, gt=0, lt=1, description="epsilon_low: ratio clipped at 1 - this.")
    clip_high: float = Field(0.28, gt=0, le=10, description="epsilon_high: ratio clipped at 1 + this.")
    clip_c: float | None = Field(
        10.0, gt=1, description="Dual-clip constant c for A < 0 (None = off). DAPO recipe: 10."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="token-mean is DAPO; seq-mean-token-mean is naive GRPO."
    )
    scale_adv_by_std: bool = Field(True, description="GRPO advantage divides by the group std.")
    overlong_filtering: bool = Field(False, description="Mask the loss of truncated samples.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)

    @model_validator(mode="after")
    def _clip_sane(self) -> "AlgorithmConfig":
        """`clip_high` is at least half of `clip_low` (DAPO's Clip-Higher wants clip_high >= clip_low)."""
        if self.clip_high < self.clip_low * 0.5:
            raise ValueError("clip_high is far below clip_low; DAPO's Clip-Higher wants clip_high >= clip_low")
        return self


# -------------------------------------------------------------------------------------------- replay
class ReplayConfig(_Section):
    """Staleness-bounded replay queue (AReaL's admission rule; per-sample staleness drop)."""

    max_staleness: int = Field(
        1, ge=0, le=1000, description="eta: 0 = synchronous; a group trained at version v has every "
        "token from a policy version >= v - eta.",
    )
    capacity_groups: int = Field(
        256, ge=1, description="Most groups held in the queue; >= (max_staleness + 1) * "
        "algorithm.train_batch_groups.",
    )
    ticket_ttl_s: float = Field(
        1800, gt=0, description="An admitted prompt whose group has not arrived after this many seconds is "
        "expired: its slot is released, it is counted as replay/abandoned/expired and the prompt goes back "
        "to the cursor; a group arriving later for it is dropped and counted.",
    )
    silence_timeout_s: float = Field(
        900, gt=0, description="The learner's wait for a batch fails when no group at all arrived for this "
        "many seconds (bounds silence, not duration: a slow engine that keeps delivering groups is never "
        "killed by it). Must exceed placement.health_check_timeout_s + weight_sync.timeout_s.",
    )


# ------------------------------------------------------------------------------------------- learner
class LearnerConfig(_Section):
    """FSDP2 learner optimisation."""

    total_steps: int = Field(40, ge=1, description="Training steps (policy versions) to run.")
    lr: float = Field(1e-4, gt=0, le=1, description="AdamW peak learning rate.")
    warmup_steps: int = Field(
        0, ge=0, description="verl's lr_warmup_steps: the LR ramps linearly from 0 over this many TRAINING steps "
        "(the first step runs at 0; not optimizer updates: a step is train_batch_groups / mini_batch_groups "
        "updates), then stays constant.",
    )
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW weight decay (recipe: 0.1).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    mini_batch_groups: int = Field(
        16, ge=1, description="Groups per optimizer update; train_batch_groups / this = updates per epoch."
    )
    epochs: int = Field(1, ge=1, le=32, description="mu: passes over each training batch.")
    micro_batch_tokens: int = Field(
        4096, ge=16, description="Token budget of one packed forward/backward micro-batch."
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="Token positions per chunk when the learner turns logits into log-probs and "
        "entropy: its extra memory is 2-4 fp32 chunks (8-16 x this x vocabulary bytes) instead of several fp32 "
        "copies of a whole micro-batch's logits (async_dapo.loss.token_logprobs; docs/scaling.md).",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype (MixedPrecisionPolicy); master weights are always fp32."
    )
    activation_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    cpu_offload: bool = Field(False, description="FSDP2 CPU offload of parameters.")
    collective_timeout_s: float = Field(
        600, gt=0, description="Timeout (seconds) of the learners' torch.distributed process group: a rank "
        "stuck in a collective raises after this.",
    )


# --------------------------------------------------------------------------------------- weight sync
class WeightSyncConfig(_Section):
    """Learner rank 0 -> engines weight push over a dedicated torch.distributed group."""

    every_k_steps: int = Field(1, ge=1, description="Push after every k-th training step.")
    bucket_mb: int = Field(64, ge=1, le=16384, description="Bucket size of the streamed parameters.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on cuda else gloo.")
    timeout_s: float = Field(
        600, gt=0, description="Bound (seconds) on one weight push: the engines' load and each broadcast of "
        "the learner's side. Rules: 3 x this <= placement.call_timeout_s (a push call may first wait for the "
        "previous push); with rollout.update_mode drain, > rollout.drain_timeout_s.",
    )


# ----------------------------------------------------------------------------------------- placement
class PlacementConfig(_Section):
    """How Ray places the actors."""

    ray_address: str | None = Field(
        None, description="Ray cluster address; None = join the job's cluster or start a local one."
    )
    nnodes: int = Field(
        1, ge=1, description="verl's trainer.nnodes: the nodes the run spans. With more than one, the config "
        "must name an absolute logging.run_dir on storage every node shares and a transport.bind_host other "
        "nodes can reach; a placement that lands on more nodes than this stops the run at start.",
    )
    num_engines: int = Field(1, ge=1, description="Rollout actors (one SGLang engine each) at the start.")
    max_engines: int | None = Field(
        None, ge=1, description="Most rollout actors the run may be scaled to while it runs (``async-dapo scale "
        "RUN_DIR --engines N``); None = placement.num_engines. It sizes the replay queue's receiver (transport."
        "max_peers None = 2 x this).",
    )
    autoscaling: bool = Field(
        False, description="The cluster adds nodes on demand (a Ray autoscaler): a placement larger than the "
        "cluster waits for them, reporting every minute, for at most placement.start_timeout_s. False: it "
        "stops the run at once, naming the fields and the cluster's resources.",
    )
    engine_cpus: float = Field(1, gt=0, description="CPUs per rollout actor.")
    engine_gpus: int = Field(
        0, ge=0, description="GPUs per rollout actor: rollout.engine.tp_size on cuda, 0 on cpu (auto: "
        "either).",
    )
    learner_ranks: int = Field(1, ge=1, description="FSDP2 learner ranks.")
    learner_cpus: float = Field(1, gt=0, description="CPUs per learner rank.")
    learner_gpus: int = Field(0, ge=0, le=1, description="GPUs per learner rank (0 or 1).")
    queue_cpus: float = Field(0, ge=0, description="CPUs reserved for the replay-queue actor.")
    start_timeout_s: float = Field(
        900, gt=0, description="Bound (seconds) on placement-group readiness, engine start and learner "
        "construction.",
    )
    call_timeout_s: float = Field(
        1800, gt=0, description="Bound (seconds) on one learner call (train step, checkpoint, export) and "
        "other control calls.",
    )
    health_check_interval_s: float = Field(
        10, gt=0, description="Seconds between heartbeats to every rollout engine (slime: 10 s)."
    )
    health_check_timeout_s: float = Field(
        30, gt=0, description="A heartbeat (one 1-token generate through the engine) unanswered after this "
        "many seconds marks the engine hung: it is killed and replaced. Also the one bound on every call the "
        "supervisor makes to all engines at once (start producing, shut down, counters), and the ceiling of "
        "the bounds taken from an operation's own recent durations (5 x their median, at least a third of "
        "this): each step of a weight-group formation (leave, dtype, join), and a push, past which an engine "
        "that has not loaded it while another has is hung.",
    )
    max_engine_restarts: int = Field(
        3, ge=0, description="Replacements of dead/hung rollout actors over the whole run; once exhausted "
        "the run stops, naming the actor and the last checkpoint.",
    )


# ----------------------------------------------------------------------------------------- transport
class TransportConfig(_Section):
    """zmq + msgpack group stream from rollout actors to the replay queue."""

    bind_host: str = Field(
        "127.0.0.1", description="Interface the replay queue binds (and where the weight group's rendezvous "
        "is advertised): an address; 0.0.0.0 for every interface; or node, the address Ray knows for the "
        "queue's node (reachable by the other nodes, and nothing else listens). Set for multi-node.",
    )
    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port.")
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Larger messages are dropped and counted."
    )
    max_peers: int | None = Field(
        None, ge=1, le=100_000, description="Most producer connections the queue's receiver admits at once; "
        "connections without the run's key never count (queue stat rejected_handshake). One beyond them is "
        "refused at the handshake, before any of its message frames is read, and counted as queue stat rejected_peers (a "
        "refused producer connects again 0.5-1.5 s later and gets in once a slot is free). None = 2 x "
        "placement.num_engines (room for a replacement that connects before a dead peer's connection is torn "
        "down).",
    )
    receive_budget_bytes: int | None = Field(
        None, ge=1024 * 1024, description="Bytes zmq may hold in the queue's receiver for all peers together, "
        "each message counted at the hard cap H = max(2 x max_message_bytes, max_message_bytes + 1 MiB) + 32 "
        "tag bytes: per admitted peer the messages waiting in its pipe, one in its decoder and two copies of its "
        "handshake properties (up to one H), plus the message being read. Each peer's receive high-water mark "
        "is set from it: min(100, (budget // H - 1) // max_peers - 3). Must be >= (4 x max_peers + 1) x H. "
        "None = that minimum, but at least 4 GiB.",
    )


# ------------------------------------------------------------------------------------------- logging
class LoggingConfig(_Section):
    """Run directory, TensorBoard, validation."""

    run_dir: Path = Field(Path("runs/tiny_cpu"), description="Everything of a run is written here.")
    tensorboard: bool = Field(True, description="Write TensorBoard events to run_dir/tb.")
    plan_profile: Path | None = Field(
        None, description="A planner profile (configs/profiles/*.yaml, or one written by "
        "tools/bench/calibrate.py for this machine): the run predicts its steady-state step time with "
        "`async-dapo plan`'s model when it starts, and the end-of-run phase table prints predicted against "
        "measured, so every run checks the model. None = no prediction.",
    )

    @field_validator("plan_profile")
    @classmethod
    def _profile_exists(cls, v: Path | None) -> Path | None:
        """`plan_profile`, when set, is an existing file."""
        if v is not None and not v.is_file():
            raise ValueError(f"no profile file at {v}")
        return v
    val_every_steps: int = Field(
        10, ge=0, description="Start a validation every k steps and at the last (0 = never). It runs on every "
        "engine beside training (the learner does not wait) and is logged against the step it started at.",
    )
    val_before_train: bool = Field(
        True, description="verl's trainer.val_before_train: also validate the initial weights at step 0 (when "
        "val_every_steps > 0).",
    )
    val_prompts: int = Field(
        256, ge=1, description="Most held-out prompts per validation; each distinct (repeated rows of a file are "
        "dropped, the synthetic split is not cycled), so fewer when the split has fewer.",
    )
    val_n: int = Field(4, ge=1, description="k: samples per validation prompt (avg@k, pass@k, maj@k).")
    val_temperature: float = Field(1.0, ge=0, le=10, description="Validation temperature.")
    val_top_p: float = Field(0.7, gt=0, le=1, description="Validation top_p (paper: 0.7).")
    val_timeout_s: float = Field(1800, gt=0, description="Bound (seconds) on one validation pass.")
    seed: int = Field(
        0, ge=0, description="Seed of python/numpy/torch in every process (learner ranks, rollout actors, "
        "the driver).",
    )
    record_batches: bool = Field(
        False, description="Write every trained batch to run_dir/batches/step_N.bin (wire format)."
    )


class CheckpointConfig(_Section):
    """torch.distributed.checkpoint of the full training state + HF export."""

    every_steps: int = Field(0, ge=0, description="Checkpoint every k steps (0 = only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept.")
    export_hf: bool = Field(True, description="Write an HF-format copy of the final policy.")


class Config(_Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Config":
        """Run every rule of CROSS_FIELD_RULES in order; the first broken one raises its one-line message."""
        for rule in CROSS_FIELD_RULES:
            rule(self)
        return self


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


# The queue's receiver (transport.GroupReceiver) sizes its zmq buffers with these; they live here so the
# load-time rule and the receiver share one formula (config imports nothing else of the package).
RECEIVE_TAG_BYTES = 32  # = transport.TAG_BYTES, the HMAC-SHA256 tag: the run's receiver always has a secret
RECEIVE_MAX_HWM = 100  # messages per peer; more would add latency, not throughput
RECEIVE_DEFAULT_BUDGET_BYTES = 4 * 1024**3  # transport.receive_budget_bytes None: at least this


def engine_ceiling(cfg: "Config") -> int:
    """The most rollout actors the run may have at once: placement.max_engines, else num_engines."""
    return cfg.placement.max_engines or cfg.placement.num_engines


def receive_hard_cap(max_message_bytes: int, tag_bytes: int = RECEIVE_TAG_BYTES) -> int:
    """zmq MAXMSGSIZE of the receiver: room to receive and count a message somewhat over the limit
    (instead of cutting the connection), plus the tag; zmq drops the connection on a larger one."""
    return max(2 * max_message_bytes, max_message_bytes + 1024 * 1024) + tag_bytes


def receive_max_peers(max_peers: int | None, num_engines: int) -> int:
    """transport.max_peers resolved: None = 2 x ``num_engines`` (the most engines the run may have,
    :func:`engine_ceiling`)."""
    return max_peers or 2 * num_engines


# Hard-capped messages zmq may hold per admitted peer besides its pipe: one in its decoder and two copies
# of its handshake properties (a READY command up to the hard cap, kept for the connection's life).
RECEIVE_PEER_EXTRA = 3


def receive_min_budget(max_peers: int, hard_cap: int) -> int:
    """Smallest budget: per peer one message in its pipe + the extras, plus the one being read."""
    return (max_peers * (1 + RECEIVE_PEER_EXTRA) + 1) * hard_cap


def receive_budget(budget_bytes: int | None, max_peers: int, hard_cap: int) -> int:
    """The budget in force: as set, or (None) the smallest that fits, at least the 4 GiB default."""
    if budget_bytes is not None:
        return budget_bytes
    return max(RECEIVE_DEFAULT_BUDGET_BYTES, receive_min_budget(max_peers, hard_cap))


def receive_hwm(budget_bytes: int, max_peers: int, hard_cap: int) -> int:
    """Per-peer receive high-water mark so that max_peers x (hwm + extras) + 1 hard-capped messages fit
    the budget; < 1 means the budget is too small."""
    return min(RECEIVE_MAX_HWM, (budget_bytes // hard_cap - 1) // max_peers - RECEIVE_PEER_EXTRA)


# ------------------------------------------------------------------------------- cross-field rules
# A rule takes the whole Config and raises ValueError whose one-line message names the dotted keys it is
# about (pydantic reports these at the root, so the message carries the keys itself). Config runs
# CROSS_FIELD_RULES in that order; every function named rule_* must be listed there (a test checks it).
# A rule about one section only stays a validator on that section.
def rule_mini_batch_divides_train_batch(cfg: Config) -> None:
    """A training step is split into whole mini-batches; a remainder of groups would fit no update."""
    if cfg.algorithm.train_batch_groups % cfg.learner.mini_batch_groups:
        raise ValueError(
            "learner.mini_batch_groups must divide algorithm.train_batch_groups "
            f"({cfg.learner.mini_batch_groups} vs {cfg.algorithm.train_batch_groups})"
        )


def rule_overlong_buffer_fits_response(cfg: Config) -> None:
    """The overlong penalty ramps over the last overlong_buffer_length tokens before L_max: it must fit."""
    if cfg.reward.overlong_buffer_enable and cfg.reward.overlong_buffer_length > cfg.rollout.max_response_length:
        raise ValueError("reward.overlong_buffer_length must be <= rollout.max_response_length")


def rule_context_fits_prompt_and_response(cfg: Config) -> None:
    """The engine's context must hold the longest prompt followed by the longest response."""
    ctx = cfg.rollout.engine.context_length
    if ctx is not None and ctx < cfg.data.max_prompt_length + cfg.rollout.max_response_length:
        raise ValueError(
            "rollout.engine.context_length must be >= data.max_prompt_length + rollout.max_response_length"
        )


def rule_sft_target_level_is_configured(cfg: Config) -> None:
    """The warm start checks its target on that level's training problems, so the task must have them."""
    tc, levels = cfg.model.bootstrap, cfg.data.synthetic.levels
    if tc is not None and tc.sft_target_level is not None and tc.sft_target_level not in levels:
        raise ValueError(
            f"model.bootstrap.sft_target_level ({tc.sft_target_level}) must be one of data.synthetic.levels {levels}"
        )


def rule_weight_sync_within_staleness(cfg: Config) -> None:
    """Engines must get new weights before their groups go stale, or admission and hand-out deadlock."""
    ws, rp = cfg.weight_sync, cfg.replay
    if ws.every_k_steps > rp.max_staleness + 1:
        raise ValueError(
            f"weight_sync.every_k_steps ({ws.every_k_steps}) must be <= replay.max_staleness + 1 "
            f"({rp.max_staleness + 1}): groups would be stale before the engines get new weights "
            "(admission counts the engines' version, hand-out judges staleness at the learner's: deadlock)"
        )


def rule_dynamic_sampling_needs_groups(cfg: Config) -> None:
    """A group of one sample is never mixed, so dynamic sampling would drop every group."""
    if cfg.algorithm.dynamic_sampling.enable and cfg.rollout.n < 2:
        raise ValueError(
            f"rollout.n ({cfg.rollout.n}) must be >= 2 when algorithm.dynamic_sampling.enable: a group of one is "
            "never mixed, so dynamic sampling would drop every group"
        )


def rule_capacity_holds_staleness_window(cfg: Config) -> None:
    """The queue must hold every group that may still be trained: max_staleness + 1 batches of them."""
    rp, batch = cfg.replay, cfg.algorithm.train_batch_groups
    need = (rp.max_staleness + 1) * batch
    if rp.capacity_groups < need:
        raise ValueError(
            f"replay.capacity_groups ({rp.capacity_groups}) must be >= (replay.max_staleness + 1) * "
            f"algorithm.train_batch_groups = ({rp.max_staleness} + 1) * {batch} = {need}"
        )


def rule_cuda_engine_gpus_equal_tp(cfg: Config) -> None:
    """A cuda engine's actor holds one GPU per tensor-parallel rank of the engine."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "cuda" and pl.engine_gpus != eng.tp_size:
        raise ValueError(
            f"placement.engine_gpus ({pl.engine_gpus}) must equal rollout.engine.tp_size ({eng.tp_size}) "
            "when rollout.engine.device is cuda"
        )


def rule_cpu_engine_has_no_gpus(cfg: Config) -> None:
    """A cpu engine uses no GPU and has no tensor parallelism."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "cpu" and (pl.engine_gpus != 0 or eng.tp_size != 1):
        raise ValueError(
            f"rollout.engine.device cpu needs placement.engine_gpus = 0 (got {pl.engine_gpus}) and "
            f"rollout.engine.tp_size = 1 (got {eng.tp_size})"
        )


def rule_auto_engine_gpus_zero_or_tp(cfg: Config) -> None:
    """An auto engine becomes a cpu engine (no GPU) or a cuda engine (tp_size GPUs)."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "auto" and pl.engine_gpus not in (0, eng.tp_size):
        raise ValueError(
            f"placement.engine_gpus ({pl.engine_gpus}) must be 0 or rollout.engine.tp_size "
            f"({eng.tp_size}) when rollout.engine.device is auto"
        )


def rule_every_rank_gets_a_sample(cfg: Config) -> None:
    """Every learner rank needs at least one sample of each mini-batch."""
    mini, n, ranks = cfg.learner.mini_batch_groups, cfg.rollout.n, cfg.placement.learner_ranks
    if mini * n < ranks:
        raise ValueError(
            f"learner.mini_batch_groups * rollout.n ({mini} * {n} = {mini * n}) must be >= placement.learner_ranks "
            f"({ranks}): every rank needs at least one sample of each mini-batch"
        )


def rule_drain_ends_before_weight_sync_timeout(cfg: Config) -> None:
    """The learner's side of the weight group must not time out while an engine still drains."""
    ro, ws = cfg.rollout, cfg.weight_sync
    if ro.update_mode == "drain" and ro.drain_timeout_s >= ws.timeout_s:
        raise ValueError(
            f"rollout.drain_timeout_s ({ro.drain_timeout_s:g}) must be < weight_sync.timeout_s "
            f"({ws.timeout_s:g}) with rollout.update_mode drain: the learner's side of the weight group "
            "would time out while the engine still drains"
        )


def rule_hung_engine_replaced_before_silence(cfg: Config) -> None:
    """A hung engine must be replaced before the learner gives up waiting for groups."""
    pl, ws, rp = cfg.placement, cfg.weight_sync, cfg.replay
    if pl.health_check_timeout_s + ws.timeout_s >= rp.silence_timeout_s:
        raise ValueError(
            f"placement.health_check_timeout_s + weight_sync.timeout_s ({pl.health_check_timeout_s:g} + "
            f"{ws.timeout_s:g}) must be < replay.silence_timeout_s ({rp.silence_timeout_s:g}): a hung "
            "engine (stuck in a request or in a weight update) must be replaced before the learner gives "
            "up waiting"
        )


def _call_outlives(cfg: Config, key: str, value: float) -> None:
    """Shared by the two call_timeout_s rules: ``key`` (= ``value`` seconds) must fit in one learner call."""
    if value > cfg.placement.call_timeout_s:
        raise ValueError(
            f"{key} ({value:g}) must be <= placement.call_timeout_s ({cfg.placement.call_timeout_s:g}): a call "
            "must outlive the collectives it waits on, so their own error surfaces"
        )


def rule_call_outlives_collective(cfg: Config) -> None:
    """A learner call must outlive the collectives it waits on, so their own timeout error surfaces."""
    _call_outlives(cfg, "learner.collective_timeout_s", cfg.learner.collective_timeout_s)


def rule_call_outlives_weight_push(cfg: Config) -> None:
    """A push call on rank 0 may join the previous push (2 x weight_sync.timeout_s), then broadcast (1 x)."""
    _call_outlives(cfg, "3 * weight_sync.timeout_s", 3 * cfg.weight_sync.timeout_s)


def rule_ticket_outlives_request(cfg: Config) -> None:
    """A ticket must not expire while its group's first engine request may still run."""
    rp, ro = cfg.replay, cfg.rollout
    if rp.ticket_ttl_s <= ro.request_timeout_s:
        raise ValueError(
            f"replay.ticket_ttl_s ({rp.ticket_ttl_s:g}) must be > rollout.request_timeout_s "
            f"({ro.request_timeout_s:g}): a ticket must not expire while its first request may still run (a "
            "group that still arrives after its ticket expired is dropped and counted, never trained twice)"
        )


def rule_multi_node_run_dir_shared(cfg: Config) -> None:
    """Every rank writes its checkpoint shards under run_dir, so on several nodes it must be shared storage."""
    run_dir, nnodes = cfg.logging.run_dir, cfg.placement.nnodes
    if nnodes > 1 and (not run_dir.is_absolute() or any(run_dir.is_relative_to(d) for d in NODE_LOCAL_DIRS)):
        raise ValueError(
            f"logging.run_dir ({run_dir}) must be an absolute path on storage shared by all {nnodes} nodes "
            f"(placement.nnodes > 1), not relative or under {', '.join(NODE_LOCAL_DIRS)}"
        )


def rule_multi_node_bind_reachable(cfg: Config) -> None:
    """Rollout actors on other nodes connect to the replay queue's bind address."""
    import ipaddress

    # Any loopback address, not only the LOOPBACK_HOSTS spellings: all of 127.0.0.0/8 (e.g. the 127.0.1.1 that
    # Debian's /etc/hosts gives the host name) and ::1 however written.
    host = cfg.transport.bind_host
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        loopback = (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
    except ValueError:  # a host name
        loopback = host.lower() in LOOPBACK_HOSTS
    if cfg.placement.nnodes > 1 and loopback:
        raise ValueError(
            f"transport.bind_host ({host}) must be an interface other nodes reach (e.g. 0.0.0.0 or the address of "
            "the driver's node, where the replay queue runs) when placement.nnodes > 1"
        )


def rule_receive_budget_fits_peers(cfg: Config) -> None:
    """The receiver's zmq buffers must hold, per admitted peer, one queued message plus its extras."""
    t = cfg.transport
    peers, cap = receive_max_peers(t.max_peers, engine_ceiling(cfg)), receive_hard_cap(t.max_message_bytes)
    if t.receive_budget_bytes is not None and receive_hwm(t.receive_budget_bytes, peers, cap) < 1:
        raise ValueError(
            f"transport.receive_budget_bytes ({t.receive_budget_bytes}) must be >= {receive_min_budget(peers, cap)} "
            f"= (4 x transport.max_peers {peers} + 1) x hard cap {cap} (from transport.max_message_bytes "
            f"{t.max_message_bytes}; max_peers None = 2 x placement.max_engines): per admitted peer one queued "
            "message, one being decoded and its handshake properties"
        )


def rule_engine_ceiling_holds_start(cfg: Config) -> None:
    """A run cannot start with more engines than it may ever have."""
    pl = cfg.placement
    if pl.max_engines is not None and pl.max_engines < pl.num_engines:
        raise ValueError(f"placement.max_engines ({pl.max_engines}) must be >= placement.num_engines "
                         f"({pl.num_engines})")


# The order is the order the rules are checked in (the first broken one is reported): the data flow of the
# sections, then the timeouts from the innermost out, then the multi-node and transport rules.
CROSS_FIELD_RULES = (
    rule_mini_batch_divides_train_batch,
    rule_overlong_buffer_fits_response,
    rule_context_fits_prompt_and_response,
    rule_sft_target_level_is_configured,
    rule_weight_sync_within_staleness,
    rule_dynamic_sampling_needs_groups,
    rule_capacity_holds_staleness_window,
    rule_cuda_engine_gpus_equal_tp,
    rule_cpu_engine_has_no_gpus,
    rule_auto_engine_gpus_zero_or_tp,
    rule_every_rank_gets_a_sample,
    rule_drain_ends_before_weight_sync_timeout,
    rule_hung_engine_replaced_before_silence,
    rule_call_outlives_collective,
    rule_call_outlives_weight_push,
    rule_ticket_outlives_request,
    rule_multi_node_run_dir_shared,
    rule_multi_node_bind_reachable,
    rule_engine_ceiling_holds_start,
    rule_receive_budget_fits_peers,
)


# ---------------------------------------------------------------------------------------- loading
def _check_path(model: type[BaseModel], dotted: str) -> None:
    """Fail early, naming the whole dotted key, when an override path is not a config field."""
    cls: Any = model
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        fields = getattr(cls, "model_fields", None)
        if fields is None:
            break  # inside a dict-typed field (e.g. engine.extra_args): anything goes
        if part not in fields:
            raise ConfigError(f"{dotted}: unknown key '{part}' (known: {', '.join(sorted(fields))})")
        ann = fields[part].annotation
        cls = next(
            (a for a in (getattr(ann, "__args__", None) or (ann,)) if isinstance(a, type)
             and issubclass(a, BaseModel)),
            None,
        )
        if cls is None and depth < len(parts) - 1 and not _is_dict(fields[part].annotation):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")


def _is_dict(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict or annotation is dict


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", yaml-parsed c)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text}: override must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: value {raw!r} is not valid YAML ({exc.__class__.__name__})") from None
    return key.strip(), value


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, creating the sections on the way."""
    node = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {} if child is None else child
        node = child
    node[leaf] = value


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
        msg = str(err["ctx"]["error"])  # our own rule: drop pydantic's "Value error, " prefix
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    # Cross-field rules (CROSS_FIELD_RULES) sit at the root and name their dotted keys themselves.
    return f"{key}: {msg}{more}" if key else f"{msg}{more}"


def read_yaml_mapping(path: str | Path, kind: str = "config", error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file); ``error`` naming the file on any fault."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: {kind} file not found") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({exc})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise error(f"{path}: top level must be a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML at ``path`` (or defaults), apply ``a.b=c`` overrides, validate; ConfigError on any fault."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = read_yaml_mapping(path)
    for text in overrides or []:
        key, value = parse_override(text)
        _check_path(Config, key)
        set_dotted(tree, key, value)
    return config_from_mapping(tree)


def config_from_mapping(tree: dict[str, Any]) -> Config:
    """Validate a config given as nested sections; ConfigError naming the first key or rule at fault."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def config_yaml(cfg: Config) -> str:
    """The resolved config (all defaults filled in) as YAML, loadable as a config file."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def dump_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (:func:`config_yaml`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_yaml(cfg))
