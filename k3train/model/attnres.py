"""Block Attention Residuals (AttnRes): attention over depth replaces ``h_{l+1} = h_l + f_l(h_l)``.

Every sublayer ``l`` (each K3 layer has two: the token mixer and the FFN) owns a learnable pseudo-query
``w_l [d]`` and a key RMSNorm. Its input is a softmax-weighted sum over the *sources*::

    sources = [b_0 = token embedding, b_1..b_{n-1} = completed block sums, b_n^{i-1} = current partial sum]
    alpha_i = softmax_i(w_l . RMSNorm(s_i)),      h_l = sum_i alpha_i s_i          (per token)

(the partial sum is absent for the first sublayer of a block). The sublayer computes ``f_l(RMSNorm_pre(h_l))``
and adds its output into the partial sum; when a block of ``attn_res_block_size`` LAYERS completes, the partial
sum becomes a new completed block. The final output aggregates all sources with its own pseudo-query.

Pseudo-queries start at zero, so every aggregation starts as the uniform average of its sources (the AttnRes
paper's init: training starts from an equal-weight mix rather than a random preference over depth).

Systems: completed blocks are computed once at block boundaries and stay resident (they are the stage-to-stage
payload under pipeline parallelism); under ``attn_res_recompute`` the aggregation + pre-norm is one autograd
function that keeps only per-token scalars (k3train/model/attnres_fused.py), so per sublayer autograd keeps the
new partial sum and the normalised sublayer input -- what a standard pre-norm residual layer keeps (its residual
stream and its normalised input).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from k3train.model.attnres_fused import aggregate_norm
from k3train.model.norm import RMSNorm


RESIDUALS = ("attnres", "standard")


def canonical_layout(layer: int, block_size: int, residual: str = "attnres") -> tuple[int, bool]:
    """``(number of blocks, has a partial sum)`` of the canonical state before ``layer`` (``layer`` = the number of
    layers: the state the final aggregation reads). The one rule the model, the pipeline's AttnRes plan and the
    memory estimator share.

    Block AttnRes: ``1 + layer // block_size`` blocks (the embedding and the completed blocks) and a partial sum
    inside a block. Standard residual (``model.residual: standard``): no blocks and always a "partial sum", which
    is the residual stream ``h`` itself (the embedding before layer 0), so a pipeline boundary carries just that
    one hidden state through the same machinery.
    """
    if residual == "standard":
        return 0, True
    if residual != "attnres":
        raise ValueError(f"residual must be one of {RESIDUALS}, got {residual!r}")
    return 1 + layer // block_size, layer % block_size != 0


@dataclass
class AttnResState:
    """The depth state between layers.

    ``blocks``: ``[b_0 (embedding), b_1, ...]`` each ``[B, T, d]`` (completed block sums).
    ``partial``: current block's partial sum ``[B, T, d]``, or ``None`` at a block start.
    Canonical before layer ``start``: see :func:`canonical_layout` (Block AttnRes: ``len(blocks) == 1 + start //
    block_size`` and ``partial is None`` iff ``start % block_size == 0``; standard residual: ``blocks == []`` and
    ``partial`` = the residual stream).
    """

    blocks: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None

    def sources(self) -> list[torch.Tensor]:
        """What an aggregation attends over: the blocks, then the partial sum when present."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def check_canonical(self, start: int, block_size: int, residual: str = "attnres") -> None:
        """Raise ValueError if this state is not the one layer ``start`` expects."""
        want_blocks, want_partial = canonical_layout(start, block_size, residual)
        if len(self.blocks) != want_blocks or (self.partial is not None) != want_partial:
            raise ValueError(
                f"AttnResState before layer {start} (model.residual={residual}, attn_res_block_size={block_size}) "
                f"must have {want_blocks} "
                f"blocks and {'a' if want_partial else 'no'} partial sum; got {len(self.blocks)} blocks and "
                f"{'a' if self.partial is not None else 'no'} partial sum")


def attn_res_aggregate(sources: list[torch.Tensor], query: torch.Tensor, key_norm: RMSNorm) -> torch.Tensor:
    """``h = sum_i softmax_i(query . key_norm(s_i)) s_i`` over ``sources`` (each ``[B, T, d]``) -> ``[B, T, d]``.

    Scores and weights in at least fp32 (a softmax over depth in bf16 would quantise the weights); output in the sources'
    dtype. No communication.
    """
    # (With one source the weight is exactly 1 and the query/key-norm gradients exactly 0; computing it anyway
    # keeps every parameter's .grad materialised, which gradient-bucketing code expects.)
    values = torch.stack(sources, dim=0)  # [N, B, T, d]
    acc = torch.promote_types(values.dtype, torch.float32)  # fp32, or fp64 for float64 reference runs
    logits = torch.einsum("nbtd,d->nbt", key_norm(values).to(acc), query.to(acc))
    weights = torch.softmax(logits, dim=0)
    return torch.einsum("nbt,nbtd->btd", weights, values.to(acc)).to(values.dtype)


class AttnRes(nn.Module):
    """One aggregation: pseudo-query ``query [d]`` (init 0) and key norm ``key_norm`` (RMSNorm with weight).

    ``forward(sources, pre_norm=None, recompute=False)`` returns ``pre_norm(h)`` (or ``h``). With ``recompute``
    (``model.attn_res_recompute``) the aggregation and the pre-norm run as one autograd function
    (:func:`k3train.model.attnres_fused.aggregate_norm`) that saves only per-token scalars besides the (resident)
    sources and rebuilds ``h`` in backward -- what checkpointing them would keep, at a third of the passes over
    the sources; without, the readable autograd reference (:func:`attn_res_aggregate`) keeps every intermediate.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm = RMSNorm(dim, eps)

    def _aggregate(self, pre_norm: nn.Module | None, *sources: torch.Tensor) -> torch.Tensor:
        h = attn_res_aggregate(list(sources), self.query, self.key_norm)
        return pre_norm(h) if pre_norm is not None else h

    def forward(self, sources: list[torch.Tensor], pre_norm: nn.Module | None = None,
                recompute: bool = False) -> torch.Tensor:
        if not sources:
            raise ValueError("AttnRes needs at least one source (the embedding)")
        if recompute:
            if pre_norm is not None and not isinstance(pre_norm, RMSNorm):
                raise TypeError(f"AttnRes: the fused aggregation takes an RMSNorm pre-norm, got {type(pre_norm)}")
            return aggregate_norm(sources, self.query, self.key_norm, pre_norm)
        return self._aggregate(pre_norm, *sources)
