"""``LossNorm``: turns a micro-batch's summed token losses into its share of the global-batch mean loss.

Every micro-batch backpropagates ``lm_loss_sum / lm_tokens + mtp_weight * mtp_loss_sum / mtp_tokens`` with the
token counts of the WHOLE global batch (all micro-batches, all data-parallel and context-parallel ranks). Summing
gradients over micro-batches and ranks then gives exactly the gradient of the global mean loss, whatever the
pipeline / DP / CP layout and however unevenly the loss-masked tokens fall into micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclass
class LossNorm:
    """Global token counts of one optimizer step and the MTP loss weight."""

    lm_tokens: float
    mtp_tokens: float
    mtp_weight: float

    def __call__(self, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar to backprop for one micro-batch from ``K3Model.loss_sums`` output (sums, not means)."""
        loss = sums["lm_loss_sum"] / max(float(self.lm_tokens), 1.0)
        mtp = sums.get("mtp_loss_sum")
        if mtp is not None and self.mtp_weight != 0.0 and self.mtp_tokens > 0:
            loss = loss + self.mtp_weight * mtp / float(self.mtp_tokens)
        return loss

    scalar = __call__

    @classmethod
    def from_batches(cls, micro_batches: Sequence[Any], mtp_weight: float, group: Any = None,
                     device: torch.device | str = "cpu") -> "LossNorm":
        """Count ``loss_mask`` / ``mtp_loss_mask`` tokens over ``micro_batches`` and sum the counts over ``group``
        (the data x context parallel group ``dims.group('dp_cp')``; ``None`` = no reduction). Every rank of the
        group must call it (one all-reduce of 2 numbers; ``device`` must suit the group's backend)."""
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for b in micro_batches:
            counts[0] += float(b.loss_mask.sum())
            counts[1] += float(b.mtp_loss_mask.sum())
        if group is not None and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        return cls(lm_tokens=float(counts[0]), mtp_tokens=float(counts[1]), mtp_weight=mtp_weight)
