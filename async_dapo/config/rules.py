"""The cross-field rules: each takes the whole Config and raises one line naming the dotted keys it is
about. Config runs CROSS_FIELD_RULES in their order when it loads; a rule about one section only stays a
validator on that section."""

from __future__ import annotations

from typing import Any, TYPE_CHECKING

from async_dapo.config.transport import (
    receive_budget, receive_hard_cap, receive_hwm, receive_max_peers, receive_min_budget,
)

if TYPE_CHECKING:
    from async_dapo.config.root import Config


NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def engine_ceiling(cfg: "Config") -> int:
    """The most rollout actors the run may have at once: placement.max_engines, else num_engines."""
    return cfg.placement.max_engines or cfg.placement.num_engines


# A rule raises ValueError whose one-line message names the dotted keys it is about (pydantic reports these
# at the root, so the message carries the keys itself). Every function named rule_* must be listed in
# CROSS_FIELD_RULES (a test checks it).


def rule_mini_batch_divides_train_batch(cfg: Config) -> None:
    """A training step is split into whole mini-batches; a remainder of groups would fit no update."""
    if cfg.algorithm.train_batch_groups % cfg.learner.mini_batch_groups:
        raise ValueError(
            "learner.mini_batch_groups must divide algorithm.train_batch_groups "
            f"({cfg.learner.mini_batch_groups} vs {cfg.algorithm.train_batch_groups})"
        )


def rule_overlong_buffer_fits_response(cfg: Config) -> None:
    """The overlong penalty ramps over the last overlong_buffer_length tokens before L_max: it must fit."""
    if cfg.reward.overlong_buffer_enable and cfg.reward.overlong_buffer_length > cfg.rollout.max_response_length:
        raise ValueError("reward.overlong_buffer_length must be <= rollout.max_response_length")


def rule_context_fits_prompt_and_response(cfg: Config) -> None:
    """The engine's context must hold the longest prompt followed by the longest response."""
    ctx = cfg.rollout.engine.context_length
    if ctx is not None and ctx < cfg.data.max_prompt_length + cfg.rollout.max_response_length:
        raise ValueError(
            "rollout.engine.context_length must be >= data.max_prompt_length + rollout.max_response_length"
        )


def rule_sft_target_level_is_configured(cfg: Config) -> None:
    """The warm start checks its target on that level's training problems, so the task must have them."""
    tc, levels = cfg.model.bootstrap, cfg.data.synthetic.levels
    if tc is not None and tc.sft_target_level is not None and tc.sft_target_level not in levels:
        raise ValueError(
            f"model.bootstrap.sft_target_level ({tc.sft_target_level}) must be one of data.synthetic.levels {levels}"
        )


def rule_weight_sync_within_staleness(cfg: Config) -> None:
    """Engines must get new weights before their groups go stale, or admission and hand-out deadlock."""
    ws, rp = cfg.weight_sync, cfg.replay
    if ws.every_k_steps > rp.max_staleness + 1:
        raise ValueError(
            f"weight_sync.every_k_steps ({ws.every_k_steps}) must be <= replay.max_staleness + 1 "
            f"({rp.max_staleness + 1}): groups would be stale before the engines get new weights "
            "(admission counts the engines' version, hand-out judges staleness at the learner's: deadlock)"
        )


def rule_dynamic_sampling_needs_groups(cfg: Config) -> None:
    """A group of one sample is never mixed, so dynamic sampling would drop every group."""
    if cfg.algorithm.dynamic_sampling.enable and cfg.rollout.n < 2:
        raise ValueError(
            f"rollout.n ({cfg.rollout.n}) must be >= 2 when algorithm.dynamic_sampling.enable: a group of one is "
            "never mixed, so dynamic sampling would drop every group"
        )


def rule_capacity_holds_staleness_window(cfg: Config) -> None:
    """The queue must hold every group that may still be trained: max_staleness + 1 batches of them."""
    rp, batch = cfg.replay, cfg.algorithm.train_batch_groups
    need = (rp.max_staleness + 1) * batch
    if rp.capacity_groups < need:
        raise ValueError(
            f"replay.capacity_groups ({rp.capacity_groups}) must be >= (replay.max_staleness + 1) * "
            f"algorithm.train_batch_groups = ({rp.max_staleness} + 1) * {batch} = {need}"
        )


