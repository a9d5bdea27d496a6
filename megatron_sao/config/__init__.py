"""The typed config tree (one source of truth for every setting) and how it is loaded.

Sections: model, parallel, algo, learner, rollout, bus, weight_sync, eval, launch. Loaded from YAML or TOML with
dotted overrides (`--algo.dis.eps_high 5.0`); every error names the field and the fix.
"""

from megatron_sao.config.algo import AlgoConfig
from megatron_sao.config.bus import BusConfig
from megatron_sao.config.eval import EvalConfig
from megatron_sao.config.launch import LaunchConfig
from megatron_sao.config.learner import LearnerConfig, RoleOptimConfig
from megatron_sao.config.loader import (
    ConfigError,
    config_to_yaml,
    load_config,
    parse_overrides,
    read_config_file,
    validate_config,
)
from megatron_sao.config.model import ModelConfig
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.config.rollout import RolloutConfig
from megatron_sao.config.tree import SAOConfig
from megatron_sao.config.weight_sync import WeightSyncConfig

__all__ = [
    "AlgoConfig",
    "BusConfig",
    "ConfigError",
    "EvalConfig",
    "LaunchConfig",
    "LearnerConfig",
    "ModelConfig",
    "ParallelConfig",
    "RoleOptimConfig",
    "RolloutConfig",
    "SAOConfig",
    "WeightSyncConfig",
    "config_to_yaml",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "validate_config",
]
