"""The planner (async_dapo/planning/): hand-computed step times, the staleness bound, the update modes'
costs, dynamic sampling, determinism, profile errors, validation against a table, the search and the CLI."""

import csv
import math

import pytest
import yaml

from async_dapo import planning as pl
from async_dapo.cli import main
from async_dapo.planning import Shape, predict, profile_from_dict

BASE = {
    "name": "hand", "hardware": "none: hand-made figures",
    "engine": {"max_running_seqs": 100_000, "decode_base_s": 0.01, "decode_per_seq_s": 0.001,
               "decode_per_ctx_token_s": 1e-5, "prefill_per_token_s": 1e-4, "per_group_s": 0.002},
    "learner": {"step_base_s": 0.1, "per_token_s": 0.001},
    "push": {"base_s": 0.01, "bytes": 1e6, "bandwidth_bytes_per_s": 1e8, "engine_pause_s": 0.03,
             "learner_stall_s": 0.005},
    "workload": {"prompt_tokens": 10, "response_lengths": [5], "keep_rate": 1.0},
}


def profile(**changes):
    """BASE with ``section={key: value}`` merged in."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for section, values in changes.items():
        tree[section] = {**tree.get(section, {}), **values}
    return profile_from_dict(tree)


def sync_step_by_hand(E: int, B: int, G: int, P: float, L: int, epochs: int = 1, per_sample_s: float = 0.0) -> float:
    """One synchronous step, with nothing overlapping: the B groups spread evenly over E engines, each
    engine prefills its groups, decodes L iterations with n = (B/E)·G running and context K0 + i·n at
    iteration i, scores its groups; then the learner trains, stalls for the push, the push travels and
    the engines pause before the next batch is admitted."""
    e, lp, pp = BASE["engine"], BASE["learner"], BASE["push"]
    groups = B // E
    n = groups * G
    decode = sum(e["decode_base_s"] + e["decode_per_seq_s"] * n + e["decode_per_ctx_token_s"] * (n * P + i * n)
                 for i in range(L))
    generate = groups * P * e["prefill_per_token_s"] + decode + groups * (e["per_group_s"] + G * per_sample_s)
    train = lp["step_base_s"] + epochs * lp["per_token_s"] * B * G * (P + L)
    # the engine pauses from the push's start: the broadcast and its own load overlap
    push = pp["learner_stall_s"] + max(pp["base_s"] + pp["bytes"] / pp["bandwidth_bytes_per_s"], pp["engine_pause_s"])
    return generate + train + push


@pytest.mark.parametrize("engines", [1, 2])
def test_sync_step_time_is_the_sum_of_its_parts(engines):
    shape = Shape(B=4, G=2, eta=0, max_inflight_prompts=8, num_engines=engines, epochs=2)
    pred = predict(profile(), shape, steps=12, warmup=2)
    expected = sync_step_by_hand(engines, 4, 2, 10, 5, epochs=2)
    assert pred.step_s == pytest.approx(expected, rel=1e-9)
    assert pred.staleness_mean == 0 and pred.staleness_max == 0 and pred.speedup == 1.0
    lp = BASE["learner"]
    train = lp["step_base_s"] + 2 * lp["per_token_s"] * 4 * 2 * 15
    stall = BASE["push"]["learner_stall_s"]
    assert pred.learner_idle == pytest.approx(1 - (train + stall) / expected, rel=1e-9)


def test_a_finished_group_costs_per_group_and_per_sample():
    """per_sample_s: 0.003 s more for each of a finished group's G = 3 samples (4 groups on one engine)."""
    shape = Shape(B=4, G=3, eta=0, max_inflight_prompts=8)
    pred = predict(profile(engine={"per_sample_s": 0.003}), shape, steps=12, warmup=2)
    assert pred.step_s == pytest.approx(sync_step_by_hand(1, 4, 3, 10, 5, per_sample_s=0.003), rel=1e-9)
    assert pred.step_s == pytest.approx(predict(profile(), shape, 12, 2).step_s + 4 * 3 * 0.003, rel=1e-9)


