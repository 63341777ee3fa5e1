"""The one typed configuration tree of a run.

Every field is documented and bounded where it is defined; unknown keys are errors (``extra="forbid"``).
A run's config = a YAML file + ``--set a.b=c`` overrides (values parsed as YAML scalars/lists), validated
once by :func:`load_config`. Any problem raises :class:`ConfigError` whose message is one line naming the
dotted key and the problem; the CLI prints it and exits non-zero.

Sections follow the data flow: model -> data -> rollout -> reward -> algorithm -> replay -> learner ->
weight_sync -> placement -> transport -> logging -> checkpoint. Each section's schema lives in the module
named after it (``output`` holds logging and checkpoint), the rules that tie sections together in
:mod:`.rules`, the root :class:`Config` in :mod:`.root`, loading in :mod:`.load`; everything is importable
from ``async_dapo.config``. :mod:`.reference` renders docs/config.md from the schema, :mod:`.from_verl`
translates a verl DAPO launch script.
"""

from async_dapo.config.algorithm import AlgorithmConfig, CorrectionConfig, DynamicSamplingConfig
from async_dapo.config.data import DataConfig, SyntheticTaskConfig
from async_dapo.config.learner import LearnerConfig
from async_dapo.config.load import (
    config_from_mapping, config_yaml, dump_config, load_config, parse_override, read_yaml_mapping, set_dotted,
)
from async_dapo.config.model import ModelConfig, TinyModelConfig
from async_dapo.config.output import CheckpointConfig, LoggingConfig
from async_dapo.config.placement import PlacementConfig
from async_dapo.config.replay import ReplayConfig, resolved_batch_order
from async_dapo.config.reward import RewardConfig
from async_dapo.config.rollout import EngineConfig, RolloutConfig
from async_dapo.config.root import Config
from async_dapo.config.rules import CROSS_FIELD_RULES, LOOPBACK_HOSTS, NODE_LOCAL_DIRS, engine_ceiling
from async_dapo.config.section import ConfigError, Section
from async_dapo.config.transport import (
    RECEIVE_DEFAULT_BUDGET_BYTES, RECEIVE_MAX_HWM, RECEIVE_PEER_EXTRA, RECEIVE_TAG_BYTES, TransportConfig,
    receive_budget, receive_hard_cap, receive_hwm, receive_max_peers, receive_min_budget,
)
from async_dapo.config.weight_sync import WeightSyncConfig

__all__ = [
    "AlgorithmConfig",
    "CROSS_FIELD_RULES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CorrectionConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "LOOPBACK_HOSTS",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "NODE_LOCAL_DIRS",
    "PlacementConfig",
    "RECEIVE_DEFAULT_BUDGET_BYTES",
    "RECEIVE_MAX_HWM",
    "RECEIVE_PEER_EXTRA",
    "RECEIVE_TAG_BYTES",
    "ReplayConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "SyntheticTaskConfig",
    "TinyModelConfig",
    "TransportConfig",
    "WeightSyncConfig",
    "config_from_mapping",
    "config_yaml",
    "dump_config",
    "engine_ceiling",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
    "receive_budget",
    "receive_hard_cap",
    "receive_hwm",
    "receive_max_peers",
    "receive_min_budget",
    "resolved_batch_order",
    "set_dotted",
]
