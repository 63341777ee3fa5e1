"""The tiny-model bootstrap: loads in transformers, has partial accuracy, is deterministic and cached."""

import pytest
import torch

from async_dapo.bootstrap import EOS, bootstrap, encode_prompt
from async_dapo.config import load_config
from async_dapo.data import synthetic_rows

pytestmark = pytest.mark.integration


def test_default_model_has_partial_accuracy(tiny_model, cpu_config):
    rep = bootstrap(cpu_config)  # the fixture built it: this call must hit the cache
    assert rep.cached
    # RL needs mixed groups: neither ~0% nor ~100% on the training mix.
    assert 0.2 <= rep.train_accuracy <= 0.6, rep
    assert 0.15 <= rep.val_accuracy <= 0.6, rep
    levels = sorted(rep.val_accuracy_by_level)
    assert levels == cpu_config.data.synthetic.levels
    # The warm start stops where the easiest level is about half learned: that is where RL has signal.
    assert 0.3 <= rep.val_accuracy_by_level[levels[0]] <= 0.8, rep
    assert rep.val_accuracy_by_level[levels[0]] > rep.val_accuracy_by_level[levels[-1]]  # levels really differ


def test_tokenizer_and_model_load_in_transformers(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    row = synthetic_rows("val", 1, levels=[2], heldout_fraction=0.1, seed=0)[0]
    ids = encode_prompt(tok, row)
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n{row.prompt[0].content}<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == EOS and model.config.eos_token_id == tok.convert_tokens_to_ids(EOS)
    assert tok.decode(tok.encode("Answer: -17", add_special_tokens=False)) == "Answer: -17"
    assert model.config.tie_word_embeddings and model.config.model_type == "qwen2"


def test_bootstrap_is_deterministic(tmp_path):
    def build(path):
        cfg = load_config(None, [f"model.path={path}", "model.bootstrap.sft_steps=5",
                                 "model.bootstrap.eval_prompts=10"])
        return bootstrap(cfg)

    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    from safetensors.torch import load_file

    wa, wb = load_file(f"{a.path}/model.safetensors"), load_file(f"{b.path}/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
