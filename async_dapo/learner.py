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

Weight push: all ranks gather the full parameters bucket by bucket (FSDP all-gather); rank 0 hands each
bucket to a sender thread that broadcasts it over the dedicated weight-update group while the engines load
it, and returns at once. The gathered tensors are explicit copies, so the next optimizer step cannot change
what is being sent. A bounded hand-off (2 buckets) bounds the extra memory; the next push first waits for
the previous one; when the engines report the new weights loaded, the sender tells the replay queue the
new version.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_mod
import random
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_dapo.batching import MicroBatch, PlannedMiniBatch, plan_step
from async_dapo.config import Config
from async_dapo.device import dist_backend, engine_dtype, pin_threads, resolve_device, seed_everything
from async_dapo.loss import entropy_and_token_prob, importance_weights, policy_loss
from async_dapo.weight_sync import broadcast_bucket, close_update_group, open_update_group, plan_buckets

WEIGHT_GROUP = "async_dapo_weights"  # + a generation suffix: the group is rebuilt when an engine is replaced
# Wrappers that FSDP2 / activation checkpointing / torch.compile may insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def sglang_name(name: str) -> str:
    """The name SGLang's loader expects for a learner parameter. SGLang loads HF checkpoint names (its
    Qwen2/Qwen3/Llama ``load_weights`` stacks q/k/v and gate/up itself), so the mapping is: strip the
    wrapper prefixes that training-side wrappers insert, keep the HF name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def learner_device(cfg: Config) -> str:
    return "cuda" if cfg.placement.learner_gpus > 0 else "cpu"


class LearnerWorker:
    """One FSDP2 rank (wrapped by :func:`learner_actor_class` for Ray)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        pin_threads(1)
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.device = learner_device(cfg)
        if self.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
        # The timeout bounds every collective: a rank whose peer died raises instead of waiting forever.
        dist.init_process_group(dist_backend(self.device), init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=cfg.learner.collective_timeout_s))
        # Same seed on every rank: the model init and any dropout must agree across FSDP shards.
        seed_everything(cfg.logging.seed)
        self.model = self._build_model()
        lc = cfg.learner
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lc.lr, betas=lc.betas,
                                           weight_decay=lc.weight_decay)
        warm = lc.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.version = 0
        self.skipped_updates = 0
        self.pad_id = self.model.config.pad_token_id or 0
        self._weight_pg = None
        self._weight_group_name = WEIGHT_GROUP
        # The push in flight (rank 0): its sender thread and the result dict only that thread writes.
        self._push_thread: threading.Thread | None = None
        self._push_state: dict[str, Any] = {}
        self._push_result: dict[str, Any] = {}  # the last finished push

    def _build_model(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        lc = self.cfg.learner
        model = AutoModelForCausalLM.from_pretrained(self.cfg.model.path, torch_dtype=torch.float32,
                                                     trust_remote_code=self.cfg.model.trust_remote_code)
        if lc.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        mesh = init_device_mesh(self.device, (self.world,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if lc.param_dtype == "bfloat16":  # fp32 master weights, bf16 compute: pure bf16 loses small updates
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if lc.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def ready(self) -> int:
        """Returns once the rank is constructed (its process group and model are up)."""
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ forward
    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        out = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        # Behaviour logprobs are log_softmax(logits / T) (SGLang's default): scale the same way.
        return out.logits[:, :-1].float() / self.cfg.rollout.temperature

    @staticmethod
    def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)

    @torch.no_grad()
    def _proximal(self, plan: list[PlannedMiniBatch]) -> list[list[torch.Tensor | None]]:
        """Logprobs of every micro-batch under the weights at the start of the step. The first mini-batch's
        are left None: its first training forward runs under exactly those weights, so _micro_loss fills
        them in from there (one forward pass per step saved; the whole pass when a step is one mini-batch)."""
        first = [None] * len(plan[0].micro_batches) if plan else []
        return [first] + [[self._token_logprobs(self._logits(mb), mb.targets) for mb in p.micro_batches]
                          for p in plan[1:]]

    def _plan(self, groups) -> list[PlannedMiniBatch]:
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
        ent, prob = entropy_and_token_prob(logits, mb.targets, mask)
        add = {"tokens": n, "loss": loss.item(), "entropy": ent.sum().item(), "token_prob": prob.sum().item(),
               "pg_clipfrac_upper": m["pg_clipfrac_upper"].item() * n,
               "pg_clipfrac_lower": m["pg_clipfrac_lower"].item() * n, "ppo_kl": m["ppo_kl"].item() * n}
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
        plan = self._plan(groups)
        prox = self._proximal(plan) if self.cfg.algorithm.correction.mode != "naive" else None
        sums: dict[str, float] = {}
        norms = []
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
        out.update(grad_norm=max(norms), skipped_updates=float(self.skipped_updates), version=float(self.version),
                   lr=self.scheduler.get_last_lr()[0], train_s=time.perf_counter() - t0)
        return out

    def _reduce(self, sums: dict[str, float]) -> dict[str, float]:
        keys = ["tokens", "loss", "entropy", "token_prob", "pg_clipfrac_upper", "pg_clipfrac_lower", "ppo_kl",
                "rollout_logprob_abs_diff", "is_weight"]
        vec = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        top = torch.tensor([sums.get("is_weight_max", 0.0)], dtype=torch.float64)
        if self.device == "cuda":
            vec, top = vec.cuda(), top.cuda()
        dist.all_reduce(vec)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        total = dict(zip(keys, vec.tolist()))
        tokens = max(total.pop("tokens"), 1.0)
        out = {k: v / tokens for k, v in total.items() if k != "loss"}
        out.update(loss=total["loss"], train_tokens=tokens, is_weight_max=top.item())
        return out

    def gradients(self, groups) -> dict[str, torch.Tensor]:
        """Full gradients of the FIRST mini-batch of ``groups`` (no optimizer step); for tests that prove
        the split and the global normalisation. Every rank must call it; all return the same dict."""
        self.model.train()
        plan = self._plan(groups)
        prox = self._proximal(plan) if self.cfg.algorithm.correction.mode != "naive" else None
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_mini_batch(plan[0], prox[0] if prox is not None else None, {})
        grads = {n: p.grad.full_tensor().cpu() for n, p in self.model.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        return grads

    # ------------------------------------------------------------------ weight push
    def open_weight_group(self, master_addr: str, master_port: int, world_size: int, group_name: str) -> None:
        """Rank 0 only: become rank 0 of the weight-update group ``group_name`` (engines join concurrently).
        An earlier group is destroyed first, which also fails any engine still waiting on it."""
        ws = self.cfg.weight_sync
        self.close_weight_group()
        self._weight_pg = open_update_group(master_addr, master_port, world_size, group_name,
                                            dist_backend(self.device, ws.backend), ws.timeout_s)
        self._weight_group_name = group_name

    def close_weight_group(self) -> None:
        """Abandon the current weight-update group (an engine of it died): join the sender, whatever its
        outcome (its broadcasts are bounded by the group's timeout), then destroy the group — never under
        a sender that is still using it."""
        if self._join_sender(self.cfg.weight_sync.timeout_s + 30) is not None:
            raise RuntimeError(f"weight push of version {self._push_state['version']}: sender still busy; "
                               "cannot rebuild the weight group")
        if self._weight_pg is not None:
            try:
                close_update_group(self._weight_pg)
            except Exception:  # a group whose peer died may refuse a clean destroy; it is dropped anyway
                pass
            self._weight_pg = None

    def _push_plan(self):
        dtype = getattr(torch, engine_dtype(resolve_device(self.cfg.rollout.engine.device),
                                            self.cfg.rollout.engine.dtype))
        params = [(n, p) for n, p in self.model.named_parameters()]
        meta = [(sglang_name(n), dtype, tuple(p.shape)) for n, p in params]
        buckets = plan_buckets(meta, self.cfg.weight_sync.bucket_mb << 20)
        by_name = {sglang_name(n): p for n, p in params}
        return dtype, buckets, by_name

    def push_weights(self, engines: list, replay, version: int | None = None) -> dict[str, float]:
        """Stream the current weights to ``engines``; every rank must call it (the gather is collective).
        Rank 0 returns once every bucket is handed to the sender thread, not when engines finished."""
        version = self.version if version is None else version
        t0 = time.perf_counter()
        stall = 0.0
        if self.rank == 0:  # never overlap two pushes; never raise before the collective gather below
            stall = time.perf_counter()
            if (busy := self._join_sender(2 * self.cfg.weight_sync.timeout_s)) is not None:
                raise RuntimeError(busy)  # only after the sender's own bounds failed: the group is unusable
            stall = time.perf_counter() - stall
        dtype, buckets, by_name = self._push_plan()
        handoff: queue_mod.Queue | None = None
        if self.rank == 0:
            refs = [e.update_weights.remote(buckets, self._weight_group_name, version) for e in engines]
            handoff = queue_mod.Queue(maxsize=2)
            self._push_state = {"version": version}
            self._push_thread = threading.Thread(target=self._send, daemon=True,
                                                 args=(handoff, refs, replay, version, self._push_state))
            self._push_thread.start()
        for b in buckets:
            # Collective gather. copy=True: with one rank (or when the dtype already matches) full_tensor()
            # and .to() return the live parameter, which the next optimizer step would change mid-send.
            tensors = [by_name[n].full_tensor().detach().to(dtype, copy=True) for n in b.names]
            if handoff is not None:
                self._hand_over(handoff, tensors)
        if handoff is not None:
            self._hand_over(handoff, None)
        return {"push_stall_s": stall, "push_blocking_s": time.perf_counter() - t0,
                "push_bytes": float(sum(b.nbytes for b in buckets))}

    def _hand_over(self, handoff: queue_mod.Queue, item) -> None:
        """Give one bucket to the sender thread. If the sender has died, drop the bucket instead of
        blocking: rank 0 keeps gathering so that the other ranks are not left waiting in the collective,
        and the error is raised by the next wait_push (the sender recorded it)."""
        while self._push_thread is not None and self._push_thread.is_alive():
            try:
                handoff.put(item, timeout=1.0)
                return
            except queue_mod.Full:
                continue

    def _send(self, handoff: queue_mod.Queue, refs: list, replay, version: int, state: dict[str, Any]) -> None:
        import ray

        t0 = time.perf_counter()
        sent = 0
        timeout = self.cfg.weight_sync.timeout_s
        try:
            while (tensors := handoff.get(timeout=timeout)) is not None:
                sent += broadcast_bucket(self._weight_pg, tensors)  # bounded by the group's timeout
            engine_s = ray.get(refs, timeout=timeout)
            if replay is not None:
                ray.get(replay.set_version.remote(version), timeout=timeout)  # the engines run `version` now
            state.update(push_s=time.perf_counter() - t0, bytes=sent,
                         engine_s=max(engine_s) if engine_s else 0.0, error="")
        except Exception as exc:  # surfaced by wait_push: a failed push must fail the run loudly
            state.update(error=repr(exc))

    def _join_sender(self, timeout_s: float) -> str | None:
        """Join the push in flight (if any) and record its result; returns a message if it is still busy."""
        if self._push_thread is None:
            return None
        self._push_thread.join(timeout=timeout_s)
        if self._push_thread.is_alive():
            return f"weight push of version {self._push_state['version']}: sender still busy after {timeout_s:.0f} s"
        self._push_thread, self._push_result = None, dict(self._push_state)
        return None

    def wait_push(self) -> float:
        """Block until the previous push finished (rank 0), at most 2 × weight_sync.timeout_s (the sender's
        own waits are bounded by it); returns the seconds waited. Raises if that push failed or is still
        running."""
        t0 = time.perf_counter()
        if (busy := self._join_sender(2 * self.cfg.weight_sync.timeout_s)) is not None:
            raise TimeoutError(busy)
        if error := self._push_result.get("error"):
            self._push_result.update(error="", failed=error)  # reported once; a retried push starts clean
            raise RuntimeError(f"weight push of version {self._push_result['version']} failed: {error}")
        return time.perf_counter() - t0

    def last_push(self) -> dict[str, Any]:
        return dict(self._push_result)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """DCP of model + optimizer (sharded), plus LR schedule, version and RNG states per rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        extra = {"scheduler": self.scheduler.state_dict(), "version": self.version,
                 "skipped_updates": self.skipped_updates, "torch_rng": torch.get_rng_state(),
                 "python_rng": random.getstate()}
        torch.save(extra, Path(path) / f"extra_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(Path(path) / f"extra_rank{self.rank}.pt", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.version, self.skipped_updates = extra["version"], extra["skipped_updates"]
        torch.set_rng_state(extra["torch_rng"])
        random.setstate(extra["python_rng"])
        return self.version

    def export_hf(self, path: str) -> None:
        """An HF-format copy of the current policy (config, tokenizer, safetensors); every rank calls."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            config = AutoConfig.from_pretrained(self.cfg.model.path, trust_remote_code=self.cfg.model.trust_remote_code)
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
            model.load_state_dict({sglang_name(k): v for k, v in full.items()})
            model.save_pretrained(path, safe_serialization=True)
            AutoTokenizer.from_pretrained(self.cfg.model.path, trust_remote_code=self.cfg.model.trust_remote_code
                                          ).save_pretrained(path)
        dist.barrier()

    def shutdown(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join(timeout=60)
        dist.destroy_process_group()


def learner_actor_class(cfg: Config, **options):
    """``ray.remote`` wrapper with the configured resources (``options``: extra Ray actor options)."""
    import ray

    p = cfg.placement
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return ray.remote(LearnerWorker).options(num_cpus=p.learner_cpus, num_gpus=p.learner_gpus,
                                             runtime_env={"env_vars": env}, **options)
