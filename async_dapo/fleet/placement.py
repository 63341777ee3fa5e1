"""Place a run's actors with Ray and wire them: a placement group for the learner ranks (a bundle each,
packed) and one per rollout actor (so that an engine added or removed while the run goes on takes its
resources from Ray and gives them back), the replay-queue actor, the zmq stream, the learners' process group
and the weight-update group (async_dapo.weights.sync.WeightGroup: learner rank 0 + every serving engine's
ranks). Also the fan-out helpers the orchestrator uses, the pieces the supervisor (async_dapo.fleet.supervise)
starts, replaces and removes a rollout actor with, and an orderly shutdown by handle.

A placement the cluster can never hold (a bundle larger than every node, or more resources than all nodes
have) stops the run at once naming the fields and the cluster's resources, unless placement.autoscaling
says nodes may come; one that waits for resources says so every minute. Every wait is bounded by the
config (placement.start_timeout_s, call_timeout_s, weight_sync.timeout_s).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from async_dapo.config import Config
from async_dapo.device import dist_backend
from async_dapo.learner.rank import learner_actor_class, learner_device
from async_dapo.replay.queue import replay_actor_class
from async_dapo.rollout.actor import rollout_actor_class
from async_dapo.waits import ActorDied, RunFailed, WaitExpired, cause_of, fan_out, wait_all
from async_dapo.weights.sync import ActorCallback, WeightGroup, on_control

log = logging.getLogger("async_dapo")


def _bundle(cpus: float, gpus: int) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


REPORT_EVERY_S = 60.0  # a placement that waits for resources says so this often


def _endpoint(cfg: Config, pg, bundle: int) -> tuple[str, int]:
    """(host, free port) on the node of ``bundle`` for a TCP rendezvous (weight_sync.rendezvous_endpoint),
    before any actor runs there."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def probe(bind_host: str) -> tuple[str, int]:
        from async_dapo.weights.sync import rendezvous_endpoint

        return rendezvous_endpoint(bind_host)

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    try:
        return ray.get(probe.options(scheduling_strategy=strategy).remote(cfg.transport.bind_host),
                       timeout=cfg.placement.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitExpired(f"rendezvous endpoint on bundle {bundle}: no answer in "
                          f"{cfg.placement.start_timeout_s:.0f} s") from None


@dataclass
class Placed:
    cfg: Config
    pg: Any  # the learner ranks' placement group
    replay: Any
    engines: dict = field(default_factory=dict)  # engine rank -> rollout actor, serving (in the weight group)
    learners: list = field(default_factory=list)
    weights: WeightGroup | None = None  # the weight-update group (rebuilt when the serving engines change)
    engine_pgs: dict = field(default_factory=dict)  # engine rank -> its one-bundle placement group
    _pg_ready: dict = field(default_factory=dict)  # engine rank -> its group's ready() ref, asked once
    starting: dict = field(default_factory=dict)  # engine rank -> rollout actor not serving yet (supervise)
    joining: set = field(default_factory=set)  # engine ranks in the group whose first push has not landed
    _engine_stats_refs: tuple | None = None  # (rank -> get_stats ref, when asked): collected at the next step_stats
    _push_idle_ref: Any = None  # learner rank 0's push_idle answer, asked once and collected without waiting
    push_in_flight: tuple | None = None  # (version, when it started, {rank: engine} it went to) until waited for
    push_durations: list = field(default_factory=list)  # the last pushes' durations, as learner rank 0 measured
    _timed_push: Any = None  # the version of the last push in push_durations

    def get(self, refs, what: str, timeout_s: float | None = None):
        """ray.get bounded by placement.call_timeout_s (or ``timeout_s``); the error names what it waited for."""
        import ray

        timeout_s = self.cfg.placement.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WaitExpired(f"{what}: no answer in {timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as exc:
            raise ActorDied(f"{what}: {self.name_of(exc.actor_id)} died ({cause_of(exc)})") from None
        except ray.exceptions.RayTaskError as exc:
            log.warning("%s failed:\n%s", what, exc)
            raise RunFailed(f"{what} failed: {cause_of(exc)}") from None

    def name_of(self, actor_id: str | None) -> str:
        """The role of the actor whose hex id is ``actor_id`` ("learner rank 0", "rollout actor 2", "replay
        queue"): the stop line names what died, also for a call that went to one actor."""
        if actor_id is None:
            return "an actor"
        engines = {**self.starting, **self.engines}
        roles = [(self.replay, "replay queue")] + [(e, f"rollout actor {i}") for i, e in engines.items()]
        roles += [(r, f"learner rank {i}") for i, r in enumerate(self.learners)]
        for handle, role in roles:
            own = getattr(handle, "_actor_id", None)  # Ray's ActorID; the handle has no public accessor
            if own is not None and own.hex() == actor_id:
                return role
        return f"actor {actor_id[:12]}"

    def put(self, value):
        """``value`` in Ray's object store, once: passed to every learner rank as this reference, it is
        serialized once and each node fetches it once, instead of one pickled copy per rank."""
        import ray

        return ray.put(value)

    def on_learners(self, method: str, *args) -> list:
        refs = [getattr(r, method).remote(*args) for r in self.learners]
        return wait_all(refs, [f"learner rank {r}" for r in range(len(refs))], what=method,
                        timeout_s=self.cfg.placement.call_timeout_s)

    def serving(self) -> list:
        """The serving engines in rank order: the weight group's order (engine i holds its ranks 1 + i·tp)."""
        return [self.engines[r] for r in sorted(self.engines)]

    def ready(self) -> list:
        """The serving engines that run the current weights (not the ones whose first push is under way):
        the ones a validation may use."""
        return [self.engines[r] for r in sorted(self.engines) if r not in self.joining]

    def start_rollouts(self, which: list[int] | None = None) -> dict[int, str]:
        """Engines ``which`` (default: all) start producing; {rank: why} of the ones that failed to, or
        did not answer in placement.health_check_timeout_s (the caller replaces them or stops the run)."""
        address = self.get(self.replay.address.remote(), "replay address")
        secret = self.get(self.replay.producer_secret.remote(), "replay secret")
        ranks, bound = sorted(self.engines) if which is None else which, self.cfg.placement.health_check_timeout_s
        _, failed, late = fan_out({r: self.engines[r].start.remote(self.replay, address, secret) for r in ranks},
                                  timeout_s=bound)
        return {**failed, **{r: f"did not start producing in {bound:.0f} s (hung)" for r in late}}

    def push_weights(self, version: int) -> None:
        """Every learner rank pushes ``version`` to the serving engines; once they loaded it, rank 0 tells
        the replay queue (``set_version``: admission counts the version the engines run)."""
        if not self.engines:  # the only engine failed: its replacement is pushed to when it comes up
            return
        self._push_idle_ref = None  # an answer asked before this push would describe the previous one
        loaded = ActorCallback(self.replay, "set_version", self.cfg.weight_sync.timeout_s)
        self.on_learners("push_weights", self.serving(), loaded, version)
        self.push_in_flight = (version, time.monotonic(), dict(self.engines))

    def push_idle(self) -> bool:
        """Whether learner rank 0 has no push in flight; False until its answer came (asked once, beside
        training, and collected by a later call without waiting)."""
        import ray

        if self._push_idle_ref is None:
            self._push_idle_ref = on_control(self.learners[0], "push_idle").remote()
        if not ray.wait([self._push_idle_ref], timeout=0)[0]:
            return False
        ref, self._push_idle_ref = self._push_idle_ref, None
        try:
            return bool(ray.get(ref))  # ready: returns at once
        except Exception:  # a dead learner: wait_push says so, naming it
            return True

    def wait_push(self, meanwhile=None) -> float:
        """Wait for the previous push; RunFailed if it failed (ActorDied if learner rank 0 died).
        ``meanwhile()`` runs about once a second while it waits (the supervisor's heartbeats: an engine that
        hangs under the push is noticed and killed, which fails the push instead of waiting out its bound)."""
        import ray

        ref, bound = self.learners[0].wait_push.remote(), 3 * self.cfg.weight_sync.timeout_s
        deadline = time.monotonic() + bound
        while meanwhile is not None and time.monotonic() < deadline and not ray.wait([ref], timeout=1.0)[0]:
            meanwhile()
        try:
            return wait_all([ref], ["learner rank 0"], what="weight push",
                            timeout_s=max(0.0, deadline - time.monotonic()))[0]
        finally:
            self.push_in_flight = None

    def step_stats(self) -> tuple[dict[str, Any], dict[int, dict], float, dict[str, Any]]:
        """(queue stats, each serving engine's stats by rank, when those were asked for, learner rank 0's
        last push). The engines' counters are the ones asked for at the previous call: a busy rollout actor
        answers only after tens of ms of GIL contention, and waiting for it every step cost ~50 ms per step."""
        queue_ref, push_ref = self.replay.stats.remote(), self.learners[0].last_push.remote()
        asked, t = self._engine_stats_refs or (self._ask_engines(), time.perf_counter())
        self._engine_stats_refs = (self._ask_engines(), time.perf_counter())
        # All at once and briefly (they were asked a step ago): an engine that has not answered keeps its last
        # counters until it does; a dead or hung one is the supervisor's business, not the metrics'.
        engines = fan_out(asked, timeout_s=min(2.0, self.cfg.placement.health_check_timeout_s))[0]
        # Named as wait_push names it: learner rank 0 killed while this waits says "learner rank 0 died".
        push = wait_all([push_ref], ["learner rank 0"], what="last push",
                        timeout_s=self.cfg.placement.call_timeout_s)[0]
        if push.get("push_s") and push.get("version") != self._timed_push:
            self._timed_push = push["version"]
            self.push_durations = [*self.push_durations[-19:], push["push_s"]]
        return self.get(queue_ref, "replay stats"), engines, t, push

    def _ask_engines(self) -> dict:
        return {rank: e.get_stats.remote() for rank, e in self.engines.items()}

    def pids(self) -> dict[str, Any]:
        """Process ids of the run's actors (written to run_dir/actors.json for operators and fault tests):
        the serving engines under "rollout", the ones still starting under "starting"."""
        refs = {("rollout", str(i)): e.get_stats.remote() for i, e in sorted(self.engines.items())}
        refs |= {("learner", str(r)): a.pid.remote() for r, a in enumerate(self.learners)}
        refs[("replay", "")] = self.replay.pid.remote()
        # All at once, one bound: a dead or hung actor has no pid to report (None).
        got = fan_out(refs, timeout_s=self.cfg.placement.health_check_timeout_s)[0]
        pid = {k: (v.get("pid") if isinstance(v, dict) else v) for k, v in got.items()}
        return {"rollout": {i: pid.get(("rollout", i)) for (role, i) in refs if role == "rollout"},
                "starting": sorted(self.starting),
                "learner": {r: pid.get(("learner", r)) for (role, r) in refs if role == "learner"},
                "replay": pid.get(("replay", "")),
                "weight_group": self.weights.name if self.weights else None}

    def learner_bundle(self, rank: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)}

    def engine_group(self, rank: int):
        """The placement group of engine ``rank``: reused by its replacement, created for a new rank (it is
        not waited for here: :meth:`engine_group_ready` tells when Ray placed it)."""
        from ray.util.placement_group import placement_group

        if rank not in self.engine_pgs:
            p = self.cfg.placement
            self.engine_pgs[rank] = placement_group([_bundle(p.engine_cpus, p.engine_gpus)], strategy="PACK")
        return self.engine_pgs[rank]

    def engine_group_ready(self, rank: int) -> bool:
        """Whether Ray has placed engine ``rank``'s group (does not wait). Its ready() ref is asked for once
        and kept: a fresh one per poll would rarely have its answer back at the moment it is looked at."""
        import ray

        if rank not in self._pg_ready:
            self._pg_ready[rank] = self.engine_pgs[rank].ready()
        return bool(ray.wait([self._pg_ready[rank]], timeout=0)[0])

    def check_span(self) -> None:
        """RunFailed if the run's placement groups and the driver's node span more than placement.nnodes."""
        check_nodes(self.cfg, [self.pg, *self.engine_pgs.values()])

    def waiting_for(self, rank: int) -> str:
        """What engine ``rank``'s placement group waits for, and what the cluster has free."""
        return f"{_waiting([self.engine_pgs[rank]])}; the cluster has free {_free()}"

    def check_room(self, engines: int) -> None:
        """RunFailed (one line) if the cluster can never hold this run with ``engines`` rollout actors."""
        check_fits(self.cfg, cluster_nodes(), extra_engines=max(0, engines - self.cfg.placement.num_engines))

    def spawn_engine(self, rank: int, version: int):
        """Create rollout actor ``rank`` in its placement group (ready) at ``version``; does not wait for its
        engine (``get_stats`` answers once it is up)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.engine_group(rank), placement_group_bundle_index=0)
        return rollout_actor_class(self.cfg, scheduling_strategy=strategy).remote(self.cfg, rank, version)

    def remove_engine_group(self, rank: int) -> None:
        """Give engine ``rank``'s resources back to Ray (it was removed)."""
        from ray.util.placement_group import remove_placement_group

        pg = self.engine_pgs.pop(rank, None)
        self._pg_ready.pop(rank, None)
        if pg is not None:
            remove_placement_group(pg)

    def rebuild_weight_group(self, engines: dict | None = None, bound: float | None = None) -> None:
        """A new weight group with ``engines`` (rank -> actor; default: the serving ones), each step bounded by
        ``bound`` (default placement.health_check_timeout_s)."""
        engines = self.engines if engines is None else engines
        self.weights.rebuild(self.learners[0], dict(sorted(engines.items())), bound)

    def shutdown(self) -> None:
        """End what this run started, by handle: engines (SGLang processes), learners, queue, the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        engines = [*self.engines.values(), *self.starting.values()]
        for actors, method in ((engines, "shutdown"), (self.learners, "shutdown"), ([self.replay], "close")):
            actors = [a for a in actors if a is not None]
            try:  # bounded: a hung actor is killed below anyway
                ray.get([getattr(a, method).remote() for a in actors], timeout=60)
            except Exception as exc:  # a crashed actor must not stop the others from being ended
                log.warning("shutdown: %s failed: %r", method, exc)
            for a in actors:
                ray.kill(a)
        for pg in [self.pg, *self.engine_pgs.values()]:
            remove_placement_group(pg)


def connect_ray(cfg: Config) -> threading.Event:
    """``ray.init`` (join ``placement.ray_address`` or the job's cluster, else start a local one), bounded by
    placement.start_timeout_s: ray.init has no timeout of its own, and an unreachable address retries
    forever. It runs on a helper thread that is then PARKED until the returned event is set (after
    ``ray.shutdown``): a local Ray's processes are started with a parent-death signal tied to the thread that
    started them, so letting that thread end kills the cluster (measured: the GCS went away 60 s later)."""
    import ray

    started, park, box = threading.Event(), threading.Event(), {}

    def run() -> None:
        try:
            ray.init(address=cfg.placement.ray_address, include_dashboard=False, log_to_driver=False)
        except BaseException as exc:  # handed to the caller's thread
            box["exc"] = exc
        started.set()
        park.wait()  # parked on purpose until shutdown sets it (see the docstring): not a wait on anything

    threading.Thread(target=run, name="ray-init", daemon=True).start()
    timeout = cfg.placement.start_timeout_s
    if not started.wait(timeout):
        raise WaitExpired(f"ray.init(address={cfg.placement.ray_address!r}): not connected in {timeout:.0f} s "
                          "(placement.start_timeout_s)")
    if "exc" in box:
        park.set()
        raise box["exc"]
    return park


def place(cfg: Config, initial_version: int = 0) -> Placed:
    """Create and wire every actor of a run; returns when all are ready (or raises naming what is not,
    after placement.start_timeout_s)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    p = cfg.placement
    n_eng, n_lrn = p.num_engines, p.learner_ranks
    check_fits(cfg, cluster_nodes())
    # Created first: a placement group waits forever for CPUs that fractional-CPU actors already hold. The
    # learners' first: packed, they want whole nodes, which single-bundle engine groups would fragment.
    placed = Placed(cfg, placement_group([_bundle(p.learner_cpus, p.learner_gpus)] * n_lrn, strategy="PACK"), None)
    for rank in range(n_eng):
        placed.engine_group(rank)
    wait_placed(cfg, [placed.pg, *placed.engine_pgs.values()])
    placed.check_span()
    # On the driver's node, explicitly: it binds transport.bind_host there, and the driver talks to it
    # every step (a CPU-only head node is the usual place for both).
    placed.replay = replay_actor_class(cfg, scheduling_strategy=NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)).remote(cfg, initial_version)
    placed.engines = {rank: placed.spawn_engine(rank, initial_version) for rank in range(n_eng)}
    host, port = _endpoint(cfg, placed.pg, 0)
    placed.learners = [learner_actor_class(cfg, **placed.learner_bundle(r)).remote(cfg, r, n_lrn, host, port)
                       for r in range(n_lrn)]
    placed.get([e.get_stats.remote() for e in placed.serving()] + [r.ready.remote() for r in placed.learners],
               f"start of {n_eng} engine(s) and {n_lrn} learner rank(s)", p.start_timeout_s)
    placed.weights = WeightGroup(cfg, dist_backend(learner_device(cfg), cfg.weight_sync.backend), placed.get,
                                 lambda: placed.get(on_control(placed.learners[0], "weight_group_endpoint").remote(),
                                                    "weight-group endpoint on learner rank 0"))
    placed.weights.open(placed.learners[0], dict(sorted(placed.engines.items())))
    log.info("placed %d engine(s) and %d learner rank(s)", n_eng, n_lrn)
    return placed


def cluster_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources (CPU, GPU, ...), as Ray reports them."""
    import ray

    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def _demand(cfg: Config) -> list[tuple[str, dict[str, float], int]]:
    """(what, one bundle, how many) of a run: the fields that ask for each."""
    p = cfg.placement
    return [(f"placement.num_engines={p.num_engines} x (placement.engine_cpus={p.engine_cpus:g}, "
             f"placement.engine_gpus={p.engine_gpus})", _bundle(p.engine_cpus, p.engine_gpus), p.num_engines),
            (f"placement.learner_ranks={p.learner_ranks} x (placement.learner_cpus={p.learner_cpus:g}, "
             f"placement.learner_gpus={p.learner_gpus})", _bundle(p.learner_cpus, p.learner_gpus), p.learner_ranks),
            (f"placement.queue_cpus={p.queue_cpus:g}", {"CPU": p.queue_cpus}, 1)]


def check_fits(cfg: Config, nodes: list[dict[str, float]], extra_engines: int = 0) -> None:
    """RunFailed, in one line, when the cluster's nodes can never hold the run (plus ``extra_engines`` more
    engines): a bundle no node is large enough for, or more CPUs or GPUs than all nodes have together. With
    placement.autoscaling a larger placement may still come true (nodes are added), so it is not refused."""
    if cfg.placement.autoscaling:
        return
    demand = _demand(cfg)
    if extra_engines:
        demand[0] = (f"{demand[0][0]} + {extra_engines} more engine(s)", demand[0][1], demand[0][2] + extra_engines)
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in ("CPU", "GPU")}
    need = {k: sum(b.get(k, 0.0) * n for _, b, n in demand) for k in ("CPU", "GPU")}
    short = [k for k in need if need[k] > have[k] + 1e-9]
    too_big = [what for what, b, n in demand if n and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in b.items())
                                                              for node in nodes)]
    if not short and not too_big:
        return
    why = (f"needs {need['CPU']:g} CPU and {need['GPU']:g} GPU" if short else
           f"has a bundle no node can hold ({'; '.join(too_big)})")
    raise RunFailed(f"the placement cannot be held: it {why} ({'; '.join(w for w, _, _ in demand)}) but the cluster "
                    f"has {have['CPU']:g} CPU and {have['GPU']:g} GPU on {len(nodes)} node(s) "
                    f"(largest node {_largest(nodes)}); lower those fields, add nodes, or set placement.autoscaling "
                    "if an autoscaler adds them")


def _largest(nodes: list[dict[str, float]]) -> str:
    if not nodes:
        return "none"
    big = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)))
    return f"{big.get('CPU', 0.0):g} CPU, {big.get('GPU', 0.0):g} GPU"


def wait_placed(cfg: Config, pgs: list) -> None:
    """Wait until every group in ``pgs`` is placed, at most placement.start_timeout_s, saying every minute
    which bundles still wait and what the cluster has free."""
    import ray

    timeout = cfg.placement.start_timeout_s
    deadline = time.monotonic() + timeout
    pending = {pg.ready(): pg for pg in pgs}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitExpired(f"placement: {_waiting(pending.values())} not placed in {timeout:.0f} s "
                              f"(placement.start_timeout_s); the cluster has free {_free()}")
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(REPORT_EVERY_S, left))
        for ref in ready:
            pending.pop(ref)
        if pending and left > REPORT_EVERY_S:  # a whole minute without every group placed
            log.warning("placement: waiting for resources: %s; the cluster has free %s (placement.start_timeout_s "
                        "%.0f s, %.0f s left)", _waiting(pending.values()), _free(), timeout, left - REPORT_EVERY_S)


def _waiting(pgs) -> str:
    bundles = [b for pg in pgs for b in pg.bundle_specs]
    return f"{len(bundles)} bundle(s) {bundles}"


def _free() -> str:
    import ray

    free = ray.available_resources()
    return f"{free.get('CPU', 0.0):g} CPU, {free.get('GPU', 0.0):g} GPU"


def check_nodes(cfg: Config, pgs: list) -> None:
    """RunFailed, in one line, when the placement spans more nodes than placement.nnodes says: the load-time
    multi-node rules (shared run_dir, a reachable bind address) were checked for that number."""
    import ray
    from ray.util.placement_group import placement_group_table

    nodes = {n for pg in pgs for n in placement_group_table(pg).get("bundles_to_node_id", {}).values() if n}
    nodes.add(ray.get_runtime_context().get_node_id())  # the replay queue's node: pinned to the driver's
    if len(nodes) > cfg.placement.nnodes:
        raise RunFailed(f"the placement spans {len(nodes)} nodes (the driver's included) but placement.nnodes is "
                        f"{cfg.placement.nnodes}: set placement.nnodes (a multi-node run also needs an absolute "
                        "logging.run_dir on shared storage and transport.bind_host set to an interface of the "
                        "driver's node that other nodes reach, e.g. 0.0.0.0)")
