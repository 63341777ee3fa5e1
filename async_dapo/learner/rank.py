"""FSDP2 learner ranks: train on full, mixed-outcome groups with the importance-corrected DAPO loss, and push
weights to the rollout engines without waiting for them.

One training step (every rank gets the same B groups and derives the same plan — no communication is
needed to agree on the split or the global token counts):

    plan  = batching.plan_step(groups)              # mini-batches, this rank's packed micro-batches
    prox  = logprobs under the current weights       # when the correction mode needs them
    for epoch in range(mu):
        for mini_batch in plan:
            for micro in mini_batch:                 # loss uses the GLOBAL token count of the mini-batch
                (policy_loss(...) * world_size).backward()   # FSDP averages grads over ranks
            clip grad norm; skip the update if it is not finite; AdamW; LR schedule
    version += 1

Start-up: every rank builds the model on the meta device, shards it, and reads only its own rows of each
parameter from the safetensors files (``load_local_shards``): peak memory per rank is about model / world
plus one tensor, never the whole model.

Weight push (``push_weights``, every rank): the rank's :class:`~async_dapo.weights.sync.WeightSender`
snapshots its shards and sends them in the background while the next step trains (see async_dapo.weights.sync).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_dapo.checkpoint import rank_state
from async_dapo.learner.batching import MicroBatch, PlannedMiniBatch, plan_step
from async_dapo.config import Config
from async_dapo.device import learner_backend, local_gpu_index, pin_threads, seed_everything
from async_dapo.learner.loss import entropy_and_token_prob, importance_weights, policy_loss, token_logprobs
from async_dapo.weights.shards import load_local_shards, materialize, params_on_meta
from async_dapo.weights.sync import CONTROL, WeightSender, rendezvous_endpoint, sglang_name


def learner_device(cfg: Config) -> str:
    return "cuda" if cfg.placement.learner_gpus > 0 else "cpu"


def warmup_factor(steps_done: int, warmup_steps: int) -> float:
    """LR multiplier for the training step after ``steps_done`` steps: linear from 0 over ``warmup_steps``
    training steps (verl's unit and schedule: the first step runs at 0), then 1."""
    return min(1.0, steps_done / warmup_steps) if warmup_steps else 1.0


def pad_counts(plan: list[PlannedMiniBatch]) -> dict[str, float]:
    """Padding positions and all positions of this rank's micro-batches in one pass over the plan (a
    stand-in micro-batch that only keeps collectives in step counts as padding)."""
    pad = slots = 0
    for p in plan:
        for mb in p.micro_batches:
            n = mb.attention_mask.numel()
            slots += n
            pad += n if mb.is_padding else n - int(mb.attention_mask.sum())
    return {"pad_tokens": float(pad), "slot_tokens": float(slots)}


class LearnerWorker:
    """One FSDP2 rank (wrapped by :func:`learner_actor_class` for Ray; drivable without Ray, as
    tools/gpu/gpu_smoke.py does)."""

    # fp32 master weights. Not a config choice: tests subclass with float64 to check invariances (the
    # 2-rank gradient equals the 1-rank one) where they are exact rather than within fp32 summation order.
    master_dtype = torch.float32

    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        pin_threads(1)
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.device = learner_device(cfg)
        if self.device == "cuda":
            torch.cuda.set_device(local_gpu_index())
        timeout = datetime.timedelta(seconds=cfg.learner.collective_timeout_s)
        # The timeout bounds every collective: a rank whose peer died raises instead of waiting forever.
        # On CUDA the default group is cpu:gloo,cuda:nccl, so CPU tensors (offload, DCP metadata) work too.
        dist.init_process_group(learner_backend(self.device), init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size, timeout=timeout)
        # Created in the same order on every rank. Barriers go through gloo (monitored: a missing rank is
        # named, no NCCL barrier holds a rank); the weight push gathers over a group of its own (created by
        # its sender) so that its collectives can run beside the training step's.
        self._gloo = dist.new_group(backend="gloo", timeout=timeout)
        self.weights = WeightSender(cfg, rank, world_size, self.device, timeout)
        # Same seed on every rank: the model init and any dropout must agree across FSDP shards.
        seed_everything(cfg.logging.seed)
        self.model = self._build_model()
        lc = cfg.learner
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=lc.betas,
                                           weight_decay=lc.weight_decay)
        # Stepped once per training step (not per mini-batch update): warm-up counts training steps.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_factor(s, lc.warmup_steps))
        self.version = 0
        self.skipped_updates = 0
        self.pad_id = self.model.config.pad_token_id or 0

    def _build_model(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        lc, mc = self.cfg.learner, self.cfg.model
        config = AutoConfig.from_pretrained(mc.path, trust_remote_code=mc.trust_remote_code)
        with params_on_meta():  # no rank ever holds the whole model (see shards.load_local_shards)
            model = AutoModelForCausalLM.from_config(config, dtype=self.master_dtype,
                                                     trust_remote_code=mc.trust_remote_code)
        if lc.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mesh = init_device_mesh(self.device, (self.world,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if lc.param_dtype == "bfloat16":  # fp32 master weights, bf16 compute: pure bf16 loses small updates
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if lc.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        materialize(model, "cpu" if lc.cpu_offload else self.device)
        named = [(sglang_name(n), p) for n, p in model.named_parameters()]
        load_local_shards(named, Path(mc.path), self.world, self.rank)
        return model

    def ready(self) -> int:
        """Returns once the rank is constructed (its process group and model are up)."""
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ forward
    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        # The model's own dtype, unscaled: token_logprobs upcasts and divides by T chunk by chunk, so no
        # full-vocabulary fp32 copy of a micro-batch's logits is ever made. logits_to_keep: the last
        # position has no target, and slicing it off afterwards would cost a full-size zero gradient.
        keep = torch.arange(mb.input_ids.shape[1] - 1, device=mb.input_ids.device)
        return self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=keep).logits

    def _token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Behaviour logprobs are log_softmax(logits / T) (SGLang's default): the same quantity.
        return token_logprobs(logits, targets, temperature=self.cfg.rollout.temperature,
                              chunk_tokens=self.cfg.learner.logprob_chunk_tokens)

    @torch.no_grad()
    def _proximal(self, plan: list[PlannedMiniBatch]) -> list[list[torch.Tensor | None]]:
        """Logprobs of every micro-batch under the weights at the start of the step. The first mini-batch's
        are left None: its first training forward runs under exactly those weights, so _micro_loss fills
        them in from there (one forward pass per step saved; the whole pass when a step is one mini-batch)."""
        first = [None] * len(plan[0].micro_batches) if plan else []
        return [first] + [[self.logprobs(mb) for mb in p.micro_batches] for p in plan[1:]]

    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Per-token logprobs of ``mb``'s targets under the current weights (one forward; the caller
        chooses grad mode and train/eval mode)."""
        return self._token_logprobs(self._logits(mb), mb.targets)

    def plan(self, groups) -> list[PlannedMiniBatch]:
        """This rank's share of a step on ``groups`` (``batching.plan_step``), on the learner's device."""
        a, lc = self.cfg.algorithm, self.cfg.learner
        plan = plan_step(groups, world_size=self.world, rank=self.rank, groups_per_mini_batch=lc.mini_batch_groups,
                         token_budget=lc.micro_batch_tokens, pad_id=self.pad_id,
                         overlong_filtering=a.overlong_filtering, scale_by_std=a.scale_adv_by_std)
        return [dataclasses.replace(p, micro_batches=[mb.to(self.device) for mb in p.micro_batches]) for p in plan]

    def _micro_loss(self, mb: MicroBatch, proxs: list | None, i: int, p: PlannedMiniBatch, sums: dict) -> torch.Tensor:
        a = self.cfg.algorithm
        logits = self._logits(mb)
        logp = self._token_logprobs(logits, mb.targets)
        if proxs is not None and proxs[i] is None:  # see _proximal: these weights are the proximal policy
            proxs[i] = logp.detach()
        prox = proxs[i] if proxs is not None else None
        mode = a.correction.mode
        old = mb.behav_logprobs if mode == "naive" or prox is None else prox
        isw = None
        if mode == "decoupled" and prox is not None:
            c = a.correction
            isw = importance_weights(prox, mb.behav_logprobs, mb.loss_mask, level=c.is_level, mode=c.is_mode,
                                     cap=c.is_cap, low=c.is_low)
        loss, m = policy_loss(logp, old, mb.advantages, mb.loss_mask, clip_low=a.clip_low, clip_high=a.clip_high,
                              clip_c=a.clip_c, is_weights=isw, agg=a.loss_agg_mode,
                              num_tokens=max(p.num_tokens, 1), num_seqs=max(p.num_seqs, 1))
        self._accumulate(sums, mb, logits.detach(), m, prox, isw, loss.detach())
        return loss

    def _accumulate(self, sums: dict, mb: MicroBatch, logits, m: dict, prox, isw, loss) -> None:
        """Token-weighted metric sums (reduced over ranks at the end of the step)."""
        n = float(mb.num_tokens)
        if n == 0:
            return
        mask = mb.loss_mask
        ent, prob = entropy_and_token_prob(logits, mb.targets, mask, temperature=self.cfg.rollout.temperature,
                                           chunk_size=self.cfg.learner.logprob_chunk_tokens)
        adv, inf = mb.advantages[mask], float("inf")
        add = {"tokens": n, "loss": loss.item(), "entropy": ent.sum().item(), "token_prob": prob.sum().item(),
               **{k: m[k].item() * n for k in ("pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_low_side",
                                               "pg_clipfrac_lower")}, "ppo_kl": m["ppo_kl"].item() * n,
               "advantages": adv.sum().item()}
        sums["advantages_max"] = max(sums.get("advantages_max", -inf), adv.max().item())
        sums["advantages_min"] = min(sums.get("advantages_min", inf), adv.min().item())
        if prox is not None:
            add["rollout_logprob_abs_diff"] = (prox - mb.behav_logprobs).abs()[mask].sum().item()
        if isw is not None:
            add["is_weight"] = isw[mask].sum().item()
            sums["is_weight_max"] = max(sums.get("is_weight_max", 0.0), isw[mask].max().item())
        for k, v in add.items():
            sums[k] = sums.get(k, 0.0) + v

    def _backward_mini_batch(self, p: PlannedMiniBatch, prox: list[torch.Tensor | None] | None, sums: dict) -> None:
        for i, mb in enumerate(p.micro_batches):
            loss = self._micro_loss(mb, prox, i, p, sums)
            # FSDP averages gradients over ranks; the loss contract wants their SUM.
            (loss * self.world).backward()

    # ------------------------------------------------------------------ step
    def train_step(self, groups) -> dict[str, float]:
        """One DAPO step on B groups; returns rank-reduced metrics. Every rank must call it."""
        t0 = time.perf_counter()
        lc = self.cfg.learner
        self.model.train()
        plan = self.plan(groups)
        prox = self._proximal(plan) if self.cfg.algorithm.correction.mode != "naive" else None
        sums: dict[str, float] = pad_counts(plan)
        norms = []
        lr = self.scheduler.get_last_lr()[0]  # this step's (the schedule moves once per training step)
        for _ in range(lc.epochs):
            for j, p in enumerate(plan):
                self.optimizer.zero_grad(set_to_none=True)
                self._backward_mini_batch(p, prox[j] if prox is not None else None, sums)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                norms.append(norm.item())
                if torch.isfinite(norm):
                    self.optimizer.step()
                else:  # a poisoned batch must not poison the weights
                    self.skipped_updates += 1
                    self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.version += 1
        out = self._reduce(sums)
        out.update(grad_norm_max=max(norms), grad_norm_mean=sum(norms) / len(norms),
                   skipped_updates=float(self.skipped_updates), version=float(self.version), lr=lr,
                   train_s=time.perf_counter() - t0)
        return out

    def _reduce(self, sums: dict[str, float]) -> dict[str, float]:
        keys = ["tokens", "loss", "entropy", "token_prob", "pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_low_side",
                "pg_clipfrac_lower", "ppo_kl", "advantages", "rollout_logprob_abs_diff", "is_weight", "pad_tokens",
                "slot_tokens"]
        vec = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        # maxima over ranks; the minimum as the max of its negation (a rank without tokens adds -inf)
        inf = float("inf")
        top = torch.tensor([sums.get("is_weight_max", 0.0), sums.get("advantages_max", -inf),
                            -sums.get("advantages_min", inf)], dtype=torch.float64)
        if self.device == "cuda":
            vec, top = vec.cuda(), top.cuda()
        dist.all_reduce(vec)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        total = dict(zip(keys, vec.tolist()))
        tokens = max(total.pop("tokens"), 1.0)
        pad, slots = total.pop("pad_tokens"), total.pop("slot_tokens")
        out = {k: v / tokens for k, v in total.items() if k != "loss"}
        is_max, adv_max, neg_adv_min = top.tolist()
        finite = adv_max != -inf  # no loss-bearing token on any rank: report 0
        out.update(loss=total["loss"], train_tokens=tokens, is_weight_max=is_max, pad_ratio=pad / max(slots, 1.0),
                   advantages_max=adv_max if finite else 0.0, advantages_min=-neg_adv_min if finite else 0.0)
        return out

    # ------------------------------------------------------------------ diagnostics (no caller in a run)
    def gradients(self, groups) -> dict[str, torch.Tensor]:
        """Full gradients of the FIRST mini-batch of ``groups`` (no optimizer step): the learner's one
        debug interface, for checks that the split over ranks and the global normalisation are exact
        (tests) and that bf16 compute matches fp32 (tools/gpu/gpu_smoke.py). Every rank must call it; all
        return the same dict."""
        self.model.train()
        plan = self.plan(groups)
        prox = self._proximal(plan) if self.cfg.algorithm.correction.mode != "naive" else None
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_mini_batch(plan[0], prox[0] if prox is not None else None, {})
        grads = {n: p.grad.full_tensor().cpu() for n, p in self.model.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    # ------------------------------------------------------------------ weight push (async_dapo.weights.sync)
    def open_weight_group(self, master_addr: str, master_port: int, world_size: int, group_name: str,
                          dtype: str | None = None, join_timeout_s: float | None = None) -> None:
        """Rank 0 only: become rank 0 of the weight-update group ``group_name`` (engines join concurrently,
        at most ``join_timeout_s``) and push in the engines' weight ``dtype`` (None = rollout.engine.dtype as
        this rank's device would resolve it, for direct drivers and tests). An earlier group is closed first."""
        self.weights.open(master_addr, master_port, world_size, group_name, dtype, join_timeout_s)

    def close_weight_group(self) -> None:
        self.weights.close()

    def weight_group_endpoint(self) -> tuple[str, int]:
        """Rank 0: (host, free port) on this node for the next weight group's rendezvous (asked of the
        rank itself, which is up, rather than of a new Ray task, whose worker would first import torch)."""
        return rendezvous_endpoint(self.cfg.transport.bind_host)

    def push_weights(self, engines: list, on_loaded=None, version: int | None = None) -> dict[str, float]:
        """Stream the current weights (``version``, default this rank's) to ``engines``; every rank must
        call it. Returns once this rank's shards are snapshotted; rank 0 calls ``on_loaded(version)`` once
        the engines report them loaded (``weight_sync.WeightSender.push``). Without engines or a callback
        (tools/gpu/gpu_smoke.py) Ray is never touched."""
        return self.weights.push(self.model.named_parameters(), self.version if version is None else version,
                                 engines, on_loaded)

    def wait_push(self) -> float:
        """Wait for the previous push, at most 2 × weight_sync.timeout_s; raises if it failed."""
        return self.weights.wait()

    def push_idle(self) -> bool:
        """No push in flight (never waits: the supervisor asks it between its polls)."""
        return self.weights.idle()

    def last_push(self) -> dict[str, Any]:
        return self.weights.last()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """DCP of model + optimizer (sharded), plus LR schedule, version and RNG states per rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        # JSON, not a pickle: --resume must not run code from the checkpoint directory (async_dapo.checkpoint.rank_state).
        state = rank_state.capture(self.scheduler.state_dict(), self.version, self.skipped_updates)
        rank_state.write(rank_state.state_path(path, self.rank), state)
        self._barrier(f"checkpoint {path}")

    def load_checkpoint(self, path: str) -> int:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from async_dapo.checkpoint import safe_dcp

        # Read and checked first: a rank state that is refused leaves the model and optimizer untouched.
        state_file = rank_state.state_path(path, self.rank)
        extra = rank_state.read(state_file)
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        # Not dcp.load's own reader and planner: they unpickle .metadata and the optimizer's non-tensor
        # entries unrestricted (docs/reliability.md, "What a checkpoint directory is trusted with").
        safe_dcp.load(state, path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.version, self.skipped_updates = rank_state.restore(state_file, extra, self.scheduler)
        return self.version

    def export_hf(self, path: str) -> None:
        """An HF-format copy of the current policy (config, tokenizer, safetensors); every rank calls."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        mc = self.cfg.model
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:  # the model object only carries config and tie rules: its parameters stay on meta
            with params_on_meta():
                model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(mc.path, trust_remote_code=mc.trust_remote_code), dtype=torch.float32)
            model.save_pretrained(path, state_dict={sglang_name(k): v for k, v in full.items()},
                                  safe_serialization=True)
            AutoTokenizer.from_pretrained(mc.path, trust_remote_code=mc.trust_remote_code).save_pretrained(path)
        self._barrier(f"export to {path}")

    def _barrier(self, what: str) -> None:
        """All ranks meet over gloo, bounded by learner.collective_timeout_s; a rank that does not come is
        named in the error (no NCCL barrier ever holds a rank)."""
        dist.monitored_barrier(group=self._gloo, timeout=datetime.timedelta(
            seconds=self.cfg.learner.collective_timeout_s))

    def shutdown(self) -> None:
        self.weights.shutdown()
        dist.destroy_process_group()


def learner_actor_class(cfg: Config, worker: type = LearnerWorker, **options):
    """``ray.remote`` wrapper of ``worker`` (LearnerWorker or a subclass of it) with the configured resources
    (``options``: extra Ray actor options)."""
    import ray

    p = cfg.placement
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # (concurrency groups cannot be given to .options(): they belong to the class)
    return ray.remote(concurrency_groups={CONTROL: 1})(worker).options(
        num_cpus=p.learner_cpus, num_gpus=p.learner_gpus, runtime_env={"env_vars": env}, **options)
