"""verl → async_dapo: a verl DAPO launch script (or its Hydra overrides) as this project's config.

``async-dapo from-verl SCRIPT_OR_OVERRIDES... > config.yaml`` reads the ``key=value`` overrides of a verl
launch script (its shell variables expanded as bash would, from the script's own assignments and the
environment), maps every key that has an equivalent here, and writes the config as YAML on stdout. On stderr
it lists every key it mapped, every key with no equivalent and why, and the fields it derived from
several keys (the deployment: verl time-shares every GPU between generation and training, this project
gives half of them to engines and half to learner ranks).

The mapping follows docs/algorithm.md ("Where we differ from verl and why"); a key this table does not know
is reported, never dropped silently.
"""
from __future__ import annotations

import ast
import operator
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from async_dapo.config import Config, set_dotted

_ASSIGN = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
_OVERRIDE = re.compile(r"^\+{0,2}([A-Za-z_][\w]*(?:\.[\w]+)+)=(.*)$", re.S)
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(?::-((?:[^{}]|\{[^{}]*\})*))?\}|\$([A-Za-z_]\w*)")


# ---------------------------------------------------------------------------------------- the script
def logical_lines(text: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return re.sub(r"\\\n", " ", text).splitlines()


def expand(text: str, env: Mapping[str, str]) -> str:
    """``text`` with ``$((...))``, ``${X:-default}``, ``${X}`` and ``$X`` expanded (not inside single quotes)."""
    parts = re.split(r"('[^']*')", text)  # the single-quoted parts stay literal, as in bash
    return "".join(p if p.startswith("'") else _expand_vars(_expand_arith(p, env), env) for p in parts)


def _expand_vars(text: str, env: Mapping[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if env.get(name):
            return env[name]
        return expand(m.group(2), env).strip('"') if m.group(2) is not None else ""
    return _VAR.sub(one, text)


def _expand_arith(text: str, env: Mapping[str, str]) -> str:
    while (start := text.find("$((")) >= 0:
        depth, i = 0, start + 1
        for i in range(start + 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        if depth:
            raise ValueError(f"unbalanced $(( in: {text.strip()[:120]}")
        inner = text[start + 3:i - 1]
        text = text[:start] + str(arith(_expand_vars(inner, env), env)) + text[i + 1:]
    return text


_OPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                              ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod}


def arith(expr: str, env: Mapping[str, str]) -> int:
    """Bash integer arithmetic: + - * / % and parentheses over integers and variable names."""
    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(env.get(node.id, "0") or 0)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported shell arithmetic: $(({expr}))")
    try:
        return ev(ast.parse(expr.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"unsupported shell arithmetic: $(({expr}))") from None


def script_overrides(text: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The Hydra overrides (``key=value``, a leading ``+`` dropped) of a launch script, in order, with
    its variables expanded: the script's own assignments, each taking ``environ``'s value where the script
    says ``${X:-default}``."""
    env, found = dict(environ), {}
    for line in logical_lines(text):
        try:
            words = shlex.split(expand(line, env), comments=True)
        except ValueError as exc:
            raise ValueError(f"cannot read this line of the script: {line.strip()[:120]} ({exc})") from None
        if len(words) == 1 and (m := _ASSIGN.match(words[0])):
            env[m.group(1)] = m.group(2)
            continue
        for word in words:
            if m := _OVERRIDE.match(word):
                found[m.group(1)] = m.group(2)
    return found


def parse_overrides(words: list[str]) -> dict[str, str]:
    """Overrides given on the command line (``key=value`` each)."""
    found = {}
    for word in words:
        if not (m := _OVERRIDE.match(word)):
            raise ValueError(f"not a key=value override: {word!r}")
        found[m.group(1)] = m.group(2)
    return found


# ---------------------------------------------------------------------------------------- the mapping
def _num(v: str) -> Any:
    """A Hydra value: a number as Python reads it (YAML 1.1 would keep ``1e-6`` a string), else as YAML reads
    it (booleans, lists, strings); the shell has removed the quotes already."""
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return yaml.safe_load(v) if v.strip() else None


ACTOR, ROLLOUT = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
# verl key -> this project's key; the value converts as YAML reads it.
DIRECT = {
    "data.train_files": "data.train", "data.val_files": "data.val",
    "data.max_prompt_length": "data.max_prompt_length", "data.truncation": "data.truncation",
    "data.max_response_length": "rollout.max_response_length",
    "data.train_batch_size": "algorithm.train_batch_groups",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "learner.activation_checkpointing",
    ROLLOUT + "n": "rollout.n", ROLLOUT + "temperature": "rollout.temperature", ROLLOUT + "top_p": "rollout.top_p",
    ROLLOUT + "top_k": "rollout.top_k", ROLLOUT + "tensor_model_parallel_size": "rollout.engine.tp_size",
    ROLLOUT + "dtype": "rollout.engine.dtype",
    ROLLOUT + "val_kwargs.temperature": "logging.val_temperature", ROLLOUT + "val_kwargs.top_p": "logging.val_top_p",
    ACTOR + "clip_ratio_low": "algorithm.clip_low", ACTOR + "clip_ratio_high": "algorithm.clip_high",
    ACTOR + "clip_ratio_c": "algorithm.clip_c", ACTOR + "loss_agg_mode": "algorithm.loss_agg_mode",
    ACTOR + "optim.lr": "learner.lr", ACTOR + "optim.lr_warmup_steps": "learner.warmup_steps",
    ACTOR + "optim.weight_decay": "learner.weight_decay", ACTOR + "grad_clip": "learner.grad_clip",
    ACTOR + "ppo_mini_batch_size": "learner.mini_batch_groups", ACTOR + "ppo_epochs": "learner.epochs",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling.enable",
    "algorithm.filter_groups.metric": "algorithm.dynamic_sampling.metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.dynamic_sampling.max_gen_rounds",
    "trainer.total_training_steps": "learner.total_steps", "trainer.test_freq": "logging.val_every_steps",
    "trainer.save_freq": "checkpoint.every_steps", "trainer.val_before_train": "logging.val_before_train",
    "trainer.nnodes": "placement.nnodes", "trainer.default_local_dir": "logging.run_dir",
}
# The overlong shaping moved between verl versions: every spelling maps to the same fields.
for _prefix in ("custom_reward_function.overlong_buffer.", "reward_model.overlong_buffer.",
                "reward_model.reward_kwargs.overlong_buffer_cfg."):
    DIRECT.update({_prefix + "enable": "reward.overlong_buffer_enable", _prefix + "len": "reward.overlong_buffer_length",
                   _prefix + "penalty_factor": "reward.overlong_penalty_factor"})

# verl keys (or prefixes, ending in ".") with no equivalent here, and why.
NO_EQUIVALENT = {
    "data.gen_batch_size": "admission refills what dynamic sampling drops, up to max_gen_rounds batches' worth",
    "data.prompt_key": "rows are read with verl's `prompt` column",
    "actor_rollout_ref.hybrid_engine": "engines and learner ranks run on separate GPUs (no time-sharing)",
    ROLLOUT + "name": "the engines are SGLang",
    ROLLOUT + "gpu_memory_utilization": "vLLM's fraction of the whole GPU; SGLang's rollout.engine.mem_fraction_static "
                                        "counts weights + KV cache (sized in docs/memory.md)",
    ROLLOUT + "enable_chunked_prefill": "SGLang's default", ROLLOUT + "max_num_batched_tokens": "SGLang's default",
    ROLLOUT + "log_prob_": "the learner computes log-probabilities itself",
    ROLLOUT + "val_kwargs.n": "the validation set is deduplicated at load and each problem sampled logging.val_n "
                              "times (verl repeats rows and samples each once)",
    ROLLOUT + "val_kwargs.do_sample": "validation samples at logging.val_temperature",
    ROLLOUT + "val_kwargs.top_k": "validation uses rollout.top_k",
    "actor_rollout_ref.ref.": "no reference model: DAPO has no KL term",
    "actor_rollout_ref.model.use_remove_padding": "sequences are always packed",
    "actor_rollout_ref.model.override_config.": "the model's own config is used",
    ACTOR + "use_dynamic_bsz": "micro-batches are always packed to learner.micro_batch_tokens",
    ACTOR + "ppo_max_token_len_per_gpu": "learner.micro_batch_tokens is set by memory (tools/cluster/memory_model.py)",
    ACTOR + "ulysses_sequence_parallel_size": "no sequence parallelism",
    ACTOR + "fsdp_config.param_offload": "verl offloads because its hybrid engine hands the GPUs to the rollout "
                                         "between phases; here the learner ranks keep their GPUs (learner.cpu_offload "
                                         "exists for GPUs too small: tools/cluster/memory_model.py)",
    ACTOR + "fsdp_config.optimizer_offload": "see fsdp_config.param_offload",
    ACTOR + "fsdp_config.fsdp_size": "FSDP2 shards over every learner rank",
    ACTOR + "entropy_coeff": "no entropy bonus (DAPO uses none)",
    ACTOR + "use_kl_loss": "no KL term (DAPO drops it)", ACTOR + "kl_loss_coef": "no KL term (DAPO drops it)",
    "algorithm.kl_ctrl.": "no KL term (DAPO drops it)", "algorithm.use_kl_in_reward": "no KL term (DAPO drops it)",
    "reward_model.reward_manager": "the DAPO reward (reward.function for your own)",
    "reward_model.overlong_buffer.log": "the penalty is always logged (reward/overlong_penalty)",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "the penalty is always logged",
    "reward_model.reward_kwargs.max_resp_len": "rollout.max_response_length",
    "trainer.logger": "TensorBoard (and metrics.jsonl)", "trainer.project_name": "logging.run_dir names the run",
    "trainer.experiment_name": "logging.run_dir names the run", "trainer.resume_mode": "async-dapo train --resume",
    "trainer.n_gpus_per_node": "used to derive the placement (below)", "trainer.total_epochs":
        "runs are counted in steps (learner.total_steps)", "trainer.log_val_generations": "not logged",
}


@dataclass
class Conversion:
    config: dict[str, Any] = field(default_factory=dict)  # nested, as the YAML
    mapped: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)

    def set(self, dotted: str, value: Any) -> None:
        set_dotted(self.config, dotted, value)

    def get(self, dotted: str, default: Any = None) -> Any:
        node = self.config
        for p in dotted.split("."):
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node

    def report(self) -> str:
        by_hand = [f"{key}: {why}" for key, why in SET_BY_HAND.items()]
        return "\n".join(["# mapped (verl -> here):", *self.mapped, "# derived (no verl key):", *self.derived,
                          "# no equivalent here:", *self.unmapped, "# to set for your cluster (no verl key):",
                          *by_hand]) + "\n"


def _no_equivalent(key: str) -> str | None:
    if key in NO_EQUIVALENT:
        return NO_EQUIVALENT[key]
    return next((why for k, why in NO_EQUIVALENT.items() if k.endswith((".", "_")) and key.startswith(k)), None)


def convert(overrides: Mapping[str, str]) -> Conversion:
    """This project's config from verl overrides: each key mapped, derived or reported."""
    out = Conversion()
    for key, raw in overrides.items():
        value = _num(raw)
        if key in DIRECT:
            out.set(DIRECT[key], value)
            out.mapped.append(f"{key}={raw} -> {DIRECT[key]}: {value!r}")
        elif key in ("custom_reward_function.path", "custom_reward_function.name"):
            continue  # one field here: see _reward_function
        elif key == "algorithm.adv_estimator":
            if value != "grpo":
                raise ValueError(f"algorithm.adv_estimator={value}: only grpo (DAPO's group-normalised advantage)")
            out.set("algorithm.scale_adv_by_std", True)
            out.mapped.append(f"{key}={raw} -> algorithm.scale_adv_by_std: True")
        elif why := _no_equivalent(key):
            out.unmapped.append(f"{key}={raw}: {why}")
        else:
            out.unmapped.append(f"{key}={raw}: unknown to this converter (not mapped)")
    _reward_function(out, overrides)
    _derive(out, overrides)
    return out


def _reward_function(out: Conversion, overrides: Mapping[str, str]) -> None:
    """verl's custom_reward_function (a file and a function name, default compute_score) is reward.function,
    ``path:name``, called the same way (data_source, solution_str, ground_truth, extra_info)."""
    path, name = overrides.get("custom_reward_function.path"), overrides.get("custom_reward_function.name")
    if path and path not in ("null", "None"):
        function = f"{path}:{name or 'compute_score'}"
        out.set("reward.function", function)
        out.mapped.append(f"custom_reward_function.path={path} name={name or 'compute_score'} -> reward.function: "
                          f"{function!r}")
    elif name is not None or path is not None:
        out.unmapped.append(f"custom_reward_function.path={path} name={name}: no file: the built-in DAPO reward")


def _derive(out: Conversion, overrides: Mapping[str, str]) -> None:
    """The fields verl has no key for: a real model, CUDA engines, and a placement that splits the GPUs."""
    def derive(key: str, value: Any, why: str) -> None:
        out.set(key, value)
        out.derived.append(f"{key}: {value!r} ({why})")

    base = Config()  # this project's defaults, for what the overrides leave out
    derive("model.bootstrap", None, "a model from model.path, not the built-in tiny one")
    derive("rollout.engine.device", "cuda", "GPU engines")
    if out.get("rollout.engine.dtype") is None:
        derive("rollout.engine.dtype", "bfloat16", "verl's default rollout dtype")
    prompt = out.get("data.max_prompt_length", base.data.max_prompt_length)
    response = out.get("rollout.max_response_length", base.rollout.max_response_length)
    derive("rollout.engine.context_length", prompt + response, "max_prompt_length + max_response_length")
    nodes, per_node = out.get("placement.nnodes", 1), int(_num(overrides.get("trainer.n_gpus_per_node", "8")))
    tp = out.get("rollout.engine.tp_size", 1)
    gpus = nodes * per_node
    engines, learners = max(1, gpus // 2 // tp), max(1, gpus // 2)
    derive("placement.num_engines", engines, f"half of the {gpus} GPUs generate, tp_size {tp} each")
    derive("placement.engine_gpus", tp, "one GPU per tensor-parallel rank")
    derive("placement.learner_ranks", learners, f"the other half of the {gpus} GPUs train")
    derive("placement.learner_gpus", 1, "one GPU per learner rank")
    derive("replay.max_staleness", 0, "verl's recipe is synchronous (eta = 0)")
    derive("algorithm.correction.mode", "none", "synchronous: the behaviour policy is the current one")
    derive("rollout.update_mode", "abort", "synchronous: a group still running when new weights arrive is resampled")
    batch = out.get("algorithm.train_batch_groups", base.algorithm.train_batch_groups)
    derive("rollout.max_inflight_prompts", max(1, batch // engines), "eta = 0 admits one batch, spread over the engines")
    derive("replay.capacity_groups", 4 * batch, "at least (eta + 1) batches; 4 leave room for what admission "
           "over-generates while dynamic sampling drops groups")
    derive("weight_sync.backend", "nccl", "GPU weight push")
    derive("learner.param_dtype", "bfloat16", "verl's FSDP mixed precision computes in bf16")
    derive("rollout.engine.max_total_tokens", None, "a GPU engine sizes its KV cache by mem_fraction_static")
    if nodes > 1:
        derive("transport.bind_host", "0.0.0.0", "several nodes: the queue must be reachable from every node")


# What a cluster config sets that no verl key says (verl decides it elsewhere or not at all): listed in the
# report with the value the conversion leaves, to be set for the cluster at hand. configs/dapo_qwen2.5_32b_16x8.yaml
# is the 32B recipe's conversion with exactly these set (a test checks it).
SET_BY_HAND = {
    "learner.total_steps": "verl counts trainer.total_epochs; here a run is counted in steps",
    "learner.micro_batch_tokens": "what fits a learner GPU (python tools/cluster/memory_model.py CONFIG)",
    "rollout.engine.mem_fraction_static": "SGLang's share of an engine GPU for weights + KV cache (docs/memory.md)",
    "rollout.request_timeout_s": "the longest a response may take: long responses need more than the default",
    "replay.ticket_ttl_s": "must exceed rollout.request_timeout_s",
    "weight_sync.bucket_mb": "bytes per broadcast of the weight push",
    "placement.engine_cpus": "CPUs per engine on your nodes", "placement.learner_cpus": "CPUs per learner rank",
    "logging.val_prompts": "validation problems after deduplication (AIME 2024: 30)",
    "logging.val_n": "samples per validation problem (verl repeats rows instead: val_kwargs.n is per row)",
    "checkpoint.keep_last": "checkpoints kept (verl: trainer.max_actor_ckpt_to_keep)",
}


def to_yaml(conversion: Conversion) -> str:
    return yaml.safe_dump(conversion.config, sort_keys=False)
