"""The benchmark and study tools run end to end on the real stack (their --quick presets) and write what they
promise: a table, a CSV and a PNG whose numbers are all finite, and positive where a rate or a time is.
No speed threshold: tools measure, tests check behaviour."""

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _run(args: list[str], timeout: int) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_bench_throughput_quick(tiny_model, tmp_path):
    out = _run(["tools/bench/throughput.py", "--quick", "--model", str(tiny_model), "--out", str(tmp_path)], 900)
    rows = _csv(tmp_path / "default" / "throughput.csv")
    assert [r["mode"] for r in rows] == ["sync", "eta2"] and [r["eta"] for r in rows] == ["0", "2"]
    positive = ["steps_per_s", "samples_per_s", "gen_tokens_per_s", "trained_tokens_per_s", "push_s",
                "stall_per_push_s", "speedup", "ideal_speedup", "overlap_efficiency", "g_s", "t_s"]
    ratios = ["learner_idle", "rollout_idle", "staleness_mean", "staleness_max"]  # 0 is a valid value (sync)
    for r in rows:
        for col in positive:
            assert math.isfinite(float(r[col])) and float(r[col]) > 0, (r["mode"], col, r[col])
        for col in ratios:
            assert math.isfinite(float(r[col])) and float(r[col]) >= 0, (r["mode"], col, r[col])
        assert float(r["learner_idle"]) <= 1 and float(r["rollout_idle"]) <= 1
        assert float(r["staleness_max"]) <= int(r["eta"])  # the queue's per-sample bound
    assert float(rows[0]["speedup"]) == 1.0  # sync is the reference
    assert 1 <= float(rows[0]["ideal_speedup"]) <= 2  # (g + t) / max(g, t) with sync's own g
    assert float(rows[0]["staleness_max"]) == 0.0
    assert (tmp_path / "default" / "throughput.png").read_bytes()[:8] == PNG
    assert "| sync | 0 |" in out and "g = sync " in out


def test_calibrate_quick(tmp_path):
    """The planner's calibration (roles alone) writes a valid profile whose figures the planner can use, and
    whose figures are the ones its measurements and the config imply (tests/unit/test_calibrate_fit.py checks
    the fits themselves against synthetic engines and learners of known coefficients)."""
    from async_dapo.config import load_config
    from async_dapo.planning import Shape, load_profile, predict

    out = tmp_path / "tiny.yaml"
    # phase f (the learner against 1 and 2 ranks) is left out here: its fit is checked on synthetic cells
    # (tests/unit/test_calibrate_fit.py) and it would add a minute; the figures below are phase c's
    log = _run(["tools/bench/calibrate.py", "--config", "configs/tiny_cpu.yaml", "--model", "models/tiny_cpu",
                "--out", str(out), "--quick", "--phases", "engine", "actor", "pair", "learner", "push", "contention",
                "run"],
               900)
    profile = load_profile(out)
    for part in (profile.engine, profile.learner, profile.push, profile.contention):
        for key, value in part.model_dump().items():
            assert math.isfinite(float(value)) and float(value) >= 0, (key, value)
    # the run phase: a real run of the config, on this machine's cores, its other processes busy; the cores
    # as the work they do, from two engines against one (phase pair)
    c = profile.contention
    assert 0 < c.background_cores < os.cpu_count()
    pair = float(re.search(r"generated ([\d.]+) times one engine's", profile.sources["cores"])[1])
    assert c.cores == pytest.approx(min(os.cpu_count(), max(1 + c.background_cores, pair * (2 + c.background_cores) / 2)),
                                    rel=1e-3)
    # the loop's own seconds at two batch sizes (the second run at a quarter of the batch), split per step and
    # per sample through them; the push call as the run measured it
    lp = profile.learner
    assert 0 <= lp.loop_per_step_s < 1 and 0 <= lp.loop_per_sample_s < 0.01
    assert lp.loop_per_step_s + lp.loop_per_sample_s > 0
    s1, n1, s2, n2 = re.search(r"([\d.]+) at (\d+) samples \(a second run.*\) and ([\d.]+) at (\d+) \(the run above",
                               profile.sources["loop"]).groups()
    assert (int(n1), int(n2)) == (16 * 8, 64 * 8)  # the default's B 64 and 64 / 4, G 8
    sys.path.insert(0, str(REPO / "tools" / "bench"))
    import in_run

    per_step, per_sample = in_run.loop_split((int(n1), float(s1)), (int(n2), float(s2)))  # the logged 4 decimals
    assert lp.loop_per_step_s == pytest.approx(per_step, abs=4e-4)
    assert lp.loop_per_sample_s == pytest.approx(per_sample, abs=1e-6)
    stall = float(re.search(r"push call's median ([\d.]+) s", profile.sources["run"])[1])
    assert profile.push.learner_stall_s == pytest.approx(stall, abs=1e-4)
    assert {"run", "run_check", "run_check_small", "pause_per_seq", "loop"} <= set(profile.sources)
    assert (tmp_path / "tiny_run_small" / "metrics.jsonl").exists()
    assert 0 <= profile.push.engine_pause_per_seq_s < 0.01  # seconds per sequence held in an update
    assert "sequences held, running or queued" in profile.sources["pause_per_seq"]
    assert (tmp_path / "tiny_run" / "metrics.jsonl").exists()
    e = profile.engine
    assert e.decode_base_s + e.decode_per_seq_s > 0 and e.max_running_seqs >= 1
    assert profile.learner.per_token_s > 0 and profile.push.bytes > 0
    assert profile.contention.engine_slowdown >= 1 and profile.contention.learner_slowdown >= 1
    w = profile.workload
    assert w.prompts and w.keep_rate is None and w.prompt_tokens > 0
    assert {"decode", "learner", "push", "contention", "per_group_s", "per_sample_s", "bare_groups", "pair"} <= \
        set(profile.sources)
    # phase b's cost per group beyond the decode model, split between per group and per sample
    per_group = float(re.search(r"clipped at 0: ([\d.]+) ms per group", profile.sources["per_group_s"])[1]) / 1e3
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", [])
    assert e.per_group_s + cfg.rollout.n * e.per_sample_s == pytest.approx(per_group, abs=1e-6)
    pred = predict(profile, Shape.from_config(cfg), steps=20, warmup=4)
    assert math.isfinite(pred.steps_per_s) and pred.steps_per_s > 0
    for ratio in (pred.learner_idle, pred.rollout_idle, pred.occupancy, pred.tail_share):
        assert 0 <= ratio <= 1
    assert "calibrated " in log
    _assert_calibration_follows_its_measurements(profile, log, cfg)


