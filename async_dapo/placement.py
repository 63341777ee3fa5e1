"""Place a run's actors with Ray and wire them: one placement group (a bundle per engine and per learner
rank, CPU or GPU from the config), the replay-queue actor, the zmq stream, the learners' process group and
the weight-update group (learner rank 0 + every engine rank). Also the fan-out helpers the orchestrator
uses, and an orderly shutdown by handle.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from async_dapo.config import Config
from async_dapo.device import dist_backend
from async_dapo.learner import WEIGHT_GROUP, learner_actor_class, learner_device
from async_dapo.replay_service import replay_actor_class
from async_dapo.rollout import rollout_actor_class

log = logging.getLogger("async_dapo")
READY_TIMEOUT_S = 900  # engine start is 20-60 s on a small CPU box, minutes for big models


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
    return ray.get(probe.options(scheduling_strategy=strategy).remote())


@dataclass
class Placed:
    cfg: Config
    pg: Any
    replay: Any
    engines: list = field(default_factory=list)
    learners: list = field(default_factory=list)

    def on_learners(self, method: str, *args) -> list:
        import ray

        return ray.get([getattr(r, method).remote(*args) for r in self.learners])

    def start_rollouts(self) -> None:
        import ray

        address = ray.get(self.replay.address.remote())
        ray.get([e.start.remote(self.replay, address) for e in self.engines])

    def push_weights(self, version: int) -> None:
        self.on_learners("push_weights", self.engines, self.replay, version)

    def wait_push(self) -> float:
        import ray

        return ray.get(self.learners[0].wait_push.remote())

    def last_push(self) -> dict[str, Any]:
        import ray

        return ray.get(self.learners[0].last_push.remote())

    def rollout_stats(self) -> dict[str, float]:
        import ray

        stats = ray.get([e.get_stats.remote() for e in self.engines])
        return {"gen_tokens": sum(s["gen_tokens"] for s in stats),
                "idle_seconds": sum(s["idle_seconds"] for s in stats), "engines": len(stats)}

    def shutdown(self) -> None:
        """End what this run started, by handle: engines (SGLang processes), learners, queue, the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actors, method in ((self.engines, "shutdown"), (self.learners, "shutdown"), ([self.replay], "close")):
            refs = [getattr(a, method).remote() for a in actors]
            try:
                ray.get(refs, timeout=120)
            except Exception as exc:  # a crashed actor must not stop the others from being ended
                log.warning("shutdown: %s failed: %r", method, exc)
            for a in actors:
                ray.kill(a)
        remove_placement_group(self.pg)


def place(cfg: Config, initial_version: int = 0) -> Placed:
    """Create and wire every actor of a run; returns when all are ready."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    p = cfg.placement
    n_eng, n_lrn = p.num_engines, p.learner_ranks
    bundles = [_bundle(p.engine_cpus, p.engine_gpus)] * n_eng + [_bundle(p.learner_cpus, p.learner_gpus)] * n_lrn
    # Created first: a placement group waits forever for CPUs that fractional-CPU actors already hold.
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    placed = Placed(cfg, pg, replay_actor_class(cfg).remote(cfg, initial_version))

    def at(i: int) -> dict[str, Any]:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}

    placed.engines = [rollout_actor_class(cfg, **at(i)).remote(cfg, i, initial_version) for i in range(n_eng)]
    host, port = _endpoint(cfg, pg, n_eng)
    placed.learners = [learner_actor_class(cfg, **at(n_eng + r)).remote(cfg, r, n_lrn, host, port)
                       for r in range(n_lrn)]
    ray.get([e.get_stats.remote() for e in placed.engines] + [r.ready.remote() for r in placed.learners],
            timeout=READY_TIMEOUT_S)
    _join_weight_group(placed, *_endpoint(cfg, pg, n_eng))
    log.info("placed %d engine(s) and %d learner rank(s)", n_eng, n_lrn)
    return placed


def _join_weight_group(placed: Placed, host: str, port: int) -> None:
    import ray

    cfg = placed.cfg
    tp = cfg.rollout.engine.tp_size
    world = 1 + tp * len(placed.engines)
    backend = dist_backend(learner_device(cfg), cfg.weight_sync.backend)
    joins = [e.join_weight_group.remote(host, port, world, 1 + i * tp, WEIGHT_GROUP, backend)
             for i, e in enumerate(placed.engines)]
    ray.get(placed.learners[0].open_weight_group.remote(host, port, world))
    ray.get(joins, timeout=cfg.weight_sync.timeout_s)
