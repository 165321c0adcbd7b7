from .manager import CheckpointManager, step_dir_name
from .rundir import checkpoint_root, prepare_run_dir

__all__ = ["CheckpointManager", "checkpoint_root", "prepare_run_dir", "step_dir_name"]
