"""docs/metrics.md maps every tag the system emits to verl's, and the tags that carry verl's names mean
what verl means: the table lists exactly the tags that step_metrics (fed by the learner's own _accumulate
and _reduce, the replay queue's own stats), the orchestrator, the validation and the phase clock emit;
a row claims "same" exactly for the verl tags we adopted; and actor/pg_clipfrac_lower is the dual-clip
fraction from the loss through the learner's token-weighted reduction to the tag."""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import async_dapo
from async_dapo.learner import rank as learner_module
from async_dapo.learner.batching import MicroBatch
from async_dapo.config import load_config
from async_dapo.data.rows import Message, PromptRow, RewardSpec
from async_dapo.rollout.evaluate import merge_parts, split_rows
from tests.unit.val_scores import prompt_scores
from async_dapo.learner.rank import LearnerWorker
from async_dapo.learner.loss import policy_loss
from async_dapo.metrics import (
    _LEARNER_TAGS, RENAMED_TAGS, PhaseClock, fleet_metrics, progress_line, step_metrics, upgrade_row,
)
from async_dapo.replay.queue import ReplayQueue
from async_dapo.stream.wire import Group, Sample

PKG = Path(async_dapo.__file__).resolve().parent
DOC = PKG.parent / "docs" / "metrics.md"
HEADER = "| tag | meaning | verl |"

# verl's tags that we emit under verl's name with verl's meaning (checked against verl's source:
# core_algos.compute_policy_loss_vanilla, metric_utils.compute_data_metrics / compute_throughout_metrics,
# dp_actor.update_policy, fsdp_workers.update_actor).
VERL_SAME = {
    "actor/entropy", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/lr",
    "critic/score/mean", "critic/score/max", "critic/score/min",
    "critic/rewards/mean", "critic/rewards/max", "critic/rewards/min",
    "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/max", "prompt_length/min",
    "perf/total_num_tokens", "perf/time_per_step", "actor/grad_norm",
}
# verl's tags whose quantity we do not log under that name: none of ours may take these names.
VERL_OTHER = {
    "perf/throughput", "timing_s/step", "timing_s/gen", "timing_s/update_actor",
    "timing_s/update_weights", "timing_s/testing", "train/num_gen_batches", "training/global_step",
    "prompt_length/clip_ratio", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max",
}


# --------------------------------------------------------------------------- the documented table


def documented() -> dict[str, tuple[str, str]]:
    """tag -> (meaning, verl column) from the mapping table of docs/metrics.md (one tag per row)."""
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER) + 2  # after the header and its |---| line
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert len(cells) == 3, line
        tag = re.fullmatch(r"`([^`]+)`", cells[0])
        assert tag, f"one `tag` per row: {line}"
        assert tag[1] not in rows, f"{tag[1]} listed twice"
        rows[tag[1]] = (cells[1], cells[2])
    return rows


def _pattern(tag: str) -> re.Pattern:
    """`replay/abandoned/<reason>` matches replay/abandoned/<any one path segment>."""
    return re.compile("[^/]+".join(re.escape(part) for part in re.split(r"<[^>]+>", tag)))


# --------------------------------------------------------------------------- what the producers emit


def _sample(n: int, reward: float, *, versions=None, truncated=False) -> Sample:
    return Sample(response_ids=np.arange(1, n + 1, dtype=np.int32), logprobs=np.full(n, -0.5, np.float32),
                  versions=np.asarray(versions if versions is not None else [3] * n, np.int32), reward=reward,
                  score=1.0 if reward > 0 else -1.0, acc=reward > 0, truncated=truncated,
                  finish_reason="length" if truncated else "stop", gen_seconds=0.1)


def _group(index: int, prompt_len: int, samples: list[Sample]) -> Group:
    return Group(group_id=f"g{index}", prompt_index=index, epoch=0, engine_rank=0,
                 prompt_ids=np.arange(1, prompt_len + 1, dtype=np.int32), ground_truth="1", data_source="t",
                 samples=tuple(samples), created_at=1.0, admitted_version=2)


GROUPS = [_group(0, 3, [_sample(4, 1.0), _sample(2, -1.0, truncated=True)]),
          _group(1, 5, [_sample(3, 0.5, versions=[2, 3, 3]), _sample(1, -1.0)])]


