"""The ``checkpoint`` section: interval, resume, overwrite, async saves, the preemption deadline, the EAGLE-3
target and a Hugging Face start; and its check."""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3train.config.report import Need


@dataclass
class CheckpointConfig:
    interval: int = 0  # 0 = only at the end
    resume: str = "auto"  # "auto" | "none" | path to a step directory
    dir: str = ""  # default: <out_dir>/checkpoints
    keep: int = 2
    save_final: bool = True
    # a start that would overwrite or be shadowed by another run's data (resume=none into a used out_dir, or
    # resume=PATH older than checkpoints beside it) is refused; true MOVES that data into previous-N/ instead
    overwrite: bool = False
    async_save: bool = False  # write checkpoints in a background thread (DCP async_save); training goes on
    # train.objective=eagle3: the frozen target, a complete checkpoint (step directory) of a k3train run of this
    # model with an MTP layer; read once at the start (not when the draft run resumes from its own checkpoint)
    target: str = ""
    # on SIGTERM/SIGINT every rank stops at the same step boundary and saves it; if that save has not finished
    # this many seconds after the signal, the rank exits and the last complete checkpoint stays. Keep it under
    # the scheduler's grace period and torchrun's --shutdown-timeout (30 s by default), after which come SIGKILLs
    preempt_timeout_s: float = 25.0
    # a Hugging Face checkpoint directory (config.json + safetensors, kimi_linear / kimi_k3) to START from: a fresh
    # run loads its weights in any parallel layout, each rank only its own tensors (k3train/hf/load.py); a resume
    # ignores it. Checked before anything is built (k3train/preflight.py); write the matching run config with
    # `k3train import-hf HF_DIR -o RUN.yaml`
    load_hf: str = ""


def check_checkpoint(c: CheckpointConfig, need: Need) -> None:
    """The preemption deadline; and checkpoint safety: overwrite only names what a start that is not a plain
    continuation may move aside."""
    need(math.isfinite(c.preempt_timeout_s) and c.preempt_timeout_s > 0,
         "checkpoint.preempt_timeout_s", f"must be > 0 seconds, got {c.preempt_timeout_s}")
    need(not (c.overwrite and c.resume == "auto"), "checkpoint.overwrite",
         "true needs checkpoint.resume=none (a new run) or a checkpoint path; resume=auto continues the run")
