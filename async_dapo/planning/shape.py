"""What the planner simulates and what it reports: a run's shape (batch, concurrency, staleness, placement,
as a Config sets them) and the steady-state figures of one plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from async_dapo.config.replay import resolved_batch_order

UPDATE_MODES = ("inflight", "drain", "abort")


@dataclass(frozen=True)
class Shape:
    """The run's shape: what a Config says about batch, concurrency, staleness and placement."""

    B: int  # algorithm.train_batch_groups
    G: int  # rollout.n
    eta: int  # replay.max_staleness
    max_inflight_prompts: int  # per rollout actor (engine)
    update_mode: str = "inflight"
    max_response_length: int = 1 << 20
    every_k_steps: int = 1
    epochs: int = 1
    num_engines: int = 1
    learner_ranks: int = 1
    filter_groups: bool = True  # algorithm.dynamic_sampling.enable
    mini_batch_groups: int = 1 << 20  # learner.mini_batch_groups (default: one update per epoch)
    micro_batch_tokens: int = 1 << 40  # learner.micro_batch_tokens (default: one micro-batch)
    proximal: bool = False  # a proximal log-prob pass (algorithm.correction.mode != "naive")
    batch_order: str = "arrival"  # replay.batch_order: "arrival", "admission" (no wait bound) or "auto" (see order)

    def __post_init__(self) -> None:
        for name in ("B", "G", "max_inflight_prompts", "max_response_length", "every_k_steps", "epochs",
                     "num_engines", "learner_ranks", "mini_batch_groups", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Shape.{name} must be >= 1, got {getattr(self, name)}")
        if self.eta < 0:
            raise ValueError(f"Shape.eta must be >= 0, got {self.eta}")
        if self.batch_order not in ("arrival", "admission", "auto"):
            raise ValueError(f"Shape.batch_order must be 'arrival', 'admission' or 'auto', got {self.batch_order!r}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"Shape.update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")

    @classmethod
    def from_config(cls, cfg) -> "Shape":
        """The run's shape. Abort with rollout.partial_rollout is simulated as in-flight: both continue each
        running sample on the new weights after the load, from its prompt and tokens so far (measured on the
        long-tail task at η 4: 0.313 and 0.315 steps/s)."""
        ro = cfg.rollout
        mode = "inflight" if ro.update_mode == "abort" and ro.partial_rollout else ro.update_mode
        return cls(B=cfg.algorithm.train_batch_groups, G=cfg.rollout.n, eta=cfg.replay.max_staleness,
                   max_inflight_prompts=cfg.rollout.max_inflight_prompts, update_mode=mode,
                   max_response_length=cfg.rollout.max_response_length,
                   every_k_steps=cfg.weight_sync.every_k_steps, epochs=cfg.learner.epochs,
                   num_engines=cfg.placement.num_engines, learner_ranks=cfg.placement.learner_ranks,
                   filter_groups=cfg.algorithm.dynamic_sampling.enable,
                   mini_batch_groups=cfg.learner.mini_batch_groups, micro_batch_tokens=cfg.learner.micro_batch_tokens,
                   proximal=cfg.algorithm.correction.mode != "naive",
                   batch_order=cfg.replay.batch_order)

    @property
    def order(self) -> str:
        """The batch order the queue uses: ``auto`` resolved against this shape's update mode, as the queue
        resolves it (an abort with a kept prefix is already simulated as in-flight), so that a search over
        update modes plans each with the order a run would get."""
        return resolved_batch_order(self.batch_order, self.update_mode)

    def with_(self, **changes) -> "Shape":
        return replace(self, **changes)

    def synchronous(self) -> "Shape":
        """The same plan at η = 0 (which needs every_k_steps = 1): the baseline of the speedup."""
        return replace(self, eta=0, every_k_steps=1)



@dataclass
class Prediction:
    """Steady-state figures of one plan (the steps after the warm-up)."""

    steps_per_s: float
    samples_per_s: float  # trained samples: steps/s · B · G
    gen_tokens_per_s: float  # every generated token, wasted ones included
    trained_tokens_per_s: float  # response tokens trained per second (as tools/bench/throughput.py)
    learner_idle: float  # learner waiting for a batch / wall
    rollout_idle: float  # engine with no group in flight / wall, mean over engines
    occupancy: float  # time-weighted running sequences / (max_inflight_prompts · G), mean over engines
    tail_share: float  # engine decoding with 0 < n < max_inflight_prompts · G / 2 running, / wall
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, int]
    dropped_stale: int
    dropped_filtered: int
    wasted_tokens: int  # tokens generated and thrown away (abort mode)
    step_s: float
    push_s: float  # the sender's time per push
    weight_load_s: float = 0.0  # per engine and push: push start -> it runs the new weights (perf/weight_load_s)
    train_s: float = 0.0  # per step: the training call, loop overhead included (perf/update_actor_s + overhead)
    keep_rate: float = float("nan")  # kept / (kept + filtered) finished groups
    trained_length_ratio: float = float("nan")  # mean trained response length / mean of all finished samples
    speedup: float | None = None  # over the same plan at η = 0

    def row(self) -> dict[str, float]:
        """Flat dict; names as tools/bench/throughput.py's COLUMNS where they exist."""
        out = {k: v for k, v in vars(self).items() if k != "staleness_hist"}
        out["speedup"] = float("nan") if self.speedup is None else self.speedup
        return out