def _micro_batch(ratios: list[float], advantage: float, vocab: int = 5):
    """One row of len(ratios) loss-bearing tokens with the given ratio each (old logprob 0) and advantage;
    returns (MicroBatch, logits, logprobs, old logprobs)."""
    t = len(ratios)
    ids = torch.arange(1, t + 2, dtype=torch.int64)[None] % vocab
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), targets=ids[:, 1:],
                    loss_mask=torch.ones(1, t, dtype=torch.bool), advantages=torch.full((1, t), advantage),
                    behav_logprobs=torch.zeros(1, t), versions=torch.zeros(1, t, dtype=torch.int64), num_tokens=t)
    logits = torch.randn(1, t, vocab, generator=torch.Generator().manual_seed(t))
    return mb, logits, torch.tensor([[math.log(r) for r in ratios]]), torch.zeros(1, t)


# mb 1 (A = -1): ratios 5 and 4 > c = 3 are dual-clipped, 0.5 < 0.8 takes the lower clip, 1.5 neither.
# mb 2 (A = +1): 4.0 and 1.5 > 1.28 take the upper clip.
MICRO = [([5.0, 4.0, 0.5, 1.5], -1.0), ([4.0, 1.5], 1.0)]
CLIP_C = 3.0


def learner_output(monkeypatch) -> dict[str, float]:
    """What train_step returns for MICRO: the learner's own _accumulate and _reduce (one rank: the
    all-reduce is the identity) plus the keys train_step adds itself."""
    monkeypatch.setattr(learner_module.dist, "all_reduce", lambda *args, **kwargs: None)
    worker = SimpleNamespace(cfg=load_config(None, []), device="cpu")
    sums: dict[str, float] = {"pad_tokens": 2.0, "slot_tokens": 8.0}
    for ratios, advantage in MICRO:
        mb, logits, logp, old = _micro_batch(ratios, advantage)
        loss, m = policy_loss(logp, old, mb.advantages, mb.loss_mask, clip_c=CLIP_C, num_tokens=6)
        LearnerWorker._accumulate(worker, sums, mb, logits, m, None, None, loss)
    out = LearnerWorker._reduce(worker, sums)
    added = re.search(r"out\.update\((.*?)\)\n", inspect.getsource(LearnerWorker.train_step), re.S)
    out.update({key: 1.0 for key in re.findall(r"(\w+)=", added[1])})  # grad_norm, version, lr, ...
    return out


def queue_stats() -> dict:
    """The replay queue's own stats, plus one abandoned reason (reported per reason once one happens)."""
    async def stats():
        svc = ReplayQueue(load_config(None, []))
        try:
            return await svc.stats()
        finally:
            await svc.close()

    return {**asyncio.run(stats()), "abandoned/engine_error": 1}


def _source_tags(module: str, var: str) -> set[str]:
    """Tags the orchestrator sets by hand on a metrics dict named ``var`` (``m["rollout/..."] = ...``)."""
    return set(re.findall(rf'\b{var}\["([^"]+)"\]\s*=', (PKG / module).read_text()))


def step_tags(monkeypatch) -> dict[str, float]:
    timing = {"step_s": 2.0, "wait_data_s": 0.5, "weight_push_s": 0.3, "weight_push_stall_s": 0.1,
              "gen_tokens_per_s": 100.0, "rollout_idle_ratio": 0.2, "weight_load_s": 0.25,
              "engine_sums": {"aborted_tokens": 3.0, "continued_tokens": 5.0, "carried_tokens": 4.0,
                              "carried_stale_tokens": 1.0, "partials_unsent": 0.0}}  # as the orchestrator sends them
    m = step_metrics(GROUPS, learner_output(monkeypatch), queue_stats(), trained_version=4, timing=timing)
    engine = {"gen_tokens": 10, "idle_seconds": 0.5, "groups_sent": 2, "version": 3, "pid": 7}
    per_engine, _ = fleet_metrics({0: engine}, {}, 1.0, GROUPS)
    return {**m, **per_engine, **{tag: 0.0 for tag in _source_tags("orchestrator.py", "m")}}


def _row(level: int, q: str) -> PromptRow:
    return PromptRow(data_source="synthetic", prompt=[Message(role="user", content=q)], ability="math",
                     reward_model=RewardSpec(style="rule", ground_truth="1"), extra_info={"level": level})


def val_tags() -> set[str]:
    rows = [_row(1, "a"), _row(2, "b"), _row(2, "c")]
    texts = [["Answer: 1", "x"], ["Answer: 1", "Answer: 1"], ["y", "z"]]
    parts = split_rows(rows, 2)
    results = [{"scores": prompt_scores([texts[i] for i in idx], [rows[i] for i in idx]), "gen_tokens": 4,
                "version_min": 3, "version_max": 4} for idx in parts]
    return set(merge_parts(parts, results, rows)) | _source_tags("orchestrator.py", "res")