def test_an_abort_pays_each_restarted_sample_as_a_new_request():
    """Abort restarts the engine's 4 running samples (2 groups of 2): after the load it prefills both
    prompts again (2 x 10 tokens x 1e-4 s) and handles 4 new requests (4 x 0.003 s)."""
    from async_dapo.planning.simulator import Simulator

    shape = Shape(B=2, G=2, eta=1, max_inflight_prompts=2, update_mode="abort")
    sim = Simulator(profile(engine={"per_sample_s": 0.003}), shape, steps=4, warmup=0, seed=0)
    sim._admit(0.0)
    e = sim.engines[0]
    sim._fill(e)
    assert e.n == 4 and not e.waiting
    e.update = {"mode": "abort", "stage": "new", "version": 1}
    sim._start_update(e, 0.0)
    assert e.update["restarted"] == 4 and e.update["refill"] == 2 * 10
    assert sim._restart_s(e.update) == pytest.approx(2 * 10 * 1e-4 + 4 * 0.003, rel=1e-12)
    assert sim._restart_s({"mode": "inflight", "refill": 30}) == pytest.approx(30 * 1e-4, rel=1e-12)


def test_contention_does_not_touch_sync_where_the_roles_never_overlap():
    shape = Shape(B=4, G=2, eta=0, max_inflight_prompts=8)
    slowed = profile(contention={"engine_slowdown": 2.0, "learner_slowdown": 3.0})
    assert predict(slowed, shape, 12, 2).step_s == pytest.approx(sync_step_by_hand(1, 4, 2, 10, 5), rel=1e-9)


def test_contention_slows_the_overlapped_roles():
    shape = Shape(B=4, G=2, eta=2, max_inflight_prompts=12)
    alone = predict(profile(), shape, 20, 4, sync_baseline=False)
    slowed = predict(profile(contention={"engine_slowdown": 2.0, "learner_slowdown": 2.0}), shape, 20, 4,
                     sync_baseline=False)
    assert slowed.steps_per_s < 0.8 * alone.steps_per_s


def test_shared_cores_slow_every_busy_process_by_its_share():
    """cores 1 and 0.5 core of background: in a synchronous step (the roles never overlap) the engine runs
    alone, 1.5× slower ((1 + 0.5) / 1); the two learner ranks run together, 2.5× slower ((2 + 0.5) / 1); the
    push is not slowed. The interference slowdowns do not apply (never overlapped)."""
    shape = Shape(B=4, G=2, eta=0, max_inflight_prompts=8, learner_ranks=2)
    shared = profile(contention={"cores": 1.0, "background_cores": 0.5, "engine_slowdown": 3.0,
                                 "learner_slowdown": 3.0})
    e, lp, pp = BASE["engine"], BASE["learner"], BASE["push"]
    n, P, L = 8, 10, 5
    decode = sum(e["decode_base_s"] + e["decode_per_seq_s"] * n + e["decode_per_ctx_token_s"] * (n * P + i * n)
                 for i in range(L))
    generate = 4 * P * e["prefill_per_token_s"] + decode + 4 * e["per_group_s"]
    train = lp["step_base_s"] + lp["per_token_s"] * 4 * 2 * (P + L) / 2  # two ranks share the tokens
    push = pp["learner_stall_s"] + max(pp["base_s"] + pp["bytes"] / pp["bandwidth_bytes_per_s"], pp["engine_pause_s"])
    assert predict(shared, shape, 12, 2).step_s == pytest.approx(1.5 * generate + 2.5 * train + push, rel=1e-9)


def test_shared_cores_change_nothing_while_no_more_processes_are_busy_than_cores():
    """One engine and one rank on 2 cores without background: never more than 2 busy, so the plan is the
    one without sharing, to the last bit; a second engine makes 3 busy processes and the plan slower."""
    shape = Shape(B=4, G=2, eta=2, max_inflight_prompts=12)
    slowed = {"engine_slowdown": 1.3, "learner_slowdown": 1.4}
    alone = predict(profile(contention=slowed), shape, 20, 4, sync_baseline=False)
    shared = predict(profile(contention={**slowed, "cores": 2.0}), shape, 20, 4, sync_baseline=False)
    assert shared.steps_per_s == alone.steps_per_s and shared.learner_idle == alone.learner_idle
    two = Shape(B=4, G=2, eta=2, max_inflight_prompts=6, num_engines=2, learner_ranks=1)
    assert predict(profile(contention={**slowed, "cores": 2.0}), two, 20, 4, sync_baseline=False).steps_per_s < \
        predict(profile(contention=slowed), two, 20, 4, sync_baseline=False).steps_per_s