def _assert_calibration_follows_its_measurements(profile, log: str, cfg) -> None:
    """What the schema does not guarantee: each figure is the one the tool's own measurements (its log) and
    the config imply."""
    import statistics

    from transformers import AutoTokenizer

    from async_dapo.planning import Shape, predict
    from async_dapo.planning.workload import keep_rate

    from async_dapo.data.rows import encode_prompt, train_rows

    r, e = cfg.rollout, profile.engine
    # the warm start as whole groups: 16 prompts x n real samples, within the response budget, scored
    records = profile.workload.prompts
    assert len(records) == 16 and {len(x.lengths) for x in records} == {r.n}
    lengths = profile.workload.all_lengths()
    assert min(lengths) >= 1 and max(lengths) <= r.max_response_length, lengths
    # keep for a group size calibration never used (2n) is the closed form from each prompt's accuracy,
    # and the simulator's keep converges on it
    p = [sum(x.correct) / r.n for x in records]
    by_hand = statistics.fmean(1 - q ** (2 * r.n) - (1 - q) ** (2 * r.n) for q in p)
    assert keep_rate(profile.workload, 2 * r.n) == pytest.approx(by_hand, abs=1e-12)
    at_n = statistics.fmean(0 < sum(x.correct) < r.n for x in records)
    assert keep_rate(profile.workload, r.n) == at_n
    if 0 < by_hand:
        pred = predict(profile, Shape.from_config(cfg).with_(G=2 * r.n), steps=60, warmup=10, sync_baseline=False)
        assert pred.keep_rate == pytest.approx(by_hand, abs=0.1), (pred.keep_rate, by_hand)
    # the engine phase's prompts (the first 128 training rows: --quick's largest n) and its KV-cache bound
    tok = AutoTokenizer.from_pretrained(REPO / "models/tiny_cpu")
    rows = train_rows(cfg)
    ptok = statistics.mean(len(encode_prompt(tok, rows[i % len(rows)])) for i in range(128))
    window = r.max_inflight_prompts * r.n
    kv_seqs = int(r.engine.max_total_tokens / (ptok + r.max_response_length / 2))
    assert e.max_running_seqs == min(window, kv_seqs), (e.max_running_seqs, window, kv_seqs, ptok)
    # the decode fit explains its heaviest measurement (n = 128, L = 64: the longest, least noisy wall)
    measured_line = r"engine: n=\s*(\d+) L=\s*(\d+): wall [\d.]+ s, prefill\(1 token\) [\d.]+ s, ([\d.]+) ms/it"
    its = {(int(n), int(L)): float(ms) / 1e3 for n, L, ms in re.findall(measured_line, log)}
    n, L = max(its)
    model = e.decode_base_s + e.decode_per_seq_s * n + e.decode_per_ctx_token_s * n * (ptok + L / 2)
    assert model == pytest.approx(its[n, L], rel=0.35), (n, L, model, its)
    # the learner's figures give back the mean step it measured (steps after the discarded first one)
    learner_line = re.search(r"learner: steps \[([^\]]*)\] s, tokens \[([^\]]*)\]", log)
    steps, tokens = learner_line[1].split(","), learner_line[2].split(",")
    skip = 1 if len(steps) > 2 else 0
    lr, ranks, epochs = profile.learner, cfg.placement.learner_ranks, cfg.learner.epochs
    fitted = [lr.step_base_s + epochs * lr.per_token_s * int(t) / ranks for t in tokens[skip:]]
    measured = [float(s) for s in steps[skip:]]
    assert statistics.fmean(fitted) == pytest.approx(statistics.fmean(measured), rel=0.01), (fitted, measured)
    # a push carries every parameter of the checkpoint (tied embeddings once) in the engine's dtype: float32
    from safetensors import safe_open

    with safe_open(REPO / "models/tiny_cpu/model.safetensors", "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert r.engine.dtype == "float32" and profile.push.bytes == 4 * params, (profile.push.bytes, params)
