"""EAGLE-3 draft training (``train.objective: eagle3``): the objective and its metrics (``objective.py``), the
frozen target checkpoint (``target.py``); the model side is k3train/model/eagle3.py."""
from k3train.draft.objective import DraftNorm, DraftObjective, draft_modules, freeze_target

__all__ = ["DraftNorm", "DraftObjective", "draft_modules", "freeze_target"]