def test_measured_slowdowns_lose_the_sharing_they_contain():
    """The slowdowns are measured with one engine and one rank busy: with 2 cores and 0.4 of background,
    that is (2 + 0.4) / 2 = 1.2 of sharing; what remains is interference, below 1 for a role that lost less
    than its even share (1.1 / 1.2). Without shared cores a slowdown is all interference."""
    c = pl.Contention(cores=2.0, background_cores=0.4)
    assert c.share(2) == pytest.approx(1.2) and c.share(1) == 1.0 and c.share(3) == pytest.approx(1.7)
    assert c.interference(1.5) == pytest.approx(1.25) and c.interference(1.1) == pytest.approx(1.1 / 1.2)
    assert pl.Contention().interference(1.5) == 1.5 and pl.Contention().share(5) == 1.0


def test_an_engine_pauses_longer_for_every_sequence_it_holds():
    """The load's engine side: engine_pause_s plus engine_pause_per_seq_s per sequence it holds, running or
    waiting for room, at its share of the cores with itself counted; the engine resumes at the later of that
    and the broadcast's end."""
    from async_dapo.planning.simulator import Simulator

    prof = profile(push={"engine_pause_per_seq_s": 0.002}, contention={"cores": 1.0, "background_cores": 0.5})
    sim = Simulator(prof, Shape(B=4, G=2, eta=1, max_inflight_prompts=8), 4, 1, 0)
    e = sim.engines[0]
    e.n, e.update = 7, {"version": 1, "mode": "inflight", "stage": "pausing"}
    e.waiting.extend([101, 102, 103])  # admitted, no room yet
    sim.push = {"version": 1, "t0": 10.0, "entered": 0, "loaded": 0, "last_enter": 10.0}
    sim.events.clear()
    sim._enter_load(e, 10.2)
    # (1 busy: itself + 0.5 background) / 1 core = 1.5; broadcast ends at 10.2 + 1e6 / 1e8 = 10.21
    assert sim.events[0][0] == pytest.approx(10.2 + 0.03 + 0.002 * (7 + 3) * 1.5, rel=1e-12)
    e.waiting.clear()
    e.n, e.update, sim.push = 0, {"version": 1, "mode": "drain", "stage": "drain"}, {**sim.push, "entered": 0}
    sim.events.clear()
    sim._enter_load(e, 10.2)
    assert sim.events[0][0] == pytest.approx(10.2 + 0.03, rel=1e-12)  # a drained engine runs nothing


def test_the_loop_overhead_is_paid_every_step():
    """A learner-bound plan: each step costs the train step, the loop's own overhead and the push stall."""
    slow = profile(learner={"step_base_s": 5.0, "loop_per_step_s": 0.125,
                            "loop_per_sample_s": 0.25 / 8})  # 4 groups x 2 samples
    pred = predict(slow, Shape(B=4, G=2, eta=1, max_inflight_prompts=8), 20, 5, sync_baseline=False)
    lp = BASE["learner"]
    t_learner = 5.0 + lp["per_token_s"] * 4 * 2 * 15 + 0.125 + 0.25 + BASE["push"]["learner_stall_s"]
    assert pred.steps_per_s == pytest.approx(1 / t_learner, rel=1e-9)
    assert pred.train_s == pytest.approx(t_learner - BASE["push"]["learner_stall_s"], rel=1e-9)


def test_a_slow_learner_never_waits_and_sets_the_pace():
    slow = profile(learner={"step_base_s": 5.0})
    shape = Shape(B=4, G=2, eta=1, max_inflight_prompts=8)
    pred = predict(slow, shape, 20, 5)
    lp = BASE["learner"]
    t_learner = 5.0 + lp["per_token_s"] * 4 * 2 * 15 + BASE["push"]["learner_stall_s"]
    assert pred.steps_per_s == pytest.approx(1 / t_learner, rel=1e-9)
    assert pred.learner_idle == pytest.approx(0.0, abs=1e-12)
    sync_step = sync_step_by_hand(1, 4, 2, 10, 5) - lp["step_base_s"] + 5.0  # sync adds generation and push
    assert pred.speedup == pytest.approx(sync_step / t_learner, rel=1e-9)
    assert pred.staleness_mean == pytest.approx(1.0)  # the next batch is always generated one version behind


