"""placement: where Ray places every actor, and the fleet's supervision bounds."""

from __future__ import annotations

from pydantic import Field

from async_dapo.config.section import Section


class PlacementConfig(Section):
    """How Ray places the actors."""

    ray_address: str | None = Field(
        None, description="Ray cluster address; None = join the job's cluster or start a local one."
    )
    nnodes: int = Field(
        1, ge=1, description="verl's trainer.nnodes: the nodes the run spans. With more than one, the config "
        "must name an absolute logging.run_dir on storage every node shares and a transport.bind_host other "
        "nodes can reach; a placement that lands on more nodes than this stops the run at start.",
    )
    num_engines: int = Field(1, ge=1, description="Rollout actors (one SGLang engine each) at the start.")
    max_engines: int | None = Field(
        None, ge=1, description="Most rollout actors the run may be scaled to while it runs (``async-dapo scale "
        "RUN_DIR --engines N``); None = placement.num_engines. It sizes the replay queue's receiver (transport."
        "max_peers None = 2 x this).",
    )
    autoscaling: bool = Field(
        False, description="The cluster adds nodes on demand (a Ray autoscaler): a placement larger than the "
        "cluster waits for them, reporting every minute, for at most placement.start_timeout_s. False: it "
        "stops the run at once, naming the fields and the cluster's resources.",
    )
    engine_cpus: float = Field(1, gt=0, description="CPUs per rollout actor.")
    engine_gpus: int = Field(
        0, ge=0, description="GPUs per rollout actor: rollout.engine.tp_size on cuda, 0 on cpu (auto: "
        "either).",
    )
    learner_ranks: int = Field(1, ge=1, description="FSDP2 learner ranks.")
    learner_cpus: float = Field(1, gt=0, description="CPUs per learner rank.")
    learner_gpus: int = Field(0, ge=0, le=1, description="GPUs per learner rank (0 or 1).")
    queue_cpus: float = Field(0, ge=0, description="CPUs reserved for the replay-queue actor.")
    start_timeout_s: float = Field(
        900, gt=0, description="Bound (seconds) on placement-group readiness, engine start and learner "
        "construction.",
    )
    call_timeout_s: float = Field(
        1800, gt=0, description="Bound (seconds) on one learner call (train step, checkpoint, export) and "
        "other control calls.",
    )
    health_check_interval_s: float = Field(
        10, gt=0, description="Seconds between heartbeats to every rollout engine (slime: 10 s)."
    )
    health_check_timeout_s: float = Field(
        30, gt=0, description="A heartbeat (one 1-token generate through the engine) unanswered after this "
        "many seconds marks the engine hung: it is killed and replaced. Also the one bound on every call the "
        "supervisor makes to all engines at once (start producing, shut down, counters), and the ceiling of "
        "the bounds taken from an operation's own recent durations (5 x their median, at least a third of "
        "this): each step of a weight-group formation (leave, dtype, join), and a push, past which an engine "
        "that has not loaded it while another has is hung.",
    )
    max_engine_restarts: int = Field(
        3, ge=0, description="Replacements of dead/hung rollout actors over the whole run; once exhausted "
        "the run stops, naming the actor and the last checkpoint.",
    )
