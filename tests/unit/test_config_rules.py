"""Cross-field config rules (async_dapo.config.CROSS_FIELD_RULES): each one rejects a config just past its
boundary with one line naming its dotted keys, and loads the config at the boundary itself."""

import inspect

import pytest
from pydantic import ValidationError

from async_dapo import config
from async_dapo.config import root, rules  # root.Config runs root.CROSS_FIELD_RULES
from async_dapo.config import CROSS_FIELD_RULES, Config, ConfigError, load_config

MIB = 1024 * 1024
# transport.receive_budget_bytes at its floor: default max_message_bytes (64 MiB), max_peers None = 2 x 1 engine.
BUDGET_2_PEERS = config.receive_min_budget(2, config.receive_hard_cap(64 * MIB))
BUDGET_3_PEERS = config.receive_min_budget(3, config.receive_hard_cap(64 * MIB))
BUDGET_4_PEERS = config.receive_min_budget(4, config.receive_hard_cap(64 * MIB))

# (rule, overrides on the defaults that break only that rule, what its one-line message must contain (it starts
# with the first), overrides at the rule's boundary that must load). A rule may have several rows (ids below).
CASES = {
    "mini_batch_divides": (
        "rule_mini_batch_divides_train_batch",
        ["algorithm.train_batch_groups=12", "learner.mini_batch_groups=8"],
        ["learner.mini_batch_groups", "must divide", "algorithm.train_batch_groups", "(8 vs 12)"],
        ["algorithm.train_batch_groups=12", "learner.mini_batch_groups=6"],
    ),
    "overlong_buffer_fits": (
        "rule_overlong_buffer_fits_response",
        ["reward.overlong_buffer_length=33", "rollout.max_response_length=32"],
        ["reward.overlong_buffer_length", "rollout.max_response_length"],
        ["reward.overlong_buffer_length=32", "rollout.max_response_length=32"],
    ),
    "overlong_buffer_off": (
        "rule_overlong_buffer_fits_response",
        ["reward.overlong_buffer_length=33", "rollout.max_response_length=32"],
        ["reward.overlong_buffer_length", "rollout.max_response_length"],
        ["reward.overlong_buffer_length=33", "rollout.max_response_length=32", "reward.overlong_buffer_enable=false"],
    ),
    "context_fits": (
        "rule_context_fits_prompt_and_response",
        ["rollout.engine.context_length=287", "data.max_prompt_length=256", "rollout.max_response_length=32"],
        ["rollout.engine.context_length", "data.max_prompt_length", "rollout.max_response_length"],
        ["rollout.engine.context_length=288", "data.max_prompt_length=256", "rollout.max_response_length=32"],
    ),
    "context_unset": (
        "rule_context_fits_prompt_and_response",
        ["rollout.engine.context_length=16", "data.max_prompt_length=256"],
        ["rollout.engine.context_length", "data.max_prompt_length", "rollout.max_response_length"],
        ["rollout.engine.context_length=null", "data.max_prompt_length=256"],
    ),
    "sft_target_level": (
        "rule_sft_target_level_is_configured",
        ["model.bootstrap.sft_target_level=3", "data.synthetic.levels=[1, 2]"],
        ["model.bootstrap.sft_target_level (3)", "data.synthetic.levels [1, 2]"],
        ["model.bootstrap.sft_target_level=2", "data.synthetic.levels=[1, 2]"],
    ),
    "weight_sync_within_staleness": (
        "rule_weight_sync_within_staleness",
        ["weight_sync.every_k_steps=3", "replay.max_staleness=1"],
        ["weight_sync.every_k_steps", "replay.max_staleness", "(3)", "(2)"],
        ["weight_sync.every_k_steps=2", "replay.max_staleness=1"],
    ),
    "dynamic_sampling_needs_groups": (
        "rule_dynamic_sampling_needs_groups",
        ["rollout.n=1"],
        ["rollout.n", "algorithm.dynamic_sampling.enable"],
        ["rollout.n=2"],
    ),
    "dynamic_sampling_off": (
        "rule_dynamic_sampling_needs_groups",
        ["rollout.n=1"],
        ["rollout.n", "algorithm.dynamic_sampling.enable"],
        ["rollout.n=1", "algorithm.dynamic_sampling.enable=false"],
    ),
    "capacity_holds_eta_plus_one_batches": (
        "rule_capacity_holds_staleness_window",
        ["replay.capacity_groups=47", "replay.max_staleness=2", "algorithm.train_batch_groups=16"],
        ["replay.capacity_groups", "replay.max_staleness", "algorithm.train_batch_groups", "(47)", "= 48"],
        ["replay.capacity_groups=48", "replay.max_staleness=2", "algorithm.train_batch_groups=16"],
    ),
    "cuda_engine_gpus_equal_tp": (
        "rule_cuda_engine_gpus_equal_tp",
        ["rollout.engine.device=cuda", "rollout.engine.tp_size=2", "placement.engine_gpus=1"],
        ["placement.engine_gpus", "rollout.engine.tp_size", "rollout.engine.device", "(1)", "(2)"],
        ["rollout.engine.device=cuda", "rollout.engine.tp_size=2", "placement.engine_gpus=2"],
    ),
    "cuda_engine_needs_gpus": (
        "rule_cuda_engine_gpus_equal_tp",
        ["rollout.engine.device=cuda"],
        ["placement.engine_gpus", "rollout.engine.tp_size", "rollout.engine.device"],
        ["rollout.engine.device=cuda", "placement.engine_gpus=1"],
    ),
    "cpu_engine_no_gpus": (
        "rule_cpu_engine_has_no_gpus",
        ["rollout.engine.device=cpu", "placement.engine_gpus=1"],
        ["rollout.engine.device", "placement.engine_gpus", "rollout.engine.tp_size", "(got 1)"],
        ["rollout.engine.device=cpu", "placement.engine_gpus=0"],
    ),
    "cpu_engine_no_tp": (
        "rule_cpu_engine_has_no_gpus",
        ["rollout.engine.device=cpu", "rollout.engine.tp_size=2"],
        ["rollout.engine.device", "placement.engine_gpus", "rollout.engine.tp_size", "(got 2)"],
        ["rollout.engine.device=cpu", "rollout.engine.tp_size=1"],
    ),
    "auto_engine_gpus_zero_or_tp": (
        "rule_auto_engine_gpus_zero_or_tp",
        ["rollout.engine.device=auto", "rollout.engine.tp_size=2", "placement.engine_gpus=1"],
        ["placement.engine_gpus", "rollout.engine.tp_size", "rollout.engine.device"],
        ["rollout.engine.device=auto", "rollout.engine.tp_size=2", "placement.engine_gpus=2"],
    ),
    "auto_engine_no_gpus": (
        "rule_auto_engine_gpus_zero_or_tp",
        ["rollout.engine.device=auto", "rollout.engine.tp_size=2", "placement.engine_gpus=1"],
        ["placement.engine_gpus", "rollout.engine.tp_size", "rollout.engine.device"],
        ["rollout.engine.device=auto", "rollout.engine.tp_size=2", "placement.engine_gpus=0"],
    ),
    "every_rank_gets_a_sample": (
        "rule_every_rank_gets_a_sample",
        ["rollout.n=2", "learner.mini_batch_groups=8", "placement.learner_ranks=17"],
        ["learner.mini_batch_groups", "rollout.n", "placement.learner_ranks", "= 16", "(17)"],
        ["rollout.n=2", "learner.mini_batch_groups=8", "placement.learner_ranks=16"],
    ),
    "drain_before_weight_sync_timeout": (
        "rule_drain_ends_before_weight_sync_timeout",
        ["rollout.update_mode=drain", "rollout.drain_timeout_s=600", "weight_sync.timeout_s=600"],
        ["rollout.drain_timeout_s", "weight_sync.timeout_s", "update_mode drain"],
        ["rollout.update_mode=drain", "rollout.drain_timeout_s=599.5", "weight_sync.timeout_s=600"],
    ),
    "drain_rule_only_under_drain": (
        "rule_drain_ends_before_weight_sync_timeout",
        ["rollout.update_mode=drain", "rollout.drain_timeout_s=600", "weight_sync.timeout_s=600"],
        ["rollout.drain_timeout_s", "weight_sync.timeout_s", "update_mode drain"],
        ["rollout.update_mode=inflight", "rollout.drain_timeout_s=600", "weight_sync.timeout_s=600"],
    ),
    "partial_rollout_needs_abort": (
        "rule_partial_rollout_needs_abort",
        ["rollout.partial_rollout=true", "rollout.update_mode=inflight"],
        ["rollout.partial_rollout", "rollout.update_mode abort only", "'inflight'"],
        ["rollout.partial_rollout=true", "rollout.update_mode=abort"],
    ),
    "health_check_before_silence": (
        "rule_hung_engine_replaced_before_silence",
        ["placement.health_check_timeout_s=300", "weight_sync.timeout_s=600", "replay.silence_timeout_s=900"],
        ["placement.health_check_timeout_s", "weight_sync.timeout_s", "replay.silence_timeout_s"],
        ["placement.health_check_timeout_s=299", "weight_sync.timeout_s=600", "replay.silence_timeout_s=900"],
    ),
    "call_outlives_collective": (
        "rule_call_outlives_collective",
        ["learner.collective_timeout_s=1801", "placement.call_timeout_s=1800"],
        ["learner.collective_timeout_s (1801)", "placement.call_timeout_s (1800)"],
        ["learner.collective_timeout_s=1800", "placement.call_timeout_s=1800"],
    ),
    "call_outlives_weight_push": (
        "rule_call_outlives_weight_push",
        ["weight_sync.timeout_s=601", "placement.call_timeout_s=1800"],
        ["3 * weight_sync.timeout_s (1803)", "placement.call_timeout_s (1800)"],
        ["weight_sync.timeout_s=600", "placement.call_timeout_s=1800"],
    ),
    "ticket_outlives_request": (
        "rule_ticket_outlives_request",
        ["replay.ticket_ttl_s=600", "rollout.request_timeout_s=600"],
        ["replay.ticket_ttl_s", "rollout.request_timeout_s"],
        ["replay.ticket_ttl_s=601", "rollout.request_timeout_s=600"],
    ),
    "multi_node_run_dir_absolute": (
        "rule_multi_node_run_dir_shared",
        ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=runs/x"],
        ["logging.run_dir", "placement.nnodes", "absolute", "shared"],
        ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=/mnt/shared/x"],
    ),
    "multi_node_run_dir_not_node_local": (
        "rule_multi_node_run_dir_shared",
        ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=/tmp/x"],
        ["logging.run_dir", "placement.nnodes", "/tmp"],
        ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=/tmpfs/x"],
    ),
    "single_node_run_dir_anywhere": (
        "rule_multi_node_run_dir_shared",
        ["placement.nnodes=2", "transport.bind_host=0.0.0.0", "logging.run_dir=/tmp/x"],
        ["logging.run_dir", "placement.nnodes", "/tmp"],
        ["placement.nnodes=1", "logging.run_dir=/tmp/x"],
    ),
    "multi_node_bind_reachable": (
        "rule_multi_node_bind_reachable",
        ["placement.nnodes=2", "logging.run_dir=/mnt/shared/x", "transport.bind_host=127.0.0.1"],
        ["transport.bind_host", "placement.nnodes", "0.0.0.0"],
        ["placement.nnodes=2", "logging.run_dir=/mnt/shared/x", "transport.bind_host=10.0.0.5"],
    ),
    "multi_node_bind_not_any_loopback": (
        "rule_multi_node_bind_reachable",
        ["placement.nnodes=2", "logging.run_dir=/mnt/shared/x", "transport.bind_host=127.0.1.1"],
        ["transport.bind_host", "placement.nnodes", "0.0.0.0"],
        ["placement.nnodes=2", "logging.run_dir=/mnt/shared/x", "transport.bind_host=0.0.0.0"],
    ),
    "receive_budget_default_peers": (
        "rule_receive_budget_fits_peers",
        [f"transport.receive_budget_bytes={BUDGET_2_PEERS - 1}"],
        [f"transport.receive_budget_bytes ({BUDGET_2_PEERS - 1})", f">= {BUDGET_2_PEERS}", "transport.max_peers 2",
         "transport.max_message_bytes", "placement.max_engines"],
        [f"transport.receive_budget_bytes={BUDGET_2_PEERS}"],
    ),
    "receive_budget_engine_ceiling": (  # None peers = 2 x the most engines the run may be scaled to
        "rule_receive_budget_fits_peers",
        ["placement.max_engines=2", f"transport.receive_budget_bytes={BUDGET_4_PEERS - 1}"],
        ["transport.receive_budget_bytes", "transport.max_peers 4"],
        ["placement.max_engines=2", f"transport.receive_budget_bytes={BUDGET_4_PEERS}"],
    ),
    "engine_ceiling_holds_start": (
        "rule_engine_ceiling_holds_start",
        ["placement.num_engines=3", "placement.max_engines=2"],
        ["placement.max_engines (2)", "placement.num_engines (3)"],
        ["placement.num_engines=3", "placement.max_engines=3"],
    ),
    "receive_budget_set_peers": (
        "rule_receive_budget_fits_peers",
        ["transport.max_peers=3", f"transport.receive_budget_bytes={BUDGET_3_PEERS - 1}"],
        ["transport.receive_budget_bytes", f">= {BUDGET_3_PEERS}", "transport.max_peers 3"],
        ["transport.max_peers=3", f"transport.receive_budget_bytes={BUDGET_3_PEERS}"],
    ),
}


