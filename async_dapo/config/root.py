"""The whole run's config: one section per part, in the data flow's order, and the cross-field rules
run when it loads."""

from __future__ import annotations

from pydantic import Field, model_validator

from async_dapo.config.section import Section
from async_dapo.config.algorithm import AlgorithmConfig
from async_dapo.config.data import DataConfig
from async_dapo.config.learner import LearnerConfig
from async_dapo.config.model import ModelConfig
from async_dapo.config.output import CheckpointConfig, LoggingConfig
from async_dapo.config.placement import PlacementConfig
from async_dapo.config.replay import ReplayConfig
from async_dapo.config.reward import RewardConfig
from async_dapo.config.rollout import RolloutConfig
from async_dapo.config.rules import CROSS_FIELD_RULES
from async_dapo.config.transport import TransportConfig
from async_dapo.config.weight_sync import WeightSyncConfig


class Config(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "Config":
        """Run every rule of CROSS_FIELD_RULES in order; the first broken one raises its one-line message."""
        for rule in CROSS_FIELD_RULES:
            rule(self)
        return self
