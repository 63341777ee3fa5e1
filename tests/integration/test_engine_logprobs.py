"""The real SGLang engine on CPU, with the bootstrapped tiny model: its sampled token logprobs must match
a transformers forward pass of the same weights, and no stand-in kernel may ever be called.

Tolerance: both sides run the same fp32 weights, so the only differences are kernel order (SGLang's
torch_native SDPA with a paged KV cache and incremental decode vs one full-sequence transformers
forward); measured differences are ~1e-6. We allow 2e-4 absolute per token — the bound anchors.md
records for SGLang vs transformers — which is still ~100x below the smallest off-policy effect the
importance correction acts on (log-ratio caps of log 2 ~ 0.69).
"""

import os

import pytest
import torch

from async_dapo.bootstrap import encode_prompt
from async_dapo.data import synthetic_rows
from async_dapo.engine import sample_groups, start_engine

pytestmark = pytest.mark.integration
TOL = 2e-4


def _transformers_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_sglang_cpu_logprobs_match_transformers(tiny_model, cpu_config, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shim_log = tmp_path / "shim_calls.log"
    monkeypatch.setenv("ASYNC_DAPO_SGL_KERNEL_SHIM_LOG", str(shim_log))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = synthetic_rows("val", 6, levels=[1, 2, 3, 4], heldout_fraction=0.1, seed=1)
    prompts = [encode_prompt(tok, r) for r in rows]
    engine = start_engine(cpu_config.rollout.engine, tiny_model)
    try:
        temperature = 1.0
        groups = sample_groups(
            engine, prompts, n=4,
            sampling_params={"temperature": temperature, "max_new_tokens": 12, "top_p": 1.0},
        )
    finally:
        engine.shutdown()

    assert os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"  # the CPU path really was taken
    assert not shim_log.exists(), f"stand-in kernels were called: {shim_log.read_text()}"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    worst = 0.0
    distinct = set()
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for s in group:
            assert len(s.output_ids) == len(s.logprobs) >= 1
            ref = _transformers_logprobs(model, prompt, s.output_ids, temperature)
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
            distinct.add(tuple(s.output_ids))
    print(f"max |logprob diff| sglang vs transformers: {worst:.2e}")
    assert worst < TOL, f"max |logprob diff| {worst:.2e} >= {TOL}"
    # Sampling at temperature 1 from a partly trained model gives varied completions within groups.
    assert len(distinct) > len(prompts)