def rule_cuda_engine_gpus_equal_tp(cfg: Config) -> None:
    """A cuda engine's actor holds one GPU per tensor-parallel rank of the engine."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "cuda" and pl.engine_gpus != eng.tp_size:
        raise ValueError(
            f"placement.engine_gpus ({pl.engine_gpus}) must equal rollout.engine.tp_size ({eng.tp_size}) "
            "when rollout.engine.device is cuda"
        )


def rule_cpu_engine_has_no_gpus(cfg: Config) -> None:
    """A cpu engine uses no GPU and has no tensor parallelism."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "cpu" and (pl.engine_gpus != 0 or eng.tp_size != 1):
        raise ValueError(
            f"rollout.engine.device cpu needs placement.engine_gpus = 0 (got {pl.engine_gpus}) and "
            f"rollout.engine.tp_size = 1 (got {eng.tp_size})"
        )


def rule_auto_engine_gpus_zero_or_tp(cfg: Config) -> None:
    """An auto engine becomes a cpu engine (no GPU) or a cuda engine (tp_size GPUs)."""
    eng, pl = cfg.rollout.engine, cfg.placement
    if eng.device == "auto" and pl.engine_gpus not in (0, eng.tp_size):
        raise ValueError(
            f"placement.engine_gpus ({pl.engine_gpus}) must be 0 or rollout.engine.tp_size "
            f"({eng.tp_size}) when rollout.engine.device is auto"
        )


def rule_every_rank_gets_a_sample(cfg: Config) -> None:
    """Every learner rank needs at least one sample of each mini-batch."""
    mini, n, ranks = cfg.learner.mini_batch_groups, cfg.rollout.n, cfg.placement.learner_ranks
    if mini * n < ranks:
        raise ValueError(
            f"learner.mini_batch_groups * rollout.n ({mini} * {n} = {mini * n}) must be >= placement.learner_ranks "
            f"({ranks}): every rank needs at least one sample of each mini-batch"
        )


def rule_drain_ends_before_weight_sync_timeout(cfg: Config) -> None:
    """The learner's side of the weight group must not time out while an engine still drains."""
    ro, ws = cfg.rollout, cfg.weight_sync
    if ro.update_mode == "drain" and ro.drain_timeout_s >= ws.timeout_s:
        raise ValueError(
            f"rollout.drain_timeout_s ({ro.drain_timeout_s:g}) must be < weight_sync.timeout_s "
            f"({ws.timeout_s:g}) with rollout.update_mode drain: the learner's side of the weight group "
            "would time out while the engine still drains"
        )


def rule_partial_rollout_needs_abort(cfg: Config) -> None:
    """Only an abort-mode update cuts samples short: in-flight and drain updates keep every token already."""
    ro = cfg.rollout
    if ro.partial_rollout and ro.update_mode != "abort":
        raise ValueError(f"rollout.partial_rollout applies to rollout.update_mode abort only (it is "
                         f"{ro.update_mode!r}: its updates keep every generated token already)")


def rule_hung_engine_replaced_before_silence(cfg: Config) -> None:
    """A hung engine must be replaced before the learner gives up waiting for groups."""
    pl, ws, rp = cfg.placement, cfg.weight_sync, cfg.replay
    if pl.health_check_timeout_s + ws.timeout_s >= rp.silence_timeout_s:
        raise ValueError(
            f"placement.health_check_timeout_s + weight_sync.timeout_s ({pl.health_check_timeout_s:g} + "
            f"{ws.timeout_s:g}) must be < replay.silence_timeout_s ({rp.silence_timeout_s:g}): a hung "
            "engine (stuck in a request or in a weight update) must be replaced before the learner gives "
            "up waiting"
        )


def _call_outlives(cfg: Config, key: str, value: float) -> None:
    """Shared by the two call_timeout_s rules: ``key`` (= ``value`` seconds) must fit in one learner call."""
    if value > cfg.placement.call_timeout_s:
        raise ValueError(
            f"{key} ({value:g}) must be <= placement.call_timeout_s ({cfg.placement.call_timeout_s:g}): a call "
            "must outlive the collectives it waits on, so their own error surfaces"
        )


def rule_call_outlives_collective(cfg: Config) -> None:
    """A learner call must outlive the collectives it waits on, so their own timeout error surfaces."""
    _call_outlives(cfg, "learner.collective_timeout_s", cfg.learner.collective_timeout_s)


def rule_call_outlives_weight_push(cfg: Config) -> None:
    """A push call on rank 0 may join the previous push (2 x weight_sync.timeout_s), then broadcast (1 x)."""
    _call_outlives(cfg, "3 * weight_sync.timeout_s", 3 * cfg.weight_sync.timeout_s)


