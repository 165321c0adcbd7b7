"""The dense reference of MLA's attention core: the causal + document mask (:class:`MaskInfo`), masked softmax
attention on the expanded K/V (:func:`attention_core`, the contract every MLA kernel meets:
k3train/ops/mla_blockwise.py, k3train/ops/mla_flex.py) and the max logit per head (:func:`masked_logit_max`, for
QK-Clip)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class MaskInfo:
    """What the causal + document mask needs: ``[B, Tq]`` query and ``[B, Tk]`` key document ids and positions."""

    q_doc: torch.Tensor
    q_pos: torch.Tensor
    k_doc: torch.Tensor
    k_pos: torch.Tensor
    # the blockwise op's block plans by block size (k3train/ops/mla_blockwise.py: made once per mask)
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    def dense(self) -> torch.Tensor:
        """Boolean ``[B, 1, Tq, Tk]``, True where the query may attend to the key."""
        causal = self.k_pos[:, None, :] <= self.q_pos[:, :, None]
        same_doc = self.k_doc[:, None, :] == self.q_doc[:, :, None]
        return (causal & same_doc)[:, None]


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_info: MaskInfo,
                   scale: float) -> torch.Tensor:
    """Masked softmax attention in fp32.

    Shapes: ``q [B, H, Tq, Dqk]``, ``k [B, H, Tk, Dqk]``, ``v [B, H, Tk, Dv]`` -> ``[B, H, Tq, Dv]`` (fp32).
    Every query sees at least itself (its own key is among the keys and passes the mask), so no row is empty.
    """
    out_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return F.scaled_dot_product_attention(q.to(out_dtype), k.to(out_dtype), v.to(out_dtype),
                                          attn_mask=mask_info.dense(), scale=scale)


@torch.no_grad()
def masked_logit_max(q: torch.Tensor, k: torch.Tensor, mask_info: MaskInfo, scale: float) -> torch.Tensor:
    """Max pre-softmax logit per head over the allowed (query, key) pairs: ``[H]`` (fp32; fp64 for fp64 inputs).

    A separate matmul (the dense reference's; the blockwise path returns it from its forward pass).
    """
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = torch.einsum("bhqd,bhkd->bhqk", q.to(dt), k.to(dt)) * scale
    logits = logits.masked_fill(~mask_info.dense(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))
