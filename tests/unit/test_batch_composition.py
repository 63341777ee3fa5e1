"""The batch-composition study's difficulty figures (tools/study/batch_composition.py), on a hand-made run
directory: the trained samples' accuracy against the arrivals', and the warm start's p of the trained groups
against the prompts admitted in the same steps."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "study"))
sys.path.insert(0, str(REPO / "tools"))
import batch_composition as bc  # noqa: E402
import common  # noqa: E402


def group(prompt_index: int, accs: list[bool]):
    from async_dapo.stream.wire import Group, Sample

    samples = tuple(Sample(response_ids=np.arange(3, 8, dtype=np.int32), logprobs=np.full(5, -0.5, np.float32),
                           versions=np.zeros(5, np.int32), reward=1.0 if a else -1.0, score=1.0 if a else -1.0,
                           acc=a, truncated=False, finish_reason="stop", gen_seconds=0.1) for a in accs)
    return Group(group_id=f"g{prompt_index}", prompt_index=prompt_index, epoch=0, engine_rank=0,
                 prompt_ids=np.arange(3, 9, dtype=np.int32), ground_truth="1", data_source="walk", samples=samples,
                 created_at=1.0, admitted_version=0)


@pytest.fixture
def run(tmp_path):
    """Steps 1..3; the figures cover steps 2 and 3 (skip 1): 80 samples arrived, 20 correct; prompts admitted
    at cursor positions 4..9; trained: the prompts at positions 5 and 9, 3 of 8 samples correct."""
    from async_dapo.data.rows import PromptCursor, train_rows
    from async_dapo.stream.wire import write_groups

    cfg = common.load_config(bc.CONFIG)
    order = [i for _, i in PromptCursor(len(train_rows(cfg)), seed=cfg.data.shuffle_seed).take(12)]
    steps = [(1, 20, 10, 4), (2, 60, 20, 7), (3, 100, 30, 10)]  # step, received samples, correct, admitted
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "perf/time_per_step": 1.0, "replay/received_samples": n, "replay/received_correct": c,
         "replay/admitted": a}) + "\n" for s, n, c, a in steps))
    (tmp_path / "batches").mkdir()
    write_groups([group(order[0], [True, True, False, False])], tmp_path / "batches" / "step_1.bin")  # skipped
    write_groups([group(order[5], [True, False, False, False])], tmp_path / "batches" / "step_2.bin")
    write_groups([group(order[9], [True, True, False, False])], tmp_path / "batches" / "step_3.bin")
    return cfg, tmp_path


def test_difficulty_hand_computed(run):
    cfg, run_dir = run
    p = [pos / 10 for pos in range(12)]  # the warm start's p by cursor position
    got = bc.difficulty(cfg, run_dir, 1, p)
    assert got["acc_ratio_cum"] == pytest.approx((3 / 8) / (20 / 80))  # 1.5
    assert got["p_admitted"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.7 + 0.8 + 0.9) / 6)  # 0.65
    assert got["p_trained"] == pytest.approx((0.5 + 0.9) / 2)  # 0.7
    assert got["p_ratio"] == pytest.approx(0.7 / 0.65)
    assert got["p_ratio_se"] == pytest.approx(0.2 / 0.65)  # stdev(0.5, 0.9) / sqrt(2) = 0.2


def test_difficulty_without_p_gives_only_the_accuracy_ratio(run):
    cfg, run_dir = run
    got = bc.difficulty(cfg, run_dir, 1, None)
    assert got["acc_ratio_cum"] == pytest.approx(1.5)
    assert all(np.isnan(got[k]) for k in ("p_trained", "p_admitted", "p_ratio", "p_ratio_se"))


def test_the_warm_p_cache_is_used_only_for_the_same_model_and_sampling(tmp_path, monkeypatch):
    cfg = common.load_config(bc.CONFIG)
    key = {"model": str(cfg.model.path), "n": cfg.rollout.n, "temperature": cfg.rollout.temperature,
           "top_p": cfg.rollout.top_p, "max_response_length": cfg.rollout.max_response_length,
           "reward": cfg.reward.function, "seed": cfg.data.shuffle_seed}
    cache = tmp_path / "warm_p.json"
    cache.write_text(json.dumps({"key": key, "p": [0.25, 0.5, 0.75]}))
    assert bc.warm_p(cfg, 2, cache) == [0.25, 0.5, 0.75]
    sampled = []
    monkeypatch.setattr("async_dapo.rollout.engine.start_engine", lambda *a, **k: sampled.append(a) or _Stop())
    cache.write_text(json.dumps({"key": {**key, "n": key["n"] + 1}, "p": [0.25, 0.5, 0.75]}))
    with pytest.raises(_Sampled):
        bc.warm_p(cfg, 2, cache)  # another group size: sampled again
    assert sampled


class _Sampled(Exception):
    pass


class _Stop:
    """An engine stand-in that stops warm_p at its first request (this test checks the cache, not sampling)."""

    def generate(self, **_):
        raise _Sampled

    def shutdown(self):
        pass
