"""Typed run configuration: the sections' schema (k3train/config/schema.py) <- YAML <- ``--section.key=value``
overrides (k3train/config/load.py). ``from k3train.config import Config, load_config, ...`` is the import path."""
from k3train.config.load import REQUIRED_MODEL_KEYS, load_config, parse_overrides
from k3train.config.schema import (HIDDEN_ACTS, LOG_LEVELS, RECOMPUTE_GRANULARITIES, SPLIT_NAMES, WANDB_MODES,
                                   CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, OptimConfig,
                                   ParallelConfig, TrainConfig, VisionConfig, parse_split)
from k3train.runtime.bad_input import ConfigError

__all__ = ["REQUIRED_MODEL_KEYS", "load_config", "parse_overrides", "HIDDEN_ACTS", "LOG_LEVELS",
           "RECOMPUTE_GRANULARITIES", "SPLIT_NAMES", "WANDB_MODES", "CheckpointConfig", "Config", "DataConfig",
           "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VisionConfig",
           "parse_split", "ConfigError"]
