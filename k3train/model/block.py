"""One K3 layer: a token-mixer sublayer (KDA or Gated MLA) and an FFN sublayer (dense or Stable LatentMoE), each
fed by its own Block AttnRes aggregation and pre-norm.

    x_a = attn_norm(AttnRes_a(blocks + [partial]))         partial <- partial + attn(x_a)     (or attn(x_a) at a
    x_f = ffn_norm(AttnRes_f(blocks + [partial]))          partial <- partial + ffn(x_f)       block start)
    after the last layer of a block (every attn_res_block_size layers): blocks.append(partial); partial <- None

FQNs inside ``layers.{i}``: ``attn_res.{query, key_norm.weight}``, ``attn_norm.weight``, ``attn.*``,
``ffn_res.{query, key_norm.weight}``, ``ffn_norm.weight``, ``ffn.*``.

With ``model.residual: standard`` (the ablation that measures what Block AttnRes costs and brings) the layer is
a plain PreNorm residual block on the state's one running tensor ``h`` (``state.partial``, no blocks)::

    h <- h + attn(attn_norm(h));     h <- h + ffn(ffn_norm(h))

and has no ``attn_res`` / ``ffn_res`` parameters (``attn_res_recompute`` then recomputes the pre-norms).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from k3train.model.attnres import AttnRes, AttnResState
from k3train.model.attnres_fused import rms_norm
from k3train.model.chunking import head_ranges, maybe_checkpoint
from k3train.model.ffn import DenseFFN
from k3train.model.kda import KDALayer
from k3train.model.mla import MLA
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.model.seq import SeqInfo


def build_mixer(cfg: Any, kind: str) -> nn.Module:
    """The token mixer for a layer kind: ``'kda'`` -> :class:`KDALayer`, ``'mla'`` -> :class:`MLA`."""
    if kind == "kda":
        return KDALayer(cfg)
    if kind == "mla":
        return MLA(cfg)
    raise ValueError(f"unknown layer kind {kind!r} (expected 'kda' or 'mla')")


def build_ffn(cfg: Any, moe: bool) -> nn.Module:
    """Stable LatentMoE for MoE layers, else the dense SiTU-GLU FFN of width ``intermediate_size``."""
    return LatentMoE(cfg) if moe else DenseFFN.from_config(cfg)


class K3Layer(nn.Module):
    """Layer ``layer_idx`` (0-based) of the backbone: ``forward(state, seq) -> state`` (AttnResState in and out).

    Shapes: every tensor of the state is ``[B, T, d]``. No communication of its own (CP goes through ``seq.cp``,
    EP through the MoE's dispatcher).
    """

    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kind(layer_idx)
        self.block_size = cfg.attn_res_block_size
        self.recompute = cfg.attn_res_recompute
        self.residual = cfg.residual
        attnres = self.residual == "attnres"
        self.attn_res = AttnRes(d, eps) if attnres else None
        self.attn_norm = RMSNorm(d, eps)
        self.attn = build_mixer(cfg, self.kind)
        self.ffn_res = AttnRes(d, eps) if attnres else None
        self.ffn_norm = RMSNorm(d, eps)
        self.ffn = build_ffn(cfg, cfg.is_moe_layer(layer_idx))
        self.recompute_sublayers = False  # set from outside (K3Model.set_recompute): see run_mixer

    @property
    def ends_block(self) -> bool:
        """Whether this layer's partial sum becomes a completed block (never under the standard residual)."""
        return self.residual == "attnres" and (self.layer_idx + 1) % self.block_size == 0

    def forward(self, state: AttnResState, seq: SeqInfo) -> AttnResState:
        return self.run_ffn(self.run_mixer(state, seq))

    def run_mixer(self, state: AttnResState, seq: SeqInfo) -> AttnResState:
        """:meth:`mixer_step` under the layer's recompute policy (``recompute_sublayers``, set from outside by
        ``K3Model.set_recompute``): the sublayer recomputed on its own in the backward -- as one region whose input
        (the state: resident but for the partial sum) is all it keeps, or chunk by chunk inside the mixer when it
        computes in head chunks (``checkpoint_chunks`` set on it)."""
        if self.recompute_sublayers and not _splits(self.attn, _tokens(state)):
            return maybe_checkpoint(self.mixer_step, state, seq, enabled=True)
        return self.mixer_step(state, seq)

    def run_ffn(self, state: AttnResState) -> AttnResState:
        """:meth:`ffn_step` under the recompute policy (as :meth:`run_mixer`; a LatentMoE with more tokens than its
        token chunk recomputes chunk by chunk)."""
        if self.recompute_sublayers and not _splits(self.ffn, _tokens(state)):
            return maybe_checkpoint(self.ffn_step, state, enabled=True)
        return self.ffn_step(state)

    def mixer_step(self, state: AttnResState, seq: SeqInfo) -> AttnResState:
        """The token-mixer sublayer: its aggregation + pre-norm, the mixer, the sum into the partial sum. The state
        returned always has a partial sum (the one :meth:`ffn_step` continues)."""
        if self.residual == "standard":
            h = state.partial
            return AttnResState(blocks=[], partial=h + self.attn(self._pre_norm(self.attn_norm, h), seq))
        x = self.attn_res(state.sources(), self.attn_norm, self.recompute)
        out = self.attn(x, seq)
        return AttnResState(blocks=list(state.blocks), partial=out if state.partial is None else state.partial + out)

    def ffn_step(self, state: AttnResState) -> AttnResState:
        """The FFN sublayer on :meth:`mixer_step`'s state; completes the block after its last layer."""
        if self.residual == "standard":
            h = state.partial
            return AttnResState(blocks=[], partial=h + self.ffn(self._pre_norm(self.ffn_norm, h)))
        blocks, partial = state.blocks, state.partial
        x = self.ffn_res([*blocks, partial], self.ffn_norm, self.recompute)
        partial = partial + self.ffn(x)
        if self.ends_block:
            return AttnResState(blocks=[*blocks, partial], partial=None)
        return AttnResState(blocks=list(blocks), partial=partial)

    def _pre_norm(self, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``norm(h)``; under ``attn_res_recompute`` the norm with a hand-written backward that keeps only ``h``
        and one ``rsqrt`` per token (:func:`k3train.model.attnres_fused.rms_norm`), as the AttnRes path's fused
        aggregation + pre-norm does, so the ablation compares like with like: per sublayer autograd keeps the
        residual stream and the normalised input, not the norm's fp32 intermediates."""
        if self.recompute:
            return rms_norm(h, norm)
        return norm(h)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, kind={self.kind}, ends_block={self.ends_block}"


def _splits(mod: nn.Module, n_tokens: int) -> bool:
    """Whether ``mod`` computes in chunks: a token mixer with more than one head chunk, a LatentMoE with more tokens
    than its token chunk (k3train/model/chunking.py)."""
    if isinstance(mod, LatentMoE):
        return n_tokens > mod.token_chunk > 0
    heads, chunk = getattr(mod, "num_heads", 0), getattr(mod, "head_chunk", 0)
    return len(head_ranges(heads, chunk)) > 1


def _tokens(state: AttnResState) -> int:
    """Tokens of a state (``B * T``)."""
    t = state.partial if state.partial is not None else state.blocks[-1]
    return t.shape[:-1].numel()
