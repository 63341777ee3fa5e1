"""tools/cluster/memory_model.py: the per-GPU memory model of the learner and the engines (docs/memory.md).

Values are worked out by hand in the comments; the parameter count is checked against a real
transformers Qwen2ForCausalLM (CPU, tiny)."""

import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "cluster"))
import memory_model as mm  # noqa: E402

from async_dapo.config import load_config  # noqa: E402

CONFIGS = {
    "configs/dapo_qwen2.5_32b_16x8.yaml": "Qwen2.5-32B",
    "configs/dapo_qwen2.5_32b_16x8_async.yaml": "Qwen2.5-32B",
    "configs/qwen2.5_7b_1x8.yaml": "Qwen2.5-7B",
}

# vocab 1000, hidden 64, 2 layers, 4 heads x head_dim 16 (q_dim 64), 2 kv heads (kv_dim 32), MLP 128.
TINY = mm.ModelShape(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     tied=False)


def test_tiny_param_count_by_hand():
    # layer: q 64*64 = 4096; k, v 2 * 64*32 = 4096; q/k/v biases 64 + 32 + 32 = 128; o 64*64 = 4096;
    # gate/up/down 3 * 64*128 = 24576; two norms 2 * 64 = 128  ->  37,120
    assert mm.layer_params(TINY) == 37_120
    # root: embedding + lm_head 2 * 1000*64 = 128,000, final norm 64  ->  128,064
    assert mm.root_params(TINY) == 128_064
    # 2 * 37,120 + 128,064 = 202,304; tied drops one 64,000 matrix: 138,304
    assert mm.param_count(TINY) == 202_304
    assert mm.param_count(dataclasses.replace(TINY, tied=True)) == 138_304


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_equals_transformers_qwen2(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=TINY.vocab, hidden_size=TINY.hidden, num_hidden_layers=TINY.layers,
                      num_attention_heads=TINY.heads, num_key_value_heads=TINY.kv_heads,
                      intermediate_size=TINY.intermediate, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    real = sum(p.numel() for p in model.parameters())  # a tied weight is one Parameter, counted once
    assert real == mm.param_count(dataclasses.replace(TINY, tied=tied))


def test_qwen25_totals_match_the_published_sizes():
    # 7B: layer 3584*3584*2 (q, o) + 2*3584*512 (k, v) + 4608 (biases) + 3*3584*18944 + 7168 = 233,057,792;
    # x 28 + 2 * 152064*3584 + 3584 = 7,615,616,512 (7.62B)
    assert mm.layer_params(mm.SHAPES["Qwen2.5-7B"]) == 233_057_792
    assert mm.param_count(mm.SHAPES["Qwen2.5-7B"]) == 7_615_616_512
    # 32B: layer 487,605,248 x 64 + 2 * 152064*5120 + 5120 = 32,763,876,352 (32.76B)
    assert mm.layer_params(mm.SHAPES["Qwen2.5-32B"]) == 487_605_248
    assert mm.param_count(mm.SHAPES["Qwen2.5-32B"]) == 32_763_876_352
    # 0.5B (tied): 14,912,384 x 24 + 151936*896 + 896 = 494,032,768
    assert mm.param_count(mm.SHAPES["Qwen2.5-0.5B"]) == 494_032_768


def test_kv_bytes_per_token():
    # 2 (K, V) x layers x kv heads per GPU x head_dim x 2 bytes
    assert mm.kv_bytes_per_token(mm.SHAPES["Qwen2.5-32B"], tp=4) == 2 * 64 * 2 * 128 * 2 == 65_536
    assert mm.kv_bytes_per_token(mm.SHAPES["Qwen2.5-7B"], tp=2) == 2 * 28 * 2 * 128 * 2 == 28_672
    # fewer kv heads than TP ranks: replicated, one head per GPU (tiny: 2 kv heads, TP 4)
    assert mm.kv_bytes_per_token(TINY, tp=4) == 2 * 2 * 1 * 16 * 2 == 128
    assert mm.kv_bytes_per_token(TINY, tp=1) == 2 * 2 * 2 * 16 * 2 == 256


def test_layer_activation_formula():
    # bf16, q_dim == hidden: norms 2 * (4h + 2h) = 12h, attention 2 * 5h + 4 heads, MLP 12 I, residual
    # grads 4h  ->  26h + 12 I + 4 heads. Tiny: 26*64 + 12*128 + 16 = 3,216
    assert mm.layer_activation_bytes_per_token(TINY, 2) == 3_216
    s = mm.SHAPES["Qwen2.5-32B"]
    assert mm.layer_activation_bytes_per_token(s, 2) == 26 * 5120 + 12 * 27648 + 4 * 40 == 465_056


SETUP = mm.LearnerSetup(world=2, compute_bytes=2, micro_batch_tokens=100, chunk_tokens=10, max_seq_len=40,
                        seqs_per_rank_step=3, bucket_bytes=1000, push_bytes=2, nccl_comms=3)


def test_learner_terms_by_hand():
    terms = {(t.phase, t.name): t.bytes for t in mm.learner_terms(TINY, SETUP)}
    p = 202_304
    assert terms[("always", "fp32 master weights (sharded)")] == 4 * p / 2 == 404_608
    assert terms[("always", "AdamW exp_avg + exp_avg_sq (sharded)")] == 8 * p / 2
    assert terms[("always", "push snapshot (engine dtype)")] == 2 * p / 2
    # largest tensor 1000*64 bf16 = 128,000 B > the 1,000 B bucket: B_max = 128,000;
    # rank 0: 2 B_max + max(2 * 1,000, B_max) + B_max / W = 256,000 + 128,000 + 64,000 = 448,000
    assert terms[("always", "push gather/broadcast buffers, rank 0")] == 448_000
    assert terms[("always", "step's micro-batches on the device")] == 45 * 3 * 40
    # logits: c V N = 2 * 1000 * 100; chunks: 4 fp32 chunks of 10 positions = 4 * 4 * 1000 * 10
    assert terms[("loss head", "logits, T-1 positions")] == 200_000
    assert terms[("loss head", "log-prob chunks (fp32)")] == 160_000
    assert terms[("loss head", "checkpointed layer inputs")] == 2 * 2 * 64 * 100
    # mask rows are at most min(40, 100 // 2) = 40 long: bool N x 40 = 4,000; + bf16 copy = 12,000
    assert terms[("loss head", "padding mask (bool)")] == 4_000
    assert terms[("layer backward", "padding mask (bool + compute-dtype copy)")] == 12_000
    assert terms[("layer backward", "one recomputed layer + its gradients")] == 3_216 * 100
    # layer unit: (3c + c + 4) P_layer = 12 * 37,120
    assert terms[("layer backward", "layer unit: params + prefetch + its all-gather + grads + fp32 reduce-scatter")] \
        == 12 * 37_120
    assert terms[("root reduce", "root fp32 reduce-scatter input")] == 4 * 128_064


def test_peak_is_always_plus_the_largest_phase():
    peak, worst, parts = mm.learner_peak(TINY, SETUP)
    assert worst in mm.PHASES
    assert peak == parts["always"] + max(parts[ph] for ph in mm.PHASES)


def test_max_micro_batch_tokens_is_the_boundary():
    s = mm.SHAPES["Qwen2.5-7B"]
    setup = mm.LearnerSetup.from_config(load_config(REPO / "configs/qwen2.5_7b_1x8.yaml"))
    budget = mm.gpu_budget(mm.GPUS["80 GB"])
    n = mm.max_micro_batch_tokens(s, setup, budget)
    assert mm.learner_peak(s, setup, n)[0] <= budget < mm.learner_peak(s, setup, n + 1)[0]


def test_engine_kv_capacity_32b_on_80gb_by_hand():
    cfg = load_config(REPO / "configs/dapo_qwen2.5_32b_16x8.yaml")
    e = mm.engine_terms(mm.SHAPES["Qwen2.5-32B"], mm.EngineSetup.from_config(cfg), mm.GPUS["80 GB"])
    # static 0.85 * 81,559 MiB = 72,692,688,486 B; weights 32,763,876,352 * 2 / 4 = 16,381,938,176 B;
    # minus 1 GiB context and 1 GiB TP communicator: 54,163,266,662 B / 65,536 B = 826,465 tokens
    assert e["kv_tokens"] == 826_465
    assert e["full_length_seqs"] == 826_465 // 22_528 == 36
    assert e["concurrent_seqs"] == 32 * 16  # the synchronous recipe: 512 prompts over 16 engines, n = 16


@pytest.mark.parametrize("path", CONFIGS)
@pytest.mark.parametrize("gpu", ["80 GB", "141 GB"])
def test_configs_fit(path, gpu):
    cfg = load_config(REPO / path)
    key, shape = mm.shape_for(cfg, None)
    assert key == CONFIGS[path]
    setup = mm.LearnerSetup.from_config(cfg)
    budget = mm.gpu_budget(mm.GPUS[gpu])
    assert mm.learner_peak(shape, setup)[0] <= budget
    n = mm.max_micro_batch_tokens(shape, setup, budget)
    assert n >= cfg.learner.micro_batch_tokens
    # a sample longer than the budget is a micro-batch of its own: the longest one must fit too
    assert n >= setup.max_seq_len
    assert mm.engine_terms(shape, mm.EngineSetup.from_config(cfg), mm.GPUS[gpu])["fits"]


def test_startup_of_the_integration_test_shape():
    # tests/integration/test_learner_startup.py: vocab 4096, hidden 512, 8 layers, 8 heads (= kv heads,
    # head_dim 64), MLP 1536, tied. Layer: 4 * 512*512 + 1,536 biases + 3 * 512*1536 + 1,024 = 3,410,432;
    # x 8 + 4096*512 + 512 = 29,381,120 parameters = 117,524,480 B in fp32.
    s = mm.ModelShape(4096, 512, 8, 8, 8, 64, 1536, tied=True)
    assert mm.param_count(s) == 29_381_120
    # 2 ranks, fp32 checkpoint: shard 58,762,240 B + half the embedding 4096*512*4 / 2 = 4,194,304 B
    assert mm.startup_bytes(s, world=2, file_bytes=4) == 62_956_544


def test_smoke_prediction():
    # Qwen2.5-0.5B, one row per micro-batch: the loss head's slope is L c h (24 * 2 * 896 = 43,008) +
    # final norm and lm_head input (4h + 4h = 7,168) + logits and their gradient (4 V = 607,744) + rotary
    # cos/sin and position ids (4 * 64 + 8 = 264) = 658,184 B/token
    slopes = mm.phase_slopes(mm.SHAPES["Qwen2.5-0.5B"], mm.smoke_setup())
    assert slopes["loss head"] == pytest.approx(658_184)
    assert max(slopes, key=slopes.get) == "loss head"


def test_main_prints_a_report_per_config(capsys):
    assert mm.main(list(CONFIGS) + ["--smoke"]) == 0
    out = capsys.readouterr().out
    for path, key in CONFIGS.items():
        assert f"## {path}: {key}" in out
    assert "| **peak**" in out and "KV tokens per engine" in out and "gpu_smoke" in out
    assert "NO" not in out
