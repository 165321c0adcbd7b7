"""Typed run configuration: the sections, each beside its check (model.py, parallel.py, train.py, optim.py,
data.py, logs.py, checkpoint.py, vision.py, draft.py, kernels.py; a check reports through report.py's ``Need``),
together in :class:`Config` (schema.py: ``Config.validate`` runs the checks) <- YAML <- ``--section.key=value``
overrides (load.py).
``from k3train.config import Config, load_config, ...`` is the import path."""
from k3train.config.checkpoint import CheckpointConfig
from k3train.config.data import SPLIT_NAMES, DataConfig, parse_split
from k3train.config.load import REQUIRED_MODEL_KEYS, load_config, parse_overrides
from k3train.config.logs import LOG_LEVELS, WANDB_MODES, LoggingConfig
from k3train.config.model import HIDDEN_ACTS, ModelConfig
from k3train.config.optim import OptimConfig
from k3train.config.parallel import RECOMPUTE_GRANULARITIES, ParallelConfig
from k3train.config.schema import Config
from k3train.config.train import TrainConfig
from k3train.config.vision import VisionConfig
from k3train.runtime.bad_input import ConfigError

__all__ = ["REQUIRED_MODEL_KEYS", "load_config", "parse_overrides", "HIDDEN_ACTS", "LOG_LEVELS",
           "RECOMPUTE_GRANULARITIES", "SPLIT_NAMES", "WANDB_MODES", "CheckpointConfig", "Config", "DataConfig",
           "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "VisionConfig",
           "parse_split", "ConfigError"]
