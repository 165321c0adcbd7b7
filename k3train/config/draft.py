"""Cross-section check of ``train.objective``: EAGLE-3 draft training (k3train/draft/, k3train/model/eagle3.py)
needs an MTP layer, AttnRes features, no CP and a frozen target (``checkpoint.target``, itself checked in
preflight: k3train/draft/target.py); a plain LM run names no target."""
from __future__ import annotations

from k3train.config.checkpoint import CheckpointConfig
from k3train.config.model import ModelConfig
from k3train.config.parallel import ParallelConfig
from k3train.config.report import Need
from k3train.config.train import TrainConfig


def check_objective(t: TrainConfig, m: ModelConfig, p: ParallelConfig, c: CheckpointConfig, need: Need) -> None:
    need(t.objective in ("lm", "eagle3"), "train.objective", f"must be 'lm' or 'eagle3', got {t.objective!r}")
    if t.objective == "eagle3":
        check_eagle3(t, m, p, c, need)
    else:
        need(not c.target, "checkpoint.target",
             f"is read only by train.objective=eagle3 (the draft's frozen target), but train.objective="
             f"{t.objective}", "checkpoint.target", "train.objective")


def check_eagle3(t: TrainConfig, m: ModelConfig, p: ParallelConfig, c: CheckpointConfig, need: Need) -> None:
    """``train.objective=eagle3``: what the draft needs of the config (the target checkpoint is preflight's)."""
    need(bool(c.target), "checkpoint.target",
         "train.objective=eagle3 needs the frozen target: checkpoint.target=PATH, a complete checkpoint (step "
         "directory) of a trained k3train run of this model", "train.objective", "checkpoint.target")
    need(t.draft_loss in ("lk", "kl"), "train.draft_loss", f"must be 'lk' or 'kl', got {t.draft_loss!r}")
    need(t.draft_steps >= 1, "train.draft_steps", f"must be >= 1, got {t.draft_steps}")
    need(m.num_nextn_predict_layers == 1, "model.num_nextn_predict_layers",
         "train.objective=eagle3 fine-tunes the MTP layer into the draft: the model needs one (1)",
         "model.num_nextn_predict_layers", "train.objective")
    need(m.residual == "attnres", "model.residual",
         "train.objective=eagle3 reads the draft's features from the AttnRes blocks (model.residual=attnres)",
         "model.residual", "train.objective")
    blocks, done = t.draft_feature_blocks, m.num_hidden_layers // m.attn_res_block_size
    need(len(blocks) == 2 and all(1 <= b <= done for b in blocks), "train.draft_feature_blocks",
         f"needs two completed AttnRes blocks in 1..{done} ({m.num_hidden_layers} layers in blocks of "
         f"{m.attn_res_block_size}), got {blocks}", "train.draft_feature_blocks", "model.attn_res_block_size")
    need(p.cp == 1, "parallel.cp", "train.objective=eagle3 (the draft's training-time test) does not run under "
         "context parallelism; use parallel.cp=1", "parallel.cp", "train.objective")