def test_a_slow_push_sets_the_pace_and_admission_counts_the_engines_version():
    """A push longer than a step: the loop waits for the previous push, so a step takes stall + push (drain:
    the engine generates while the sender does its fixed part, then loads within the broadcast); admission
    widens only when the engines loaded a version, so nothing generated goes stale."""
    prof = profile(learner={"step_base_s": 0.3}, push={"base_s": 1.0})
    shape = Shape(B=4, G=2, eta=1, max_inflight_prompts=8, update_mode="drain")
    pred = predict(prof, shape, 30, 5, sync_baseline=False)
    pp = BASE["push"]
    cycle = pp["learner_stall_s"] + 1.0 + pp["bytes"] / pp["bandwidth_bytes_per_s"]
    assert pred.push_s == pytest.approx(1.0 + pp["bytes"] / pp["bandwidth_bytes_per_s"], rel=1e-9)
    assert pred.steps_per_s == pytest.approx(1 / cycle, rel=1e-9)
    assert pred.dropped_stale == 0 and pred.staleness_hist == {1: 25 * 4}


LONG_TAIL = {"workload": {"response_lengths": None, "lognormal": {"median": 40, "sigma": 1.0}, "keep_rate": 0.7},
             "push": {"engine_pause_s": 0.5}}


@pytest.mark.parametrize("eta,k,mode", [(1, 1, "inflight"), (1, 2, "drain"), (2, 1, "abort"), (4, 4, "inflight"),
                                        (4, 2, "drain"), (8, 1, "inflight")])
def test_trained_groups_are_never_staler_than_eta(eta, k, mode):
    shape = Shape(B=8, G=4, eta=eta, max_inflight_prompts=(eta + 1) * 8 // 2, update_mode=mode, every_k_steps=k,
                  num_engines=2, max_response_length=200)
    pred = predict(profile(**LONG_TAIL, learner={"step_base_s": 0.02}), shape, 40, 8, sync_baseline=False)
    assert pred.staleness_max <= eta
    assert sum(pred.staleness_hist.values()) == (40 - 8) * 8
    assert max(pred.staleness_hist) == pred.staleness_max


@pytest.mark.parametrize("eta", [1, 4])
def test_admission_order_trains_the_population_it_admitted(eta):
    """Every group kept, in-flight updates, a long tail: admission order trains the admitted groups in order,
    so nothing goes stale and the trained responses are the finished ones (ratio 1); arrival order trains
    the first to finish, and the long groups that finish late are dropped stale (ratio well below 1)."""
    prof = profile(**{**LONG_TAIL, "workload": {**LONG_TAIL["workload"], "keep_rate": 1.0}})
    shape = Shape(B=8, G=4, eta=eta, max_inflight_prompts=(eta + 1) * 8, max_response_length=400)
    arrival = predict(prof, shape, 60, 10, sync_baseline=False)
    admission = predict(prof, shape.with_(batch_order="admission"), 60, 10, sync_baseline=False)
    assert admission.trained_length_ratio == pytest.approx(1.0, abs=0.01) and admission.dropped_stale == 0
    assert arrival.trained_length_ratio < 0.9 and arrival.dropped_stale > 0, arrival
    assert admission.staleness_max <= eta and sum(admission.staleness_hist.values()) == 50 * 8
    with pytest.raises(ValueError, match="batch_order"):
        shape.with_(batch_order="target")


def test_batch_order_auto_is_admission_only_under_abort():
    from async_dapo.config import load_config, resolved_batch_order

    assert [resolved_batch_order("auto", m) for m in pl.UPDATE_MODES] == ["arrival", "arrival", "admission"]
    assert [resolved_batch_order(o, "abort") for o in ("arrival", "admission")] == ["arrival", "admission"]
    assert resolved_batch_order("auto", "abort", partial_rollout=True) == "arrival"  # the prefix is kept
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.update_mode=abort"])
    assert cfg.replay.batch_order == "auto" and Shape.from_config(cfg).order == "admission"
    kept = Shape.from_config(load_config("configs/tiny_cpu.yaml",
                                         ["rollout.update_mode=abort", "rollout.partial_rollout=true"]))
    assert (kept.order, kept.update_mode) == ("arrival", "inflight")  # continued after the load, as in flight
    default = Shape.from_config(load_config("configs/tiny_cpu.yaml", []))
    assert default.order == "arrival"
    # a search that switches the mode plans abort with the order a run of it would get; a set order stays
    assert default.with_(update_mode="abort").order == "admission"
    pinned = Shape.from_config(load_config("configs/tiny_cpu.yaml", ["replay.batch_order=arrival"]))
    assert pinned.with_(update_mode="abort").order == "arrival"


