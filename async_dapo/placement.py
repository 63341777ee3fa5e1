"""Place a run's actors with Ray and wire them: one placement group (a bundle per engine and per learner
rank, CPU or GPU from the config), the replay-queue actor, the zmq stream, the learners' process group and
the weight-update group (async_dapo.weight_sync.WeightGroup: learner rank 0 + every engine rank). Also the
fan-out helpers the orchestrator uses, the pieces the supervisor (async_dapo.supervise) replaces a rollout
actor with, and an orderly shutdown by handle. Every wait is bounded by the config
(placement.start_timeout_s, call_timeout_s, weight_sync.timeout_s).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from async_dapo.config import Config
from async_dapo.device import dist_backend
from async_dapo.learner import learner_actor_class, learner_device
from async_dapo.replay_queue import replay_actor_class
from async_dapo.rollout import rollout_actor_class
from async_dapo.supervise import ActorDied, RunFailed, WaitExpired, cause_of, wait_all
from async_dapo.weight_sync import ActorCallback, WeightGroup

log = logging.getLogger("async_dapo")


def _bundle(cpus: float, gpus: int) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _endpoint(cfg: Config, pg, bundle: int) -> tuple[str, int]:
    """(host, free port) on the node of ``bundle`` for a TCP rendezvous. Loopback unless the config binds
    another interface (multi-node runs set transport.bind_host)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    loopback = cfg.transport.bind_host in ("127.0.0.1", "localhost", "::1")

    @ray.remote(num_cpus=0)
    def probe() -> tuple[str, int]:
        from async_dapo.weight_sync import free_port

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return host, free_port(host)

    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    try:
        return ray.get(probe.options(scheduling_strategy=strategy).remote(), timeout=cfg.placement.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitExpired(f"rendezvous endpoint on bundle {bundle}: no answer in "
                          f"{cfg.placement.start_timeout_s:.0f} s") from None


@dataclass
class Placed:
    cfg: Config
    pg: Any
    replay: Any
    engines: list = field(default_factory=list)
    learners: list = field(default_factory=list)
    weights: WeightGroup | None = None  # the weight-update group (rebuilt when an engine is replaced)
    _engine_stats_refs: tuple | None = None  # (get_stats refs, when asked): collected at the next step_stats

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
        roles = [(self.replay, "replay queue")] + [(e, f"rollout actor {i}") for i, e in enumerate(self.engines)]
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

    def start_rollouts(self, which: list[int] | None = None) -> None:
        address = self.get(self.replay.address.remote(), "replay address")
        secret = self.get(self.replay.producer_secret.remote(), "replay secret")
        engines = [self.engines[i] for i in (range(len(self.engines)) if which is None else which)]
        self.get([e.start.remote(self.replay, address, secret) for e in engines], "start rollouts")

    def push_weights(self, version: int) -> None:
        """Every learner rank pushes ``version``; once the engines loaded it, rank 0 tells the replay queue
        (``set_version``: admission counts the version the engines run)."""
        loaded = ActorCallback(self.replay, "set_version", self.cfg.weight_sync.timeout_s)
        self.on_learners("push_weights", self.engines, loaded, version)

    def wait_push(self) -> float:
        """Wait for the previous push; RunFailed if it failed (ActorDied if learner rank 0 died)."""
        return wait_all([self.learners[0].wait_push.remote()], ["learner rank 0"], what="weight push",
                        timeout_s=3 * self.cfg.weight_sync.timeout_s)[0]

    def step_stats(self) -> tuple[dict[str, Any], dict[str, float], dict[str, Any]]:
        """(queue stats, summed rollout stats, learner rank 0's last push). The engines' counters are the
        ones asked for at the previous call (``roll["t"]`` says when): a busy rollout actor answers only
        after tens of ms of GIL contention, and waiting for it every step cost ~50 ms per step."""
        import ray

        queue_ref, push_ref = self.replay.stats.remote(), self.learners[0].last_push.remote()
        asked, t = self._engine_stats_refs or (self._ask_engines(), time.perf_counter())
        self._engine_stats_refs = (self._ask_engines(), time.perf_counter())
        stats = []
        for ref in asked:  # a dead engine is the supervisor's business, not the metrics'
            try:
                stats.append(ray.get(ref, timeout=self.cfg.placement.health_check_timeout_s))
            except Exception:
                continue
        roll = {"gen_tokens": sum(s["gen_tokens"] for s in stats), "t": t,
                "idle_seconds": sum(s["idle_seconds"] for s in stats), "engines": max(len(stats), 1)}
        # Named as wait_push names it: learner rank 0 killed while this waits says "learner rank 0 died".
        push = wait_all([push_ref], ["learner rank 0"], what="last push",
                        timeout_s=self.cfg.placement.call_timeout_s)[0]
        return self.get(queue_ref, "replay stats"), roll, push

    def _ask_engines(self) -> list:
        return [e.get_stats.remote() for e in self.engines]

    def pids(self) -> dict[str, Any]:
        """Process ids of the run's actors (written to run_dir/actors.json for operators and fault tests)."""
        import ray

        def pid(ref) -> int | None:
            try:
                return ray.get(ref, timeout=self.cfg.placement.health_check_timeout_s)
            except Exception:  # a dead actor has no pid to report
                return None

        engines = {str(i): (pid(e.get_stats.remote()) or {}) for i, e in enumerate(self.engines)}
        return {"rollout": {i: s.get("pid") if isinstance(s, dict) else None for i, s in engines.items()},
                "learner": {str(r): pid(a.pid.remote()) for r, a in enumerate(self.learners)},
                "replay": pid(self.replay.pid.remote()),
                "weight_group": self.weights.name if self.weights else None}

    def bundle(self, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)}

    def new_engine(self, index: int, version: int):
        """Start rollout actor ``index`` (in its own bundle) at ``version`` and wait until its engine is up."""
        engine = rollout_actor_class(self.cfg, **self.bundle(index)).remote(self.cfg, index, version)
        self.get(engine.get_stats.remote(), f"start of rollout actor {index}", self.cfg.placement.start_timeout_s)
        return engine

    def rebuild_weight_group(self) -> None:
        self.weights.rebuild(self.learners[0], self.engines)

    def shutdown(self) -> None:
        """End what this run started, by handle: engines (SGLang processes), learners, queue, the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actors, method in ((self.engines, "shutdown"), (self.learners, "shutdown"), ([self.replay], "close")):
            actors = [a for a in actors if a is not None]
            try:  # bounded: a hung actor is killed below anyway
                ray.get([getattr(a, method).remote() for a in actors], timeout=60)
            except Exception as exc:  # a crashed actor must not stop the others from being ended
                log.warning("shutdown: %s failed: %r", method, exc)
            for a in actors:
                ray.kill(a)
        remove_placement_group(self.pg)


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
    bundles = [_bundle(p.engine_cpus, p.engine_gpus)] * n_eng + [_bundle(p.learner_cpus, p.learner_gpus)] * n_lrn
    # Created first: a placement group waits forever for CPUs that fractional-CPU actors already hold.
    pg = placement_group(bundles, strategy="PACK")
    placed = Placed(cfg, pg, None)
    placed.get(pg.ready(), f"placement group {bundles}", p.start_timeout_s)
    check_nodes(cfg, pg)
    # On the driver's node, explicitly: it binds transport.bind_host there, and the driver talks to it
    # every step (a CPU-only head node is the usual place for both).
    placed.replay = replay_actor_class(cfg, scheduling_strategy=NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)).remote(cfg, initial_version)
    placed.engines = [rollout_actor_class(cfg, **placed.bundle(i)).remote(cfg, i, initial_version)
                      for i in range(n_eng)]
    host, port = _endpoint(cfg, pg, n_eng)
    placed.learners = [learner_actor_class(cfg, **placed.bundle(n_eng + r)).remote(cfg, r, n_lrn, host, port)
                       for r in range(n_lrn)]
    placed.get([e.get_stats.remote() for e in placed.engines] + [r.ready.remote() for r in placed.learners],
               f"start of {n_eng} engine(s) and {n_lrn} learner rank(s)", p.start_timeout_s)
    placed.weights = WeightGroup(cfg, dist_backend(learner_device(cfg), cfg.weight_sync.backend), placed.get,
                                 lambda: _endpoint(cfg, pg, n_eng))
    placed.weights.open(placed.learners[0], placed.engines)
    log.info("placed %d engine(s) and %d learner rank(s)", n_eng, n_lrn)
    return placed


def check_nodes(cfg: Config, pg) -> None:
    """RunFailed, in one line, when the placement spans more nodes than placement.nnodes says: the load-time
    multi-node rules (shared run_dir, a reachable bind address) were checked for that number."""
    from ray.util.placement_group import placement_group_table

    nodes = {n for n in placement_group_table(pg).get("bundles_to_node_id", {}).values() if n}
    if len(nodes) > cfg.placement.nnodes:
        raise RunFailed(f"the placement spans {len(nodes)} nodes but placement.nnodes is {cfg.placement.nnodes}: "
                        "set placement.nnodes (a multi-node run also needs an absolute logging.run_dir on shared "
                        "storage and transport.bind_host set to this node's interface, e.g. 0.0.0.0)")