def time_tags() -> set[str]:
    # every phase the package names: clock.phase("x") blocks and @timed("x") methods
    phases = {p for f in PKG.rglob("*.py") for p in re.findall(r'(?:\.phase|@timed)\("(\w+)"\)', f.read_text())}
    clock = PhaseClock()
    for name in phases:
        with clock.phase(name):
            pass
    return set(clock.metrics())


@pytest.fixture
def emitted(monkeypatch) -> set[str]:
    return set(step_tags(monkeypatch)) | val_tags() | time_tags()


# --------------------------------------------------------------------------- the checks


def test_the_table_lists_exactly_the_emitted_tags(emitted):
    rows = documented()
    patterns = {tag: _pattern(tag) for tag in rows}
    undocumented = sorted(t for t in emitted if not any(p.fullmatch(t) for p in patterns.values()))
    assert not undocumented, f"emitted but not in docs/metrics.md: {undocumented}"
    stale = sorted(tag for tag, p in patterns.items() if not any(p.fullmatch(t) for t in emitted))
    assert not stale, f"in docs/metrics.md but never emitted: {stale}"
    # The producers' pieces really are in the set (the fixture would not hide a missing producer).
    assert {"rollout/engine_restarts", "val/avg_at_k/L1", "time/training_s", "time/total_s",
            "replay/abandoned/engine_error", "val/seconds"} <= emitted
    assert set(_LEARNER_TAGS.values()) <= emitted  # every learner key is produced by the learner


def test_same_is_claimed_exactly_for_the_verl_tags_we_adopted(emitted):
    rows = documented()
    assert VERL_SAME <= emitted
    assert not VERL_OTHER & emitted, "a verl name used for another quantity"
    for tag, (_, verl) in rows.items():
        assert verl, tag
        if tag in VERL_SAME:
            assert verl.startswith("same"), f"{tag}: verl's name, so verl's meaning: {verl}"
        else:
            assert not verl.startswith("same"), f"{tag} is not verl's name: say which verl tag, or none"
            assert verl.startswith(("no equivalent", "`")), f"{tag}: {verl}"


def test_pg_clipfrac_lower_is_documented_and_computed_as_the_dual_clip_fraction(monkeypatch):
    meaning, verl = documented()["actor/pg_clipfrac_lower"]
    assert "dual" in meaning.lower() and verl.startswith("same")
    assert "dual" not in documented()["actor/pg_clipfrac_low_side"][0].lower()
    m = step_tags(monkeypatch)
    # Token-weighted over the two micro-batches (6 tokens), as verl's masked_mean over the batch:
    # dual 2 (ratios 5 and 4, A < 0); clipped term taken 3 (0.5 low side, 4.0 and 1.5 upper).
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(2 / 6, abs=1e-6)  # per-micro-batch mean: 1/4
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 6, abs=1e-6)
    assert m["actor/pg_clipfrac_upper"] == pytest.approx(2 / 6, abs=1e-6)
    assert m["actor/pg_clipfrac_low_side"] == pytest.approx(1 / 6, abs=1e-6)
    # Advantages over the loss-bearing tokens: 4 x -1 and 2 x +1.
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == \
        pytest.approx((-2 / 6, 1.0, -1.0), abs=1e-12)


def test_data_metrics_are_verls_over_the_trained_samples(monkeypatch):
    m = step_tags(monkeypatch)
    # Samples (prompt, response, reward): (3, 4, 1), (3, 2, -1, truncated), (5, 3, 0.5), (5, 1, -1).
    assert m["critic/score/mean"] == m["critic/rewards/mean"] == pytest.approx(-0.125)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, -1.0)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (2.5, 4.0, 1.0)
    assert m["response_length/clip_ratio"] == 0.25
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (4.0, 5.0, 3.0)
    assert m["perf/total_num_tokens"] == 16.0 + 10.0  # prompts per sample + responses
    assert m["perf/time_per_step"] == 2.0
    assert "reward -0.125" in progress_line(3, 10, m, 60.0)