def test_abort_wastes_tokens_and_drain_idles_the_engines():
    prof = profile(**{**LONG_TAIL, "push": {"engine_pause_s": 2.0}})
    shape = Shape(B=8, G=4, eta=2, max_inflight_prompts=24, max_response_length=400)
    runs = {m: predict(prof, shape.with_(update_mode=m), 40, 8, sync_baseline=False) for m in pl.UPDATE_MODES}
    assert runs["abort"].wasted_tokens > 0
    assert runs["inflight"].wasted_tokens == 0 and runs["drain"].wasted_tokens == 0
    assert runs["drain"].rollout_idle > runs["inflight"].rollout_idle + 0.05
    assert runs["drain"].steps_per_s < runs["inflight"].steps_per_s
    assert runs["drain"].tail_share > runs["inflight"].tail_share  # the drain decodes its last few alone


def test_a_keep_rate_of_one_half_doubles_generation_per_step():
    shape = Shape(B=16, G=4, eta=1, max_inflight_prompts=32)
    per_step = {}
    for keep in (1.0, 0.5):
        pred = predict(profile(workload={"keep_rate": keep}), shape, 60, 10, sync_baseline=False)
        per_step[keep] = pred.gen_tokens_per_s / pred.steps_per_s
        assert pred.dropped_filtered == (0 if keep == 1.0 else pytest.approx(50 * 16, rel=0.15))
    assert per_step[0.5] / per_step[1.0] == pytest.approx(2.0, rel=0.1)


def test_deterministic_for_a_seed():
    prof, shape = profile(**LONG_TAIL), Shape(B=8, G=4, eta=2, max_inflight_prompts=24, num_engines=2)
    a, b = (predict(prof, shape, 30, 5, seed=3) for _ in range(2))
    assert a == b
    assert predict(prof, shape, 30, 5, seed=4).row() != a.row()


def test_lengths_are_capped_and_lognormal_with_no_spread_is_one_length():
    cap = profile(workload={"response_lengths": [7, 9, 50]})
    shape = Shape(B=4, G=2, eta=0, max_inflight_prompts=4, max_response_length=5)
    assert predict(cap, shape, 12, 2).step_s == pytest.approx(sync_step_by_hand(1, 4, 2, 10, 5), rel=1e-9)
    flat = profile(workload={"response_lengths": None, "lognormal": {"median": 5, "sigma": 0.0}})
    assert predict(flat, shape.with_(max_response_length=100), 12, 2).step_s == pytest.approx(
        sync_step_by_hand(1, 4, 2, 10, 5), rel=1e-9)


@pytest.mark.parametrize("change,named", [
    ({"engine": {"bogus": 1}}, "engine.bogus: unknown key"),
    ({"push": {"bandwidth_bytes_per_s": 0}}, "push.bandwidth_bytes_per_s"),
    ({"workload": {"lognormal": {"median": 5, "sigma": 0.1}}}, "workload: give exactly one of"),
    ({"engine": {"decode_base_s": 0, "decode_per_seq_s": 0}}, "engine: decode_base_s + decode_per_seq_s"),
    ({"contention": {"typo_slowdown": 2}}, "contention.typo_slowdown: unknown key"),
])
def test_a_bad_profile_names_the_field(change, named):
    with pytest.raises(pl.ProfileError) as err:
        profile(**change)
    assert named in str(err.value) and "\n" not in str(err.value)


def write_profile(tmp_path, tree=None):
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(tree or BASE))
    return path


