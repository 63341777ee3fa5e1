"""The planner's calibration (tools/bench/calibrate.py) recovers the coefficients of a synthetic engine and
learner whose coefficients are known: the measurements are generated from them (with 0.5-1 % noise) the way
the calibration takes them, then fed through the calibration's own fit functions. The tolerances are what
that noise allows on this grid (over 200 noise draws the worst decode coefficient was off by 9 %): b·n and
c·K are nearly collinear when L only takes two values, so the wall-clock noise is amplified in b."""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
import calibrate  # noqa: E402

# A made-up engine: one decode iteration of n sequences holding K context tokens costs a + b·n + c·K seconds;
# a request of n prompts of P tokens costs a fixed o plus p per prompt token to prefill.
ENGINE = {"decode_base_s": 2e-3, "decode_per_seq_s": 4e-5, "decode_per_ctx_token_s": 1.5e-6}
PREFILL_S, FIXED_S, PROMPT_TOKENS = 3e-5, 0.02, 30.0


def _noisy(rng: random.Random, x: float, rel: float = 0.01) -> float:
    return x * (1 + rng.uniform(-rel, rel))


def _engine_walls(rng: random.Random, n: int, L: int) -> tuple[float, float]:
    """(wall(n, max_new_tokens=1), wall(n, L)) of the synthetic engine, each with 0.5 % noise."""
    a, b, c = ENGINE.values()
    w1 = FIXED_S + PREFILL_S * n * PROMPT_TOKENS
    per_iteration = a + b * n + c * n * (PROMPT_TOKENS + L / 2)  # the mean context over the L tokens
    return _noisy(rng, w1, 0.005), _noisy(rng, w1 + (L - 1) * per_iteration, 0.005)


def _engine_points(seed: int) -> tuple[list, list]:
    """The (n, L) grid of calibrate --quick with the tiny config (n up to 128, L 16 and 64)."""
    rng = random.Random(seed)
    points, pre = [], []
    for n in (1, 8, 32, 128):
        walls1 = []
        for L in (16, 64):
            w1, wl = _engine_walls(rng, n, L)
            walls1.append(w1)
            points.append(calibrate.decode_point(n, L, PROMPT_TOKENS, w1, wl))
        pre.append((n * PROMPT_TOKENS, sum(walls1) / len(walls1)))
    return points, pre


@pytest.mark.parametrize("seed", range(5))
def test_decode_and_prefill_fit_recover_a_known_engine(seed):
    points, pre = _engine_points(seed)
    fit, resid = calibrate.fit_decode(points)
    assert fit == pytest.approx(ENGINE, rel=0.12), fit
    assert max(abs(r) / p[3] for r, p in zip(resid, points)) < 0.05  # the model fits its own engine
    slope, how = calibrate.fit_prefill(pre)
    assert slope == pytest.approx(PREFILL_S, rel=0.05) and how.startswith("slope"), (slope, how)


def test_decode_fit_clips_a_negative_term_and_keeps_a_plus_b_positive():
    """An engine whose per-iteration time does not grow with n (b = 0, all cost in the context): a noisy fit
    may give b < 0; it is clipped to 0, and the other two terms still come out near the truth."""
    rng = random.Random(0)
    a, c = 1e-3, 2e-6
    points = []
    for n in (1, 8, 32, 128):
        for L in (16, 64):
            it = a + c * n * (PROMPT_TOKENS + L / 2)
            points.append(calibrate.decode_point(n, L, PROMPT_TOKENS, 0.1, 0.1 + (L - 1) * _noisy(rng, it)))
    fit, _ = calibrate.fit_decode(points)
    assert fit["decode_per_seq_s"] >= 0 and fit["decode_base_s"] + fit["decode_per_seq_s"] > 0
    assert fit["decode_base_s"] == pytest.approx(a, rel=0.2)
    assert fit["decode_per_ctx_token_s"] == pytest.approx(c, rel=0.1)


