from .manager import CheckpointManager, step_dir_name

__all__ = ["CheckpointManager", "step_dir_name"]
