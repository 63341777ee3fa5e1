"""Sharded start-up: two gloo learner ranks, each a plain process, build a ~29M-parameter
Qwen2 (118 MB in fp32) on the meta device and read only their own rows from safetensors. Each rank's peak
RSS growth during construction is measured against the full model's fp32 size and against the older
start-up (from_pretrained of the whole model on every rank, then fully_shard), run in the same test;
the parameters equal the checkpoint's exactly.
"""

import json

import pytest
import torch

from async_dapo.weights.sync import free_port

pytestmark = pytest.mark.integration

SHAPE = {"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 1536, "tie_word_embeddings": True}


def build_model(path) -> int:
    """A random Qwen2 of SHAPE saved at ``path``; returns its fp32 size in bytes."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(pad_token_id=0, **SHAPE))
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() * 4 for p in model.parameters())


def _status_bytes(field: str) -> int:
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark (Linux: clear_refs 5) and return the RSS now: an import's
    transient peak before the measurement must neither hide nor inflate the growth."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _rank(rank: int, world: int, port: int, model_path: str, out) -> None:
    from async_dapo.config import load_config
    from async_dapo.learner.rank import LearnerWorker
    from async_dapo.weights.sync import sglang_name

    torch.set_num_threads(1)
    cfg = load_config(None, ["model.bootstrap=null", f"model.path={model_path}", "logging.tensorboard=false"])
    # Imported first, so that the measurement holds the model, not the ~250 MB of code the constructor
    # imports on first use (transformers' Qwen2 modelling, FSDP, safetensors).
    from safetensors import safe_open  # noqa: F401
    from torch.distributed import fsdp  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    before = reset_peak_rss()
    worker = LearnerWorker(cfg, rank, world, "127.0.0.1", port)
    growth = _status_bytes("VmHWM") - before
    full = {sglang_name(n): p.full_tensor() for n, p in worker.model.named_parameters()}  # collective
    mismatched = []
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(f"{model_path}/model.safetensors")
        mismatched = sorted(n for n in saved if not torch.equal(saved[n], full[n])) + sorted(set(saved) ^ set(full))
    worker.shutdown()
    out.put({"rank": rank, "growth": growth, "mismatched": mismatched})


def _old_rank(rank: int, world: int, port: int, model_path: str, out) -> None:
    """The start-up before sharding, for reference: every rank loads the whole model, then shards it."""
    import torch.distributed as dist
    from safetensors import safe_open  # noqa: F401
    from torch.distributed import fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    torch.set_num_threads(1)
    before = reset_peak_rss()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    out.put({"rank": rank, "growth": _status_bytes("VmHWM") - before})
    dist.destroy_process_group()


def _run_ranks(target, model_path) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, str(model_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(_collect(out, procs, timeout_s=300), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    return results


def _collect(out, procs, timeout_s: float) -> list[dict]:
    """One result per process; fails at once, naming it, when a process dies without one."""
    import queue
    import time

    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=2))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"rank(s) {dead} died / timed out; got {got}"
    return got


def test_two_ranks_start_with_a_fraction_of_the_model_and_the_checkpoints_weights(tmp_path):
    model_bytes = build_model(tmp_path / "model")
    results = _run_ranks(_rank, tmp_path / "model")
    old = _run_ranks(_old_rank, tmp_path / "model")
    report = json.dumps({"model_bytes": model_bytes, "ranks": results, "before_issue_13": old})
    print(report)
    assert results[0]["mismatched"] == [], report
    for r in results:
        # Half the model per rank plus one tensor (the 8 MB embedding), the process groups and allocator
        # slack; the whole model (what every rank loaded before) would be >= 1.0.
        assert r["growth"] < 0.75 * model_bytes, report
        assert r["growth"] < 0.6 * min(o["growth"] for o in old), report  # measured: ~0.45-0.5