def test_learner_fit_recovers_base_and_per_token_cost_per_rank_and_epoch():
    """Step seconds = base + epochs · per_token_s · tokens / ranks (the planner's learner model): with 2 ranks
    and 3 epochs the profile's per_token_s is the fitted slope x 2 / 3."""
    rng = random.Random(1)
    base, per_token, ranks, epochs = 0.4, 2e-5, 2, 3
    tokens = [8000, 12000, 16000, 20000, 24000, 30000]
    seconds = [_noisy(rng, base + epochs * per_token * t / ranks) for t in tokens]
    cfg = SimpleNamespace(learner=SimpleNamespace(epochs=epochs), placement=SimpleNamespace(learner_ranks=ranks))
    part, src, mean_s = calibrate.learner_part(cfg, [99.0, *seconds], [tokens[0], *tokens], warmup=1)
    assert part["step_base_s"] == pytest.approx(base, rel=0.1), part
    assert part["per_token_s"] == pytest.approx(per_token, rel=0.05), part
    assert mean_s == pytest.approx(sum(seconds) / len(seconds))  # the warm-up step (99 s) is left out
    assert "lstsq" in src["learner"]


def test_learner_fit_without_a_token_spread_charges_everything_per_token():
    """Batches of (nearly) equal size show no slope: base 0, per token = mean s / mean tokens."""
    base, slope, how = calibrate.fit_learner([1.0, 1.1, 0.9], [10000, 10100, 9900])
    assert base == 0.0 and slope == pytest.approx(1.0 / 10000) and "vary by" in how


def test_learner_ranks_fit_recovers_a_synthetic_learner_and_its_collectives():
    """tools/bench/learner_ranks.py's fits on cells generated from known figures (1 % noise): 1 rank
    gives per-token, per-micro-batch and per-update seconds and the forward share; 2 ranks the bandwidth."""
    import learner_ranks

    truth = {"step_base_s": 0.05, "per_token_s": 2e-5, "per_micro_batch_s": 0.01, "per_update_s": 0.04}
    share, nbytes, bw = 0.3, 4e6, 2e8  # collectives per micro-batch per rank: 3 x 4e6 x 1/2 / 2e8 = 0.03 s
    rng = random.Random(3)
    rows = {1: [], 2: []}
    for tokens in (8192, 14336):
        for micro_1, micro_2, updates, mode in ((1, 1, 1, "naive"), (4, 2, 1, "naive"), (2, 2, 2, "naive"),
                                                (2, 2, 2, "decoupled")):
            first = tokens // updates
            for R, micro in ((1, micro_1), (2, micro_2)):
                s = (truth["step_base_s"] + truth["per_token_s"] * tokens / R + truth["per_micro_batch_s"] * micro
                     + truth["per_update_s"] * updates / R)
                if R == 2:
                    s += micro * 3 * nbytes * 0.5 / bw
                if mode != "naive":
                    s += share * truth["per_token_s"] * (tokens - first) / R
                rows[R].append({"batch": str(tokens), "micro_batch_tokens": 8192 // micro_1,
                                "mini_batch_groups": 64 // updates, "mode": mode, "tokens": tokens,
                                "first_mini_batch_tokens": first, "micro": micro, "updates": updates,
                                "s": _noisy(rng, s)})
    part, resid = learner_ranks.fit_one_rank(rows[1])
    for key, value in truth.items():
        assert part[key] == pytest.approx(value, rel=0.25, abs=2e-3), (key, part)
    assert part["forward_share"] == pytest.approx(share, abs=0.15)
    extra, _ = learner_ranks.fit_two_ranks(part, rows[2], nbytes)
    assert extra["collective_bandwidth_bytes_per_s"] == pytest.approx(bw, rel=0.25)