def test_validate_compares_each_row(tmp_path):
    prof = profile(**LONG_TAIL)
    base = Shape(B=8, G=4, eta=2, max_inflight_prompts=24, max_response_length=400)
    truth = {eta: predict(prof, pl.bench_row_shape(base)({"eta": str(eta)}), 30, 5, sync_baseline=False)
             for eta in (0, 2)}
    table = tmp_path / "throughput.csv"
    with table.open("w", newline="") as f:
        w = csv.DictWriter(f, ["mode", "eta", "steps_per_s", "staleness_mean", "learner_idle", "rollout_idle"])
        w.writeheader()
        w.writerow({"mode": "sync", "eta": 0, "steps_per_s": truth[0].steps_per_s, "staleness_mean": 0,
                    "learner_idle": truth[0].learner_idle, "rollout_idle": truth[0].rollout_idle})
        w.writerow({"mode": "eta2", "eta": 2, "steps_per_s": truth[2].steps_per_s * 1.25,
                    "staleness_mean": truth[2].staleness_mean + 0.2, "learner_idle": truth[2].learner_idle,
                    "rollout_idle": truth[2].rollout_idle + 0.15})
    rows = pl.validate(prof, table, base, steps=30, warmup=5)
    assert [r["eta"] for r in rows] == [0, 2]
    assert rows[0]["ok"] and rows[0]["steps_per_s_err"] == pytest.approx(0, abs=1e-12)
    assert rows[1]["steps_per_s_err"] == pytest.approx(1 / 1.25 - 1) and not rows[1]["steps_per_s_ok"]
    assert rows[1]["staleness_mean_err"] == pytest.approx(-0.2) and rows[1]["staleness_mean_ok"]
    assert not rows[1]["rollout_idle_ok"] and not rows[1]["ok"]
    # a row's batch order (the benchmark writes it, resolved) is the one predicted; older tables have none
    for_row = pl.bench_row_shape(base.with_(update_mode="abort"))
    assert for_row({"eta": "2", "batch_order": "admission"}).batch_order == "admission"
    assert for_row({"eta": "2"}).batch_order == "arrival"


def test_recommend_searches_the_split_and_keeps_the_staleness_bound():
    prof = profile(**LONG_TAIL, learner={"step_base_s": 0.05}, engine={"devices": 1})
    shape = Shape(B=8, G=4, eta=2, max_inflight_prompts=24, max_response_length=400)
    rec = pl.recommend(prof, shape, total_gpus=4, etas=(0, 1, 2), ks=(1, 2), steps=16, warmup=3,
                       max_mean_staleness=0.9, refine=None)
    splits = {(r["engines"], r["learner_ranks"]) for r in rec.rows}
    assert splits == {(1, 3), (2, 2), (3, 1)}
    assert len(rec.rows) == 3 * (1 + 2 * 3 + 2 * 3)  # per split: η 0 once; η 1 and η 2 × k 1, 2 × 3 modes
    speeds = [r["samples_per_s"] for r in rec.rows]
    assert speeds == sorted(speeds, reverse=True)
    assert rec.best["staleness_mean"] <= 0.9
    assert rec.best == max((r for r in rec.rows if r["staleness_mean"] <= 0.9), key=lambda r: r["samples_per_s"])
    assert all(r["every_k_steps"] <= r["eta"] + 1 for r in rec.rows)
    assert all(r["speedup"] == 1.0 for r in rec.rows if r["eta"] == 0)
    staged = pl.recommend(prof, shape, total_gpus=4, etas=(0, 1, 2), ks=(1, 2), steps=16, warmup=3,
                          max_mean_staleness=0.9, refine=1)
    assert len(staged.rows) < len(rec.rows)
    assert {(r["engines"], r["learner_ranks"]) for r in staged.rows} == splits  # every split tried at least once
    assert all(row in rec.rows for row in staged.rows)  # the same plans, simulated the same
    assert all(math.isfinite(r["speedup"]) for r in staged.rows)


def test_splits_use_exactly_the_devices():
    prof = profile(engine={"devices": 2}, learner={"devices_per_rank": 1})
    assert pl.splits_for(prof, 7) == [(1, 5), (2, 3), (3, 1)]
    assert all(e * 2 + r == 128 for e, r in pl.splits_for(prof, 128))
    with pytest.raises(pl.ProfileError, match="--total-gpus 2"):
        pl.splits_for(profile(engine={"devices": 2}), 2)