def rule_ticket_outlives_request(cfg: Config) -> None:
    """A ticket must not expire while its group's first engine request may still run."""
    rp, ro = cfg.replay, cfg.rollout
    if rp.ticket_ttl_s <= ro.request_timeout_s:
        raise ValueError(
            f"replay.ticket_ttl_s ({rp.ticket_ttl_s:g}) must be > rollout.request_timeout_s "
            f"({ro.request_timeout_s:g}): a ticket must not expire while its first request may still run (a "
            "group that still arrives after its ticket expired is dropped and counted, never trained twice)"
        )


def rule_multi_node_run_dir_shared(cfg: Config) -> None:
    """Every rank writes its checkpoint shards under run_dir, so on several nodes it must be shared storage."""
    run_dir, nnodes = cfg.logging.run_dir, cfg.placement.nnodes
    if nnodes > 1 and (not run_dir.is_absolute() or any(run_dir.is_relative_to(d) for d in NODE_LOCAL_DIRS)):
        raise ValueError(
            f"logging.run_dir ({run_dir}) must be an absolute path on storage shared by all {nnodes} nodes "
            f"(placement.nnodes > 1), not relative or under {', '.join(NODE_LOCAL_DIRS)}"
        )


def rule_multi_node_bind_reachable(cfg: Config) -> None:
    """Rollout actors on other nodes connect to the replay queue's bind address."""
    import ipaddress

    # Any loopback address, not only the LOOPBACK_HOSTS spellings: all of 127.0.0.0/8 (e.g. the 127.0.1.1 that
    # Debian's /etc/hosts gives the host name) and ::1 however written.
    host = cfg.transport.bind_host
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        loopback = (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
    except ValueError:  # a host name
        loopback = host.lower() in LOOPBACK_HOSTS
    if cfg.placement.nnodes > 1 and loopback:
        raise ValueError(
            f"transport.bind_host ({host}) must be an interface other nodes reach (e.g. 0.0.0.0 or the address of "
            "the driver's node, where the replay queue runs) when placement.nnodes > 1"
        )


def rule_receive_budget_fits_peers(cfg: Config) -> None:
    """The receiver's zmq buffers must hold, per admitted peer, one queued message plus its extras."""
    t = cfg.transport
    peers, cap = receive_max_peers(t.max_peers, engine_ceiling(cfg)), receive_hard_cap(t.max_message_bytes)
    if t.receive_budget_bytes is not None and receive_hwm(t.receive_budget_bytes, peers, cap) < 1:
        raise ValueError(
            f"transport.receive_budget_bytes ({t.receive_budget_bytes}) must be >= {receive_min_budget(peers, cap)} "
            f"= (4 x transport.max_peers {peers} + 1) x hard cap {cap} (from transport.max_message_bytes "
            f"{t.max_message_bytes}; max_peers None = 2 x placement.max_engines): per admitted peer one queued "
            "message, one being decoded and its handshake properties"
        )


def rule_engine_ceiling_holds_start(cfg: Config) -> None:
    """A run cannot start with more engines than it may ever have."""
    pl = cfg.placement
    if pl.max_engines is not None and pl.max_engines < pl.num_engines:
        raise ValueError(f"placement.max_engines ({pl.max_engines}) must be >= placement.num_engines "
                         f"({pl.num_engines})")


# The order is the order the rules are checked in (the first broken one is reported): the data flow of the
# sections, then the timeouts from the innermost out, then the multi-node and transport rules.
CROSS_FIELD_RULES = (
    rule_mini_batch_divides_train_batch,
    rule_overlong_buffer_fits_response,
    rule_context_fits_prompt_and_response,
    rule_sft_target_level_is_configured,
    rule_weight_sync_within_staleness,
    rule_dynamic_sampling_needs_groups,
    rule_capacity_holds_staleness_window,
    rule_cuda_engine_gpus_equal_tp,
    rule_cpu_engine_has_no_gpus,
    rule_auto_engine_gpus_zero_or_tp,
    rule_every_rank_gets_a_sample,
    rule_drain_ends_before_weight_sync_timeout,
    rule_partial_rollout_needs_abort,
    rule_hung_engine_replaced_before_silence,
    rule_call_outlives_collective,
    rule_call_outlives_weight_push,
    rule_ticket_outlives_request,
    rule_multi_node_run_dir_shared,
    rule_multi_node_bind_reachable,
    rule_engine_ceiling_holds_start,
    rule_receive_budget_fits_peers,
)
