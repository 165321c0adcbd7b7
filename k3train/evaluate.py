"""Validation loss: ``train.eval_iters`` global batches of the dataset's validation split, forward only.

Every ``train.eval_interval`` steps and at the end of training (``eval_interval: 0`` disables it) the trainer
logs ``val_loss`` (and ``val_mtp_loss`` with an MTP layer): the token-weighted mean loss over the first
``eval_iters * global_batch_size`` samples of the valid split -- the SAME samples at every evaluation, so the
values are comparable along the run, and the same whatever the parallel layout (the global batches are cut
into dp/cp micro-batches exactly as in training).

What evaluation must not touch: gradients (``torch.no_grad``), the Quantile-Balancing statistics and biases
and the QK-Clip maxima (the model is put in eval mode: routers and MLA only collect in training mode), the
MoonEP dispatch metrics of the next training step (drained afterwards), the training data position and RNG.
Under pipeline parallelism it runs the schedule's forward actions only (``runner.forward_only``); every rank
joins the same p2p and the final all-reduce. Every module's train/eval mode is restored afterwards (an EAGLE-3 draft
run keeps its frozen target in eval mode and its draft in train mode).

An EAGLE-3 draft run (``train.objective=eagle3``) logs instead ``val_loss`` (the draft objective), ``val_draft_accept``
(the per-step acceptance) and ``val_draft_accept_len`` (the expected accepted length): k3train/draft/objective.py.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from k3train.data import GlobalBatchLoader
from parallel.pipeline.loss_norm import LossNorm


class Evaluator:
    """Owned by the trainer; construct on EVERY rank in the same order (the dataset build is collective)."""

    def __init__(self, cfg: Any, dims: Any, pm: Any, comm_device: torch.device,
                 device: torch.device | str = "cpu") -> None:
        self.interval, self.iters = cfg.train.eval_interval, cfg.train.eval_iters
        self.pm, self.dims, self.comm_device = pm, dims, comm_device
        self.mtp = cfg.model.num_nextn_predict_layers > 0
        # loss sums come from the last stage; only its ranks count tokens (each holds a distinct dp/cp slice)
        self.counts_tokens = dims.pp == 1 or dims.pp_rank == dims.pp - 1
        self.loader = None
        if self.interval > 0:
            self.loader = GlobalBatchLoader.from_dims(cfg, dims, split="valid", device=device)

    def due(self, step: int, total_steps: int) -> bool:
        return self.loader is not None and (step % self.interval == 0 or step == total_steps)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """``{"val_loss"[, "val_mtp_loss"]}`` over the validation batches (an EAGLE-3 draft run: ``val_loss``,
        ``val_draft_accept``, ``val_draft_accept_len``, k3train/draft/objective.py). Collective (world)."""
        modes = [(sub, sub.training) for m in self.pm.modules for sub in m.modules()]  # a draft run mixes modes
        for m in self.pm.modules:
            m.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # lm loss, mtp loss, lm tokens, mtp tokens
        norm = LossNorm(lm_tokens=1.0, mtp_tokens=1.0, mtp_weight=0.0)  # loss sums only; the scalar is unused
        draft, drafted = self.pm.draft, None
        try:
            self.loader.consumed_samples = 0
            for _ in range(self.iters):
                micro_batches = self.loader.next_step()
                if draft is not None:
                    flat = draft.flat(draft.forward_only(micro_batches))
                    drafted = flat if drafted is None else [a + b for a, b in zip(drafted, flat)]
                    continue
                stats = self.pm.runner.forward_only(micro_batches, norm)
                sums[0] += stats["lm_loss_sum"]
                sums[1] += stats["mtp_loss_sum"]
                if self.counts_tokens:
                    sums[2] += float(sum(float(b.loss_mask.sum()) for b in micro_batches))
                    sums[3] += float(sum(float(b.mtp_loss_mask.sum()) for b in micro_batches))
        finally:
            for sub, t in modes:
                sub.train(t)
            self.pm.discard_step_statistics()
        if draft is not None:
            t = torch.tensor(drafted, dtype=torch.float64, device=self.comm_device)
            if dist.is_initialized():
                dist.all_reduce(t)
            return draft.metrics(t.tolist(), prefix="val_")
        sums = sums.to(self.comm_device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        lm, mtp, lm_tok, mtp_tok = sums.tolist()
        out = {"val_loss": lm / max(lm_tok, 1.0)}
        if self.mtp:
            out["val_mtp_loss"] = mtp / max(mtp_tok, 1.0)
        return out