def test_cli_plan_prints_the_tables(tmp_path, capsys):
    prof = write_profile(tmp_path)
    table = tmp_path / "t.csv"
    table.write_text("mode,eta,steps_per_s,staleness_mean,learner_idle,rollout_idle\nsync,0,0.7,0,0.6,0.4\n")
    rc = main(["plan", "--profile", str(prof), "--config", "configs/tiny_cpu.yaml", "--set",
               "algorithm.train_batch_groups=8", "--set", "learner.mini_batch_groups=8", "--steps", "12",
               "--validate", str(table)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| plan | eta | update_mode | steps_per_s" in out and "## validation" in out
    config_row = next(line for line in out.splitlines() if line.startswith("| config |"))
    numbers = [float(c) for c in config_row.strip("|").split("|")[3:]]
    assert numbers and all(math.isfinite(x) for x in numbers)
    assert float(config_row.split("|")[4]) > 0  # steps/s


def test_cli_plan_bad_profile_is_one_line_and_exit_2(tmp_path, capsys):
    prof = write_profile(tmp_path, {**BASE, "engine": {**BASE["engine"], "bogus": 1}})
    assert main(["plan", "--profile", str(prof), "--config", "configs/tiny_cpu.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "engine.bogus: unknown key" in err


def test_predicted_step_s_reads_the_config(tmp_path):
    from async_dapo.config import load_config

    cfg = load_config("configs/tiny_cpu.yaml", ["replay.max_staleness=0", "rollout.max_inflight_prompts=4",
                                                "algorithm.train_batch_groups=4", "learner.mini_batch_groups=4",
                                                "rollout.n=2", "rollout.max_response_length=16",
                                                "reward.overlong_buffer_length=4", "learner.epochs=1"])
    step = pl.predicted_step_s(write_profile(tmp_path), cfg)
    assert step == pytest.approx(sync_step_by_hand(1, 4, 2, 10, 5), rel=1e-9)


def test_the_run_reports_predicted_against_measured_step_time(tmp_path):
    """logging.plan_profile: the end-of-run table adds the planner's step time and the measured one over the
    steps after the warm-up (a quarter of the run, at most 10): 8 steps, the first 2 discarded."""
    from async_dapo.config import load_config
    from async_dapo.orchestrator import Run

    cfg = load_config("configs/tiny_cpu.yaml", [f"logging.run_dir={tmp_path}",
                                                 "logging.plan_profile=configs/profiles/h100_qwen2.5_32b.yaml"])
    run = Run(cfg, None)
    assert run._predicted_line() == ""  # nothing predicted yet
    run._predict()
    assert run._predicted_s > 0 and math.isfinite(run._predicted_s)
    run._predicted_s = 2.0
    run._step_times = [9.0, 9.0, 1.0, 2.0, 3.0, 2.0, 2.0, 2.0]
    line = run._predicted_line()
    assert "2.000 s predicted, 2.000 s measured over 6 steps (+0%)" in line
    run._step_times = [9.0] * 2 + [3.0] * 6
    assert "3.000 s measured over 6 steps (+50%)" in run._predicted_line()


def test_validate_with_measured_keep_rates_uses_each_rows_own(tmp_path):
    """The diagnostic replaces the profile's keep rate by the row's: halving it must slow a generation-bound plan."""
    from async_dapo.planning import Shape, profile_from_dict, validate

    prof = profile_from_dict({
        "name": "t", "hardware": "-",
        "engine": {"max_running_seqs": 64, "decode_base_s": 0.01, "decode_per_seq_s": 0.0,
                   "decode_per_ctx_token_s": 0.0, "prefill_per_token_s": 0.0, "per_group_s": 0.0},
        "learner": {"step_base_s": 0.001, "per_token_s": 0.0},
        "push": {"base_s": 0.0, "bytes": 0.0, "bandwidth_bytes_per_s": 1e12, "engine_pause_s": 0.0},
        "workload": {"prompt_tokens": 4, "lognormal": {"median": 10, "sigma": 0.0}, "keep_rate": 1.0}})
    table = tmp_path / "t.csv"
    table.write_text("mode,eta,steps_per_s,keep_rate\nsync,0,1.0,1.0\nsync,0,1.0,0.5\n")
    shape = Shape(B=4, G=2, eta=0, max_inflight_prompts=4)
    plain = validate(prof, table, shape, steps=20, warmup=4)
    diag = validate(prof, table, shape, steps=20, warmup=4, measured_keep=True)
    assert plain[0]["steps_per_s_pred"] == plain[1]["steps_per_s_pred"] == diag[0]["steps_per_s_pred"]
    # keep 0.5: twice the groups per batch, each round of 10 iterations x 0.01 s; sync admits B per version
    assert diag[1]["steps_per_s_pred"] < 0.75 * diag[0]["steps_per_s_pred"]
