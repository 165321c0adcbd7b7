"""The language-model loss: masked cross-entropy sums, and the LM head + cross-entropy in token chunks so that a
long row's logits are never all alive at once (the main head, the MTP head and EAGLE-3 drafts use it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CE_CHUNK_TOKENS = 4096  # tokens per LM-head + cross-entropy chunk (bounds the live fp32 logits to 4096 x vocab)


def masked_ce_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t mask_t * CE(logits_t, labels_t)`` in (at least) fp32. ``logits [..., V]``, ``labels/mask [...]``.

    Labels at masked-out positions may hold anything (e.g. -100 or pad); they are clamped into the vocabulary so
    the lookup is valid and then multiplied by a zero mask.
    """
    V = logits.shape[-1]
    acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 for float64 reference runs)
    ce = F.cross_entropy(logits.to(acc).reshape(-1, V), labels.reshape(-1).clamp(0, V - 1), reduction="none")
    return (ce * mask.reshape(-1).to(ce.dtype)).sum()


def lm_head_ce_sum(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, mask: torch.Tensor,
                   chunk_tokens: int = CE_CHUNK_TOKENS) -> torch.Tensor:
    """``masked_ce_sum(lm_head(hidden), labels, mask)`` without ever holding all logits: token chunks of
    ``chunk_tokens`` run under activation checkpointing, so only ``hidden`` is kept for backward (at K3 size one
    1M-token row's fp32 logits would be 655 GB). ``hidden [B, T, d]``, ``labels/mask [B, T]``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    lab, msk = labels.reshape(-1), mask.reshape(-1)
    if h.shape[0] <= chunk_tokens:
        return masked_ce_sum(lm_head(h), lab, msk)
    total = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32))
    for s in range(0, h.shape[0], chunk_tokens):
        sl = slice(s, s + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(lambda x, y, m: masked_ce_sum(lm_head(x), y, m), h[sl], lab[sl], msk[sl],
                                       use_reentrant=False)
        else:
            total = total + masked_ce_sum(lm_head(h[sl]), lab[sl], msk[sl])
    return total