def test_the_ranks_fit_is_scaled_to_the_real_learner_without_touching_its_collectives():
    """Phase f's synthetic cells give the learner's shape against ranks; phase c's real steps set its level:
    every compute figure × the ratio, the collective figures as measured."""
    part = {"step_base_s": 0.01, "per_token_s": 4e-5, "per_micro_batch_s": 2e-3, "per_update_s": 0.0,
            "forward_share": 0.25, "collective_bytes": 1.5e6, "collective_bandwidth_bytes_per_s": 8e7}
    scaled = calibrate.scaled_compute(part, 1.2)
    assert scaled["step_base_s"] == pytest.approx(0.012) and scaled["per_token_s"] == pytest.approx(4.8e-5)
    assert scaled["per_micro_batch_s"] == pytest.approx(2.4e-3) and scaled["per_update_s"] == 0.0
    assert {k: scaled[k] for k in ("forward_share", "collective_bytes", "collective_bandwidth_bytes_per_s")} == \
        {"forward_share": 0.25, "collective_bytes": 1.5e6, "collective_bandwidth_bytes_per_s": 8e7}


def test_the_pause_per_held_sequence_is_what_the_model_misses_per_sequence():
    # (0.169 - 0.0816) / 762 sequences held; never below 0, and 0 with nothing held
    assert calibrate.pause_per_seq(0.169, 0.0816, 762) == pytest.approx(0.0874 / 762, rel=1e-12)
    assert calibrate.pause_per_seq(0.05, 0.08, 762) == 0.0
    assert calibrate.pause_per_seq(0.169, 0.0816, 0) == 0.0


def test_the_pause_term_is_measured_against_the_model_without_it():
    """A --base profile may already carry a pause term: the run's excess is taken over the model without it,
    so the measured figure does not depend on the one it replaces; a draining run keeps the profile's."""
    from async_dapo.config import load_config
    from async_dapo.planning import load_profile

    cfg = load_config("configs/tiny_cpu.yaml", [])
    base = load_profile("configs/profiles/cpu_tiny.yaml")
    with_term = base.model_copy(update={"push": base.push.model_copy(update={"engine_pause_per_seq_s": 0.01})})
    got = {"weight_load_s": 0.5, "occupancy": 0.25}  # 0.25 x 192 x 8 = 384 sequences held
    a = calibrate.pause_part(with_term, cfg, got, {}).push.engine_pause_per_seq_s
    b = calibrate.pause_part(base.model_copy(update={"push": base.push.model_copy(
        update={"engine_pause_per_seq_s": 0.0})}), cfg, got, {}).push.engine_pause_per_seq_s
    assert a == b and 0 < a < 0.5 / 384
    # more than max_running_seqs (762) held: every one counts, queued or running
    full = calibrate.pause_part(with_term, cfg, {**got, "occupancy": 0.75}, {}).push.engine_pause_per_seq_s
    assert full == pytest.approx(a * 384 / 1152, rel=1e-9)  # the same excess over 0.75 x 192 x 8 = 1152
    drain = load_config("configs/tiny_cpu.yaml", ["rollout.update_mode=drain", "rollout.drain_timeout_s=30"])
    sources = {}
    assert calibrate.pause_part(with_term, drain, got, sources).push.engine_pause_per_seq_s == 0.01
    assert sources["pause_per_seq"].startswith("not measured")


def test_group_cost_splits_into_per_group_and_per_sample():
    """Seconds per group beyond the decode model at G 4, 8, 16 of an engine paying 1 ms per group and 0.8 ms
    per sample give those back; costs proportional to G are all per sample; flat ones all per group."""
    a, b = calibrate.fit_group_cost({4: 0.001 + 4 * 0.0008, 8: 0.001 + 8 * 0.0008, 16: 0.001 + 16 * 0.0008})
    assert a == pytest.approx(0.001, rel=1e-9) and b == pytest.approx(0.0008, rel=1e-9)
    # a line that would cross below 0 at G = 0 goes through the origin: least squares of r = b·G
    a, b = calibrate.fit_group_cost({4: 0.0038, 8: 0.008, 16: 0.0165})
    assert a == 0.0 and b == pytest.approx((4 * 0.0038 + 8 * 0.008 + 16 * 0.0165) / (16 + 64 + 256), rel=1e-9)
    assert calibrate.fit_group_cost({4: 0.005, 8: 0.005, 16: 0.004}) == (pytest.approx(0.014 / 3), 0.0)
    assert calibrate.fit_group_cost({8: 0.006}) == (0.006, 0.0)


