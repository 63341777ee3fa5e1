"""Probe the learner on a task without the rollout stack: synchronous (on-policy) DAPO steps whose samples come
from transformers' sampler in this process and whose update is the project's real learner rank
(``async_dapo.learner.rank.LearnerWorker``, world size 1, FSDP2 over gloo: the run's batching, loss and optimizer).

There is no engine, queue or staleness, so whatever the policy does over the steps is the learner's doing with
the config's hyper-parameters (override them with --set). Per step it prints, and writes as JSONL, the batch's
accuracy and drop shares, the accuracy on a fixed panel of training prompts, the per-token KL between the
policy before and after the update on the step's own samples, the entropy, the learner's metrics, and the
share of responses whose log-probability moved in their advantage's direction.

    python tools/study/learner_probe.py --config configs/longtail_cpu.yaml --steps 30 --out runs/probe/a.jsonl
    python tools/study/learner_probe.py --config configs/longtail_cpu.yaml --set learner.lr=1e-4 --steps 30

``--shuffle-advantages`` trains on rewards permuted within each group: noise with the signal's magnitudes. A
policy that degrades as fast under it is moved by the size of the update, not by what the update learns.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402


def parse_args(argv=None):
    ap = common.parser(__file__, __doc__, config=True)
    ap.add_argument("--steps", type=int, default=30, help="training steps (default %(default)s)")
    ap.add_argument("--panel", type=int, default=64, help="training prompts in the fixed accuracy panel")
    ap.add_argument("--panel-n", type=int, default=4, help="samples per panel prompt, at rollout.temperature")
    ap.add_argument("--panel-every", type=int, default=5, help="steps between panel evaluations")
    ap.add_argument("--shuffle-advantages", action="store_true",
                    help="permute the rewards within each group before training (a no-signal control)")
    ap.add_argument("--seed", type=int, default=0, help="sampling and prompt-order seed")
    ap.add_argument("--out", type=Path, default=None, help="JSONL of per-step records")
    return ap.parse_args(argv)


class Sampler:
    """transformers sampling of the learner's current weights: G responses per prompt with the config's
    temperature / top_p / max_response_length, behaviour log-probs from a separate fp32 forward, scored and
    shaped as the rollout actor does (reward + overlong penalty)."""

    def __init__(self, cfg, seed: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from async_dapo.data.reward import load_score_fn

        self.cfg = cfg
        self.tok = AutoTokenizer.from_pretrained(cfg.model.path)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
        self.score = load_score_fn(cfg.reward)
        torch.manual_seed(seed)  # generate() samples from torch's global generator

    def load(self, learner) -> None:
        """Copy the learner's current (full) weights into the sampling model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        missing, unexpected = self.model.load_state_dict(full, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")

    def group(self, row, prompt: list[int], n: int, index: int, version: int):
        """n scored samples of ``prompt`` as one wire Group, as a rollout actor sends it."""
        import numpy as np

        from async_dapo.stream.wire import Group

        responses = self.responses(prompt, n)
        samples = tuple(self.sample(row, resp, lp, version)
                        for resp, lp in zip(responses, self.logprobs(prompt, responses)))
        return Group(group_id=f"p{index}-v{version}", prompt_index=index, epoch=0, engine_rank=0,
                     prompt_ids=np.asarray(prompt, np.int32), ground_truth=row.ground_truth,
                     data_source=row.data_source, samples=samples, created_at=time.time(), admitted_version=version)

    def responses(self, prompt: list[int], n: int) -> list[list[int]]:
        """n sampled responses, each up to and including its EOS (the engine returns the EOS too)."""
        import torch

        r, eos = self.cfg.rollout, self.tok.eos_token_id
        ids = torch.tensor([prompt] * n)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                      top_p=r.top_p, temperature=r.temperature, max_new_tokens=r.max_response_length,
                                      eos_token_id=eos, pad_token_id=self.tok.pad_token_id or 0)
        rows = out[:, len(prompt):].tolist()
        return [row[: row.index(eos) + 1] if eos in row else row for row in rows]

    def sample(self, row, response: list[int], logprobs, version: int):
        """One response scored and shaped as the rollout actor does (score + overlong penalty)."""
        import numpy as np

        from async_dapo.data.reward import overlong_penalty
        from async_dapo.stream.wire import Sample

        r, rw = self.cfg.rollout, self.cfg.reward
        res = self.score(row.data_source, self.tok.decode(response, skip_special_tokens=True), row.ground_truth,
                         row.extra_info)
        truncated = len(response) >= r.max_response_length and response[-1] != self.tok.eos_token_id
        penalty = overlong_penalty(len(response), r.max_response_length, rw.overlong_buffer_length,
                                   rw.overlong_penalty_factor) if rw.overlong_buffer_enable else 0.0
        return Sample(response_ids=np.asarray(response, np.int32), logprobs=logprobs,
                      versions=np.full(len(response), version, np.int32), reward=res.score + penalty,
                      score=res.score, acc=res.acc, truncated=truncated,
                      finish_reason="length" if truncated else "stop", gen_seconds=0.0)

    def logprobs(self, prompt: list[int], responses: list[list[int]]):
        """fp32 log-probs of each response token under the sampling model (what SGLang reports)."""
        import numpy as np
        import torch

        from async_dapo.learner.loss import token_logprobs

        width = len(prompt) + max(len(x) for x in responses)
        ids = torch.zeros(len(responses), width, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, resp in enumerate(responses):
            ids[i, : len(prompt) + len(resp)] = torch.tensor(prompt + resp)
            att[i, : len(prompt) + len(resp)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=att).logits[:, :-1]
            lp = token_logprobs(logits, ids[:, 1:], temperature=self.cfg.rollout.temperature)
        p = len(prompt)
        return [lp[i, p - 1 : p - 1 + len(r)].numpy().astype(np.float32) for i, r in enumerate(responses)]


def shuffled(groups, rng: random.Random):
    """The groups with their samples' rewards, scores and accuracies permuted within each group."""
    import dataclasses

    out = []
    for g in groups:
        labels = [(s.reward, s.score, s.acc) for s in g.samples]
        rng.shuffle(labels)
        samples = tuple(dataclasses.replace(s, reward=r, score=sc, acc=a) for s, (r, sc, a) in zip(g.samples, labels))
        out.append(dataclasses.replace(g, samples=samples))
    return out


def response_logprobs(learner, groups) -> list[float]:
    """Each response's summed log-probability under the learner's current weights, in sample order."""
    import torch

    from async_dapo.learner.batching import collate, samples_from_groups

    samples = samples_from_groups(groups)
    out = []
    with torch.no_grad():
        for s in samples:
            mb = collate([s], pad_id=learner.pad_id, overlong_filtering=False)
            out.append(float((learner.logprobs(mb) * mb.loss_mask).sum()))
    return out


def direction_share(learner, groups, before: list[float], after: list[float]) -> float:
    """Share of the responses with a non-zero advantage whose log-probability moved in its direction."""
    from async_dapo.learner.batching import samples_from_groups

    samples = samples_from_groups(groups, scale_by_std=learner.cfg.algorithm.scale_adv_by_std)
    moved = [(a - b) * s.advantage for s, a, b in zip(samples, after, before) if s.advantage != 0]
    return sum(m > 0 for m in moved) / max(len(moved), 1)


LEARNER_KEYS = ("entropy", "token_prob", "grad_norm_mean", "pg_clipfrac", "ppo_kl", "loss",
                "rollout_logprob_abs_diff", "lr")


class Probe:
    """The loop: a fixed panel of training prompts for accuracy, the rest as the stream of batches."""

    def __init__(self, cfg, args):
        from async_dapo.data.rows import train_rows
        from async_dapo.learner.rank import LearnerWorker
        from async_dapo.weights.sync import free_port

        self.cfg, self.args = cfg, args
        self.rows = train_rows(cfg)
        self.rng = random.Random(args.seed)
        order = list(range(len(self.rows)))
        self.rng.shuffle(order)
        self.panel, self.pool, self.cursor = order[: args.panel], order[args.panel :], 0
        self.sampler = Sampler(cfg, args.seed)
        self.learner = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
        self._prompts: dict[int, list[int]] = {}

    def group(self, index: int, n: int):
        from async_dapo.data.rows import encode_prompt

        if index not in self._prompts:
            self._prompts[index] = encode_prompt(self.sampler.tok, self.rows[index])
        return self.sampler.group(self.rows[index], self._prompts[index], n, index, self.learner.version)

    def panel_accuracy(self) -> dict[str, float]:
        samples = [s for i in self.panel for s in self.group(i, self.args.panel_n).samples]
        return {"panel_acc": sum(s.acc for s in samples) / len(samples),
                "panel_len": sum(len(s.response_ids) for s in samples) / len(samples)}

    def batch(self) -> tuple[list, dict]:
        """Up to B mixed groups from at most max_gen_rounds rounds of B prompts (dynamic sampling), and the
        rates over every group generated."""
        n, b = self.cfg.rollout.n, self.cfg.algorithm.train_batch_groups
        kept, seen = [], []
        for _ in range(self.cfg.algorithm.dynamic_sampling.max_gen_rounds):
            for _ in range(b):
                seen.append(self.group(self.pool[self.cursor % len(self.pool)], n))
                self.cursor += 1
            kept = [g for g in seen if 0 < sum(s.acc for s in g.samples) < n][:b]
            if len(kept) == b:
                break
        correct = [sum(s.acc for s in g.samples) for g in seen]
        samples = [s for g in seen for s in g.samples]
        return kept, {"batch_acc": sum(s.acc for s in samples) / len(samples), "received": len(seen),
                      "keep": sum(0 < c < n for c in correct) / len(seen),
                      "all_wrong": correct.count(0) / len(seen), "all_correct": correct.count(n) / len(seen),
                      "response_len": sum(len(s.response_ids) for s in samples) / len(samples)}

    def train(self, groups) -> dict[str, float]:
        """One learner step; how far it moved the policy on its own samples (per-token KL from the sampled
        policy to the updated one) and in which direction."""
        train = shuffled(groups, self.rng) if self.args.shuffle_advantages else groups
        before = response_logprobs(self.learner, train)
        metrics = self.learner.train_step(train)
        self.sampler.load(self.learner)
        old = [s.logprobs for g in train for s in g.samples]
        new = [lp for g in train
               for lp in self.sampler.logprobs(list(g.prompt_ids), [list(s.response_ids) for s in g.samples])]
        kl = sum(float((o - w).sum()) for o, w in zip(old, new)) / sum(len(o) for o in old)
        share = direction_share(self.learner, train, before, response_logprobs(self.learner, train))
        return {"direction_share": share, "token_kl": kl, **{k: metrics[k] for k in LEARNER_KEYS if k in metrics}}

    def step(self, step: int) -> dict:
        rec: dict = {"step": step}
        if step % self.args.panel_every == 0 or step == self.args.steps:
            rec.update(self.panel_accuracy())
        if step == self.args.steps:
            return rec
        kept, rates = self.batch()
        rec.update(rates)
        if len(kept) < self.cfg.algorithm.train_batch_groups:
            rec["stopped"] = f"{len(kept)} mixed groups in {self.cfg.algorithm.dynamic_sampling.max_gen_rounds} rounds"
            return rec
        rec.update(self.train(kept))
        return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = common.load(args)
    import torch

    torch.set_num_threads(1)
    probe = Probe(cfg, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "w") if args.out else None
    try:
        for step in range(args.steps + 1):
            rec = probe.step(step)
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            if "stopped" in rec:
                break
    finally:
        if out:
            out.close()
        probe.learner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
