"""One update of the real learner rank (in this process: FSDP2 over gloo, one rank, no Ray) on responses of
40-200 tokens with known advantages: each response's log-probability moves in its advantage's direction, by
the amount a plain reference update computes.

The reference is written out here from the definitions, independently of async_dapo.learner.batching and loss: an
unsharded transformers copy of the same weights, the on-policy token-level loss
-(1/N) * sum_i A_i * sum_t log p(y_it) over the N response tokens of the mini-batch (the DAPO loss at ratio 1,
where clipping and the importance weight are inactive), clip_grad_norm_ at learner.grad_clip and one AdamW
step with the learner's hyper-parameters. The learner packs these responses into several micro-batches of
unequal padded widths behind different prompt lengths, so a shifted response/prompt boundary, a padding token
counted, a per-micro-batch (instead of global) token count or a sign error changes the per-response values.

Advantages by hand: each group is two samples with rewards +1 and -1, so mean 0 and unbiased std sqrt(2):
A = +-1/sqrt(2) (+-0.7071).
"""

import math

import numpy as np
import pytest
import torch

from async_dapo.config import load_config
from async_dapo.weights.sync import free_port
from async_dapo.stream.wire import Group, Sample
from tests.conftest import REPO

pytestmark = pytest.mark.integration

LONGTAIL = REPO / "configs" / "longtail_cpu.yaml"
# (prompt length, response length) per sample: three groups of two; responses of 40-200 tokens behind prompts
# of three lengths. Within a group both responses have one length: on random tokens, a longer negative
# response would otherwise push down random tokens in general, its positive partner with them (the update is
# token-weighted).
SHAPES = [[(12, 40), (12, 40)], [(18, 200), (18, 200)], [(15, 113), (15, 113)]]
REWARDS = [[1.0, -1.0], [-1.0, 1.0], [1.0, -1.0]]
ADVANTAGE = 1 / math.sqrt(2)


@pytest.fixture(scope="module")
def cfg():
    # One optimizer update over the three groups (mini_batch_groups = train_batch_groups); a 512-token budget
    # packs the six rows (218, 218, 128, 128, 52 and 52 tokens) into two micro-batches, [218, 218] and
    # [128, 128, 52, 52]: the second pads two rows by 76 tokens and holds two response/prompt boundaries.
    return load_config(LONGTAIL, [
        "algorithm.train_batch_groups=3", "learner.mini_batch_groups=3", "rollout.n=2",
        "learner.micro_batch_tokens=512", "learner.lr=1e-4", "learner.warmup_steps=0", "learner.weight_decay=0.01",
        "algorithm.correction.mode=decoupled", "reward.overlong_buffer_enable=false",
    ])


def reference_model(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)


def response_logprobs(model, rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Summed log p(response | prompt) per row, one unpadded forward each (no batching code involved)."""
    out = []
    for prompt, response in rows:
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None]).sum())
    return torch.stack(out)


def token_logprobs(model, prompt: list[int], response: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


def make_batch(model, vocab: int) -> tuple[list[Group], list[tuple[list[int], list[int]]], list[float]]:
    """Groups of random tokens whose behaviour log-probs are the model's own (on-policy: ratio 1)."""
    rng = np.random.default_rng(0)
    groups, rows, advantages = [], [], []
    for g, (shapes, rewards) in enumerate(zip(SHAPES, REWARDS)):
        prompt = rng.integers(3, vocab, size=shapes[0][0]).tolist()
        samples = []
        for (_, length), reward in zip(shapes, rewards):
            response = rng.integers(3, vocab, size=length).tolist()
            rows.append((prompt, response))
            advantages.append(ADVANTAGE * reward)
            samples.append(Sample(response_ids=np.asarray(response, np.int32),
                                  logprobs=token_logprobs(model, prompt, response).astype(np.float32),
                                  versions=np.zeros(length, np.int32), reward=reward, score=reward, acc=reward > 0,
                                  truncated=False, finish_reason="stop", gen_seconds=0.1))
        groups.append(Group(group_id=f"g{g}", prompt_index=g, epoch=0, engine_rank=0,
                            prompt_ids=np.asarray(prompt, np.int32), ground_truth="x", data_source="t",
                            samples=tuple(samples), created_at=1.0, admitted_version=0))
    return groups, rows, advantages


def reference_update(cfg, model, rows, advantages) -> None:
    """The on-policy DAPO token-level loss, clipped gradient, one AdamW step: from the definitions."""
    lc = cfg.learner
    total_tokens = sum(len(r) for _, r in rows)
    logp = response_logprobs(model, rows)
    loss = -(torch.tensor(advantages) * logp).sum() / total_tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip)
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
    opt.step()


def test_one_update_moves_each_long_response_by_the_reference_amount(cfg):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from async_dapo.learner.batching import plan_step
    from async_dapo.learner.rank import LearnerWorker

    reference = reference_model(cfg)
    groups, rows, advantages = make_batch(reference, reference.config.vocab_size)
    plan = plan_step(groups, world_size=1, rank=0, groups_per_mini_batch=3, token_budget=512, pad_id=0,
                     overlong_filtering=False)
    # The split the fixture describes: two micro-batches, padding in the second.
    assert [mb.num_tokens for mb in plan[0].micro_batches] == [400, 306]
    assert int(plan[0].micro_batches[1].attention_mask.sum()) == 4 * 128 - 2 * 76
    with torch.no_grad():
        before = response_logprobs(reference, rows)

    learner = LearnerWorker(cfg, 0, 1, "127.0.0.1", free_port())
    try:
        learner.train_step(groups)
        learned = reference_model(cfg)
        missing, unexpected = learned.load_state_dict(get_model_state_dict(
            learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)), strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied to the embedding
    finally:
        learner.shutdown()
    reference_update(cfg, reference, rows, advantages)
    with torch.no_grad():
        moved = response_logprobs(learned, rows) - before
        expected = response_logprobs(reference, rows) - before

    print("advantage, learner delta, reference delta:",
          [(round(a, 4), round(m, 4), round(e, 4)) for a, m, e in zip(advantages, moved.tolist(), expected.tolist())])
    # Each response in its advantage's direction, by a margin (an update of lr 1e-4 on ~100 tokens moves a
    # sequence's log-probability by a few tenths), ...
    for a, m in zip(advantages, moved.tolist()):
        assert a * m > 0 and abs(m) > 0.05, (a, m)
    # ... and by what the reference computes (fp32 summation order differs between the two: ~1e-5 relative).
    torch.testing.assert_close(moved, expected, rtol=2e-3, atol=2e-3)