def _without(rule_name):
    return tuple(r for r in CROSS_FIELD_RULES if r.__name__ != rule_name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_rejects_just_past_its_boundary_naming_its_keys(case):
    rule, bad, expected, _ = CASES[case]
    with pytest.raises(ConfigError) as err:
        load_config(None, bad)
    msg = str(err.value)
    assert "\n" not in msg and not msg.startswith(("<root>", "Value error")), msg
    assert msg.startswith(expected[0]), msg
    for text in expected:
        assert text in msg, (text, msg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_loads_at_its_boundary(case):
    load_config(None, CASES[case][3])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_bad_config_breaks_only_that_rule(case, monkeypatch):
    rule, bad, _, _ = CASES[case]
    monkeypatch.setattr(root, "CROSS_FIELD_RULES", _without(rule))
    load_config(None, bad)  # without this rule, nothing else rejects it


def test_every_rule_function_is_run_and_tested():
    defined = {name for name, obj in vars(rules).items() if name.startswith("rule_") and inspect.isfunction(obj)}
    listed = [rule.__name__ for rule in CROSS_FIELD_RULES]
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == defined  # a rule_* function outside the tuple would never run
    assert {rule for rule, *_ in CASES.values()} == defined  # ... and every rule has a case above
    for rule in CROSS_FIELD_RULES:
        doc = inspect.getdoc(rule)
        assert doc and "\n" not in doc, rule.__name__  # one line saying why the rule exists


def test_config_runs_the_rules_in_the_tuples_order(monkeypatch):
    seen = []
    monkeypatch.setattr(root, "CROSS_FIELD_RULES", tuple(
        (lambda cfg, name=rule.__name__: seen.append(name)) for rule in CROSS_FIELD_RULES))
    Config()
    assert seen == [rule.__name__ for rule in CROSS_FIELD_RULES]


def test_the_first_broken_rule_is_reported():
    # Breaks rule_mini_batch_divides_train_batch and rule_ticket_outlives_request: the earlier one is named.
    with pytest.raises(ConfigError, match=r"^learner\.mini_batch_groups must divide"):
        load_config(None, ["learner.mini_batch_groups=5", "replay.ticket_ttl_s=600"])


def test_constructing_config_directly_raises_validation_error_with_the_message():
    with pytest.raises(ValidationError, match=r"replay\.ticket_ttl_s \(600\) must be > rollout\.request_timeout_s"):
        Config(replay={"ticket_ttl_s": 600}, rollout={"request_timeout_s": 600})


# ------------------------------------------------------------------ rules about one section (section validators)
SECTION_RULES = {  # overrides breaking the rule, the start of its one-line message, overrides at the boundary
    "retire_needs_dynamic_sampling": (
        ["algorithm.dynamic_sampling.retire_solved_after=1", "algorithm.dynamic_sampling.enable=false"],
        "algorithm.dynamic_sampling: algorithm.dynamic_sampling.retire_solved_after needs "
        "algorithm.dynamic_sampling.enable: true",
        ["algorithm.dynamic_sampling.retire_solved_after=0", "algorithm.dynamic_sampling.enable=false"],
    ),
    "synthetic_levels_known": (
        ["data.synthetic.levels=[1, 5]"],
        "data.synthetic: unknown level(s) [5]",
        ["data.synthetic.levels=[1, 4]"],
    ),
    "one_box_rule": (
        ["reward.strict_box_verify=true", "reward.boxed_fallback=exact"],
        "reward: reward.boxed_fallback must be 'off' with reward.strict_box_verify: true",
        ["reward.strict_box_verify=true", "reward.boxed_fallback='off'"],
    ),
    "clip_high_not_far_below_clip_low": (
        ["algorithm.clip_low=0.2", "algorithm.clip_high=0.09"],
        "algorithm: clip_high is far below clip_low",
        ["algorithm.clip_low=0.2", "algorithm.clip_high=0.1"],
    ),
}


@pytest.mark.parametrize("case", sorted(SECTION_RULES))
def test_section_rule_names_its_keys_and_loads_at_its_boundary(case):
    bad, start, ok = SECTION_RULES[case]
    with pytest.raises(ConfigError) as err:
        load_config(None, bad)
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)
    load_config(None, ok)
