"""The real SGLang engine on CPU, with the bootstrapped tiny model, sampled through the rollout actor's one
sampling path (the same as training groups, validation and eval): its token logprobs must match a
transformers forward pass of the same weights, and no stand-in kernel may ever be called.

Tolerance: both sides run the same fp32 weights, so the only differences are kernel order (SGLang's
torch_native SDPA with a paged KV cache and incremental decode vs one full-sequence transformers
forward); measured differences are ~1e-6. We allow 2e-4 absolute per token — the bound anchors.md
records for SGLang vs transformers — which is still ~100x below the smallest off-policy effect the
importance correction acts on (log-ratio caps of log 2 ~ 0.69).
"""

import json
import subprocess
import sys

import pytest
import torch

from async_dapo.config import dump_config
from async_dapo.data.rows import encode_prompt, synthetic_rows
from tests.conftest import REPO

pytestmark = pytest.mark.integration
TOL = 2e-4
# Samples 4 completions of each prompt through a RolloutWorker (the one sampling path) in its own process.
SAMPLER = """
import json, os, sys
from async_dapo.config import load_config
from tests.probes import ProbedRolloutWorker
if __name__ == "__main__":
    cfg, prompts, temperature = load_config(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
    worker = ProbedRolloutWorker(cfg, 0)
    try:
        outs = worker.generate([p for p in prompts for _ in range(4)],
                               {"temperature": temperature, "max_new_tokens": 12, "top_p": 1.0})
    finally:
        worker.shutdown()
    print(json.dumps({"cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
                      "outs": [{"output_ids": o["output_ids"],
                                "logprobs": [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]} for o in outs]}))
"""


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
    temperature = 1.0
    # In a child process: an engine started inside pytest leaves SGLang's child watchdog and the engine's
    # threads in it (a later test's child exiting ended pytest once, and the interpreter's exit crashed).
    dump_config(cpu_config.model_copy(update={"model": cpu_config.model.model_copy(update={"path": tiny_model})}),
                tmp_path / "cfg.yaml")
    proc = subprocess.run([sys.executable, "-c", SAMPLER, str(tmp_path / "cfg.yaml"), json.dumps(prompts),
                           str(temperature)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    outs = result["outs"]
    groups = [outs[i * 4:(i + 1) * 4] for i in range(len(prompts))]

    assert result["cpu_engine"] == "1"  # the CPU path really was taken
    assert not shim_log.exists(), f"stand-in kernels were called: {shim_log.read_text()}"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    worst = 0.0
    distinct = set()
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for out in group:
            ids, logprobs = out["output_ids"], out["logprobs"]
            assert len(ids) == len(logprobs) >= 1
            ref = _transformers_logprobs(model, prompt, ids, temperature)
            worst = max(worst, (ref - torch.tensor(logprobs)).abs().max().item())
            distinct.add(tuple(ids))
    print(f"max |logprob diff| sglang vs transformers: {worst:.2e}")
    assert worst < TOL, f"max |logprob diff| {worst:.2e} >= {TOL}"
    # Sampling at temperature 1 from a partly trained model gives varied completions within groups.
    assert len(distinct) > len(prompts)
