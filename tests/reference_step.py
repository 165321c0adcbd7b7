"""The single-process reference step every parallel-layout test compares against."""
from __future__ import annotations

from typing import Any

import torch

from k3train.model.seq import SeqInfo


def single_process_step(model: Any, batches: list, norm: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Forward + backward of every micro-batch through the whole ``K3Model`` with the trainer's ``LossNorm``.
    Returns every parameter's gradient by FQN (zeros where none) and the summed loss statistics."""
    L = model.cfg.num_hidden_layers
    stats = {"loss": 0.0, "lm_loss_sum": 0.0, "mtp_loss_sum": 0.0}
    for b in batches:
        seq = SeqInfo.from_doc_ids(b.doc_ids, b.positions)
        sums = model.loss_sums(model.forward_layers(model.embed_batch(b), 0, L, seq), b, seq)
        loss = norm(sums)
        loss.backward()
        stats["loss"] += float(loss.detach())
        stats["lm_loss_sum"] += float(sums["lm_loss_sum"].detach())
        stats["mtp_loss_sum"] += float(sums["mtp_loss_sum"].detach())
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return grads, stats
