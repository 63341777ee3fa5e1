"""The tiny-model bootstrap: loads in transformers, has partial accuracy, is deterministic and cached."""

import ast
import re
from pathlib import Path

import pytest
import torch

from async_dapo.bootstrap import EOS, bootstrap
from async_dapo.data.rows import encode_prompt
from async_dapo.config import load_config
from async_dapo.data.rows import synthetic_rows
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_default_model_has_partial_accuracy(tiny_model, cpu_config):
    """The shipped warm start (configs/tiny_cpu.yaml's model.path): a cache hit with its recorded weights, so
    every machine starts from the same policy; re-measured here it has the accuracy its report says (greedy,
    so up to a few near-tie argmax flips on another CPU), partial, where RL has mixed groups."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_dapo.bootstrap import CHECK_TOKENS, greedy_accuracy
    from async_dapo.data.rows import synthetic_distinct_rows

    rep = bootstrap(cpu_config)
    assert rep.cached and Path(rep.path).resolve() == (REPO / "models" / "tiny_cpu").resolve(), rep.path
    tc, task = cpu_config.model.bootstrap, cpu_config.data.synthetic
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    val = synthetic_distinct_rows("val", levels=task.levels, heldout_fraction=task.heldout_fraction,
                                  seed=tc.seed, limit=tc.eval_prompts)
    measured = sum(greedy_accuracy(model, tok, val, max_new_tokens=CHECK_TOKENS[task.response_style])) / len(val)
    assert abs(measured - rep.val_accuracy) <= 0.02, (measured, rep.val_accuracy)
    # RL needs mixed groups: neither ~0% nor ~100% on the training mix.
    assert 0.2 <= rep.train_accuracy <= 0.6, rep
    assert 0.1 <= rep.val_accuracy <= 0.6, rep
    levels = sorted(rep.val_accuracy_by_level)
    assert levels == task.levels
    # The warm start stops where the easiest level is about half learned: that is where RL has signal.
    assert 0.3 <= rep.val_accuracy_by_level[levels[0]] <= 0.8, rep
    assert rep.val_accuracy_by_level[levels[0]] > rep.val_accuracy_by_level[levels[-1]]  # levels really differ
    # It stopped on the measured target and the level floor (checked at the same check), not the step budget:
    # an earlier check may have reached the target while another level was still under the floor.
    assert rep.stop_reason.startswith("target reached"), rep.stop_reason
    assert rep.target_trace[-1] == (rep.sft_steps, rep.target_trace[-1][1]) and rep.sft_steps < tc.sft_steps
    assert rep.target_trace[-1][1] >= tc.sft_target_accuracy
    others = re.search(r"other levels (\{.*\}) >= ([0-9.]+)", rep.stop_reason)
    floor = ast.literal_eval(others[1])
    assert float(others[2]) == tc.sft_level_floor and all(acc >= tc.sft_level_floor for acc in floor.values())


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


def test_warm_start_stops_at_the_first_check_reaching_the_target(tmp_path, monkeypatch):
    # Scripted accuracies at the checks (every 2 steps): 0.1, 0.5, then 0.7 >= 0.6 -> stop after step 6.
    from async_dapo import bootstrap as bs

    script = iter([0.1, 0.5, 0.7, 0.9])
    seen = []

    def scripted(model, tokenizer, rows, max_new_tokens):
        if rows[0].extra_info["split"] == "train" and len(seen) < 3:  # the target checks; then the report's
            seen.append(rows)
            acc = next(script)
            return [i < acc * len(rows) for i in range(len(rows))]
        return [False] * len(rows)

    monkeypatch.setattr(bs, "greedy_accuracy", scripted)
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "model.bootstrap.sft_steps=50",
                             "model.bootstrap.sft_check_every=2", "model.bootstrap.sft_target_accuracy=0.6",
                             "model.bootstrap.eval_prompts=10", "data.synthetic.levels=[1, 2]"])
    rep = bs.bootstrap(cfg)
    assert rep.sft_steps == 6
    assert [s for s, _ in rep.target_trace] == [2, 4, 6]
    assert rep.target_trace[-1][1] >= 0.6 > rep.target_trace[-2][1]
    assert rep.stop_reason.startswith("target reached at step 6: level 1 greedy accuracy")
    # Measured on distinct TRAINING problems of the easiest level, never on the held-out split.
    rows = seen[0]
    assert {r.extra_info["level"] for r in rows} == {1} and {r.extra_info["split"] for r in rows} == {"train"}
    assert len({r.prompt[0].content for r in rows}) == len(rows) == 10


def test_warm_start_without_reaching_the_target_says_so(tmp_path, monkeypatch):
    from async_dapo import bootstrap as bs

    monkeypatch.setattr(bs, "greedy_accuracy", lambda model, tok, rows, max_new_tokens: [False] * len(rows))
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "model.bootstrap.sft_steps=4",
                             "model.bootstrap.sft_check_every=2", "model.bootstrap.sft_target_accuracy=0.6",
                             "model.bootstrap.eval_prompts=10"])
    rep = bs.bootstrap(cfg)
    assert rep.sft_steps == 4 and [s for s, _ in rep.target_trace] == [2, 4]
    assert rep.stop_reason == ("sft_steps (4) used up before the target: best level 1 greedy accuracy 0.000 "
                               "(target 0.6), other levels at the last check {}")


def _scripted_warm_start(tmp_path, monkeypatch, script: dict[int, list[float]], *extra: str):
    """Run the warm start with each check's greedy accuracy taken from ``script`` (per level, in order);
    returns (report, the levels measured in order)."""
    from async_dapo import bootstrap as bs

    left, measured = {lv: iter(accs) for lv, accs in script.items()}, []
    checks = sum(len(accs) for accs in script.values())

    def scripted(model, tokenizer, rows, max_new_tokens):
        level = rows[0].extra_info["level"]
        if rows[0].extra_info["split"] != "train" or len(measured) >= checks:  # the report's own evaluation
            return [False] * len(rows)
        measured.append(level)
        acc = next(left[level])
        return [i < acc * len(rows) for i in range(len(rows))]

    monkeypatch.setattr(bs, "greedy_accuracy", scripted)
    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "model.bootstrap.sft_steps=50",
                             "model.bootstrap.sft_check_every=2", "model.bootstrap.sft_target_accuracy=0.6",
                             "model.bootstrap.sft_level_floor=0.1", "model.bootstrap.eval_prompts=100",
                             "data.synthetic.levels=[1, 2]", *extra])
    return bs.bootstrap(cfg), measured


def test_warm_start_also_waits_for_every_level_to_reach_the_floor(tmp_path, monkeypatch):
    # Level 1 is at its target from the first check (step 2); level 2 reaches the 0.1 floor only at step 6.
    rep, measured = _scripted_warm_start(tmp_path, monkeypatch, {1: [0.7, 0.7, 0.7], 2: [0.05, 0.08, 0.12]})
    assert rep.sft_steps == 6 and measured == [1, 2, 1, 2, 1, 2]
    assert rep.stop_reason.endswith("training problems 0.700 >= 0.6; other levels {2: 0.12} >= 0.1")


def test_warm_start_stops_only_when_the_target_holds_at_consecutive_checks(tmp_path, monkeypatch):
    # Level 1 spikes to the target at step 2, falls back at step 4, then holds it at steps 6 and 8: with
    # sft_target_checks=2 the warm start stops at step 8 (and measures level 2 only once the target held).
    rep, measured = _scripted_warm_start(tmp_path, monkeypatch, {1: [0.65, 0.35, 0.62, 0.7], 2: [0.2]},
                                         "model.bootstrap.sft_target_checks=2")
    assert rep.sft_steps == 8 and measured == [1, 1, 1, 1, 2]
    assert [acc for _, acc in rep.target_trace] == [0.65, 0.35, 0.62, 0.7]
    assert rep.stop_reason == ("target reached at step 8: level 1 greedy accuracy on 100 training problems "
                               "0.700 >= 0.6 (and at the 1 check(s) before); other levels {2: 0.2} >= 0.1")


def test_target_level_must_be_a_configured_level():
    with pytest.raises(Exception, match=r"model.bootstrap.sft_target_level \(3\) must be one of data.synthetic.levels"):
        load_config(None, ["model.bootstrap.sft_target_level=3", "data.synthetic.levels=[1, 2]"])


def test_a_cache_hit_means_the_recorded_weights(tmp_path):
    """bootstrap.json records the weights' sha256: the same config finds the cache only with those exact
    weights (a copied or edited model.safetensors is rebuilt, not trusted), and reports where it is now."""
    import json
    import shutil

    def cfg(path):
        return load_config(None, [f"model.path={path}", "model.bootstrap.sft_steps=5", "model.bootstrap.eval_prompts=10"])

    built = bootstrap(cfg(tmp_path / "a"))
    saved = json.loads((tmp_path / "a" / "bootstrap.json").read_text())
    import hashlib
    assert saved["weights_sha256"] == hashlib.sha256((tmp_path / "a" / "model.safetensors").read_bytes()).hexdigest()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = bootstrap(cfg(tmp_path / "b"))
    assert moved.cached and moved.path == str(tmp_path / "b") and moved.val_accuracy == built.val_accuracy
    weights = tmp_path / "b" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last weight
    weights.write_bytes(bytes(data))
    assert not bootstrap(cfg(tmp_path / "b")).cached