def test_split_group_cost_keeps_phase_bs_level_and_the_bare_engines_shape(monkeypatch):
    """The bare engine at G 4 / 8 / 16 pays 1 ms + 1 ms per sample beyond the decode model: 8 of 9 ms of a
    group of 8 are per sample. Phase b's 4.5 ms per group (the actor's level) splits the same way: 0.5 ms per
    group and 4 / 8 ms per sample."""
    from async_dapo.config import load_config

    cfg = load_config("configs/tiny_cpu.yaml", [])  # n 8, B 64
    model_s = {4: 0.002, 8: 0.003, 16: 0.005}  # the decode model's seconds per group (per batch / B)
    monkeypatch.setattr(calibrate, "engine_only_s_per_batch", lambda c, e, w, G, filter_groups: model_s[G] * 64)
    bare = {G: 1.0 / (model_s[G] + 0.001 + 0.001 * G) for G in (4, 8, 16)}
    per_group, per_sample, how = calibrate.split_group_cost(cfg, {}, {}, bare, 0.0045)
    assert per_group == pytest.approx(0.0005, rel=1e-9) and per_sample == pytest.approx(0.0005, rel=1e-9)
    assert per_group + 8 * per_sample == pytest.approx(0.0045, rel=1e-9)
    assert "89 % of a group of 8's is per sample" in how


def test_effective_cores_give_two_engines_the_measured_rate():
    """Two engines at 1.28 times one, 0.45 cores of background: cores = 1.28 x 2.45 / 2 = 1.568, so that
    each of two busy engines runs 2.45 / 1.568 = 1.5625 times slower (2 / 1.5625 = 1.28 times one); bounded
    by 1 + background (one engine alone is never slowed) and by the machine's CPUs."""
    cores, how = calibrate.effective_cores(1.28, 0.45, 2.0)
    assert cores == pytest.approx(1.568, rel=1e-12) and "1.568" in how
    from async_dapo.planning import Contention

    c = Contention(cores=cores, background_cores=0.45)
    assert 2 / c.share(2) == pytest.approx(1.28, rel=1e-12) and c.share(1) == 1.0
    assert calibrate.effective_cores(0.9, 0.45, 2.0)[0] == pytest.approx(1.45)
    assert calibrate.effective_cores(1.9, 0.45, 2.0)[0] == 2.0


def test_the_second_run_has_a_quarter_of_the_batch_and_as_many_updates():
    def cfg(B, mini):
        return SimpleNamespace(algorithm=SimpleNamespace(train_batch_groups=B),
                               learner=SimpleNamespace(mini_batch_groups=mini))

    assert calibrate.smaller_batch(cfg(64, 32)) == ["algorithm.train_batch_groups=16", "learner.mini_batch_groups=8"]
    assert calibrate.smaller_batch(cfg(24, 8)) == ["algorithm.train_batch_groups=6", "learner.mini_batch_groups=2"]
    # 3 groups cannot make 2 mini-batches: one update
    assert calibrate.smaller_batch(cfg(12, 6)) == ["algorithm.train_batch_groups=3", "learner.mini_batch_groups=3"]
    assert calibrate.smaller_batch(cfg(2, 1)) == ["algorithm.train_batch_groups=1", "learner.mini_batch_groups=1"]
    assert calibrate.smaller_batch(cfg(1, 1)) == []  # nothing smaller: the loop stays all per sample