def test_older_runs_rows_read_under_the_new_names():
    old = {"step": 5, "perf/step_s": 2.0, "reward/mean": 0.1, "actor/pg_clipfrac_lower": 0.04, "actor/grad_norm": 3.0,
           "queue/depth": 1.0}
    assert upgrade_row(old) == {"step": 5, "perf/time_per_step": 2.0, "critic/score/mean": 0.1,
                                "actor/pg_clipfrac_low_side": 0.04, "actor/grad_norm_max": 3.0, "replay/depth": 1.0}
    # A row written after the verl rename but before the replay queue's counters moved to replay/*:
    between = {"step": 6, "perf/time_per_step": 2.0, "queue/abandoned/score_timeout": 2.0, "queue/received": 9.0}
    assert upgrade_row(between) == {"step": 6, "perf/time_per_step": 2.0, "replay/abandoned/score_timeout": 2.0,
                                    "replay/received": 9.0}
    new = {"step": 5, "perf/time_per_step": 2.0, "actor/pg_clipfrac_lower": 0.01}  # today's: verl's dual clip
    assert upgrade_row(new) == new
    assert upgrade_row({"step": 0, "val/avg_at_k": 0.5}) == {"step": 0, "val/avg_at_k": 0.5}
    documented_tags = documented()
    assert all(new_tag in documented_tags for new_tag in RENAMED_TAGS.values())
    # Old names are gone, except the two verl names that now carry verl's meaning.
    assert not set(RENAMED_TAGS) - {"actor/pg_clipfrac_lower", "actor/grad_norm"} & set(documented_tags)
    assert not [t for t in documented_tags if t.startswith("queue/")]


def test_fleet_metrics_occupancy_and_tail_are_per_engine_deltas_over_the_window():
    """Two engines over a 2 s window; each may run batch_seqs = 10 sequences. Engine 0 ran 12 sequence-seconds
    (6 on average: occupancy 0.6) with 0.5 s of tail; engine 1 is a replacement (new pid): it counts from zero,
    8 sequence-seconds (0.4) and 1.0 s of tail."""
    before = {0: {"gen_tokens": 100, "idle_seconds": 1.0, "groups_sent": 3, "seq_seconds": 30.0, "tail_seconds": 2.0,
                  "pid": 1, "version": 1, "batch_seqs": 10},
              1: {"gen_tokens": 50, "idle_seconds": 0.0, "groups_sent": 1, "seq_seconds": 99.0, "tail_seconds": 9.0,
                  "pid": 2, "version": 1, "batch_seqs": 10}}
    now = {0: {**before[0], "gen_tokens": 140, "seq_seconds": 42.0, "tail_seconds": 2.5, "version": 2},
           1: {**before[1], "pid": 3, "gen_tokens": 20, "seq_seconds": 8.0, "tail_seconds": 1.0, "version": 2}}
    per_engine, fleet = fleet_metrics(now, before, 2.0, GROUPS)
    assert per_engine["rollout/0/occupancy"] == pytest.approx(0.6)
    assert per_engine["rollout/0/tail_ratio"] == pytest.approx(0.25)
    assert per_engine["rollout/1/occupancy"] == pytest.approx(0.4)
    assert per_engine["rollout/1/tail_ratio"] == pytest.approx(0.5)
    assert fleet["rollout_occupancy"] == pytest.approx(0.5)
    assert fleet["rollout_tail_ratio"] == pytest.approx(0.375)
    assert fleet["gen_tokens_per_s"] == pytest.approx((40 + 20) / 2.0)
    assert "rollout/0/weight_load_s" in per_engine and fleet["weight_load_s"] == 0.0  # no update in the window


def test_weight_load_s_is_the_engines_seconds_per_update_over_the_window():
    """Engine 0 did 2 updates in the window taking 0.4 s together (0.2 s each); engine 1 is a replacement
    (new pid), counted from zero: 1 update of 0.3 s; engine 2 had none (0). The fleet: 0.7 s / 3 updates."""
    before = {0: {"updates": 2, "update_seconds": 0.5, "pid": 1, "version": 1},
              1: {"updates": 9, "update_seconds": 9.0, "pid": 2, "version": 1},
              2: {"updates": 3, "update_seconds": 1.0, "pid": 4, "version": 1}}
    now = {0: {**before[0], "updates": 4, "update_seconds": 0.9}, 1: {"updates": 1, "update_seconds": 0.3, "pid": 3,
                                                                     "version": 2}, 2: before[2]}
    per_engine, fleet = fleet_metrics(now, before, 2.0, GROUPS)
    assert per_engine["rollout/0/weight_load_s"] == pytest.approx(0.2)
    assert per_engine["rollout/1/weight_load_s"] == pytest.approx(0.3)
    assert per_engine["rollout/2/weight_load_s"] == 0.0
    assert fleet["weight_load_s"] == pytest.approx(0.7 / 3)
