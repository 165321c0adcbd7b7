"""Multi-token prediction (MTP) layer, DeepSeek-V3 style: predicts token t+2 from position t.

    h' = eh_proj [hnorm(h_main) ; enorm(Emb(token_{t+1}))]          (2d -> d, bias-free)
    h  = h' + attn(attn_norm(h'))           attn = Gated MLA
    h  = h  + ffn(ffn_norm(h))              ffn  = Stable LatentMoE (dense SiTU-GLU if the model has no MoE)
    logits = lm_head(norm(h))               (embedding and LM head SHARED with the backbone, not owned here)

Choices (the K3 report only says the layer "mirrors a backbone block"):
* The block mirrors the backbone's LAST layer, which is always Gated MLA + LatentMoE in the K3 plan. MLA rather
  than KDA because (a) the EAGLE-3 draft is fine-tuned from this layer and a softmax-attention draft needs no
  recurrent-state rollback when drafts are rejected, (b) h_main already carries position/recency from the
  backbone's KDA layers, and MLA (NoPE) adds global content lookup on top.
* Plain pre-norm residuals instead of AttnRes: the layer has a single input stream (h'), so attention over depth
  would have two sources at most; a plain residual is the simplest faithful mirror.
* ``h_main`` is the backbone's final AttnRes aggregation BEFORE the final norm (DeepSeek-V3 feeds the main
  model's last hidden state and normalises it with the MTP's own ``hnorm``).
Shapes: ``[B, T, d]`` throughout. Communication only through ``seq.cp`` (MLA under CP) and the MoE dispatcher.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from k3train.model.block import build_ffn
from k3train.model.mla import MLA
from k3train.model.norm import RMSNorm
from k3train.model.seq import SeqInfo


class MTPLayer(nn.Module):
    """FQNs (under ``mtp``): ``hnorm, enorm, eh_proj, attn_norm, attn, ffn_norm, ffn, norm``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hnorm = RMSNorm(d, eps)
        self.enorm = RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.attn_norm = RMSNorm(d, eps)
        self.attn = MLA(cfg)
        self.ffn_norm = RMSNorm(d, eps)
        self.ffn = build_ffn(cfg, cfg.is_moe_layer(cfg.num_hidden_layers - 1))
        self.norm = RMSNorm(d, eps)

    def forward(self, h_main: torch.Tensor, next_token_emb: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        """``h_main [B, T, d]`` (backbone hidden at t), ``next_token_emb [B, T, d]`` (embedding of token t+1)
        -> normalised hidden ``[B, T, d]`` for the shared LM head (its logits predict token t+2)."""
        return self.norm(self.hidden(h_main, next_token_emb, seq))

    def hidden(self, h_main: torch.Tensor, next_token_emb: torch.Tensor, seq: SeqInfo,
               attend: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """The layer's output BEFORE its final ``norm`` ``[B, T, d]``. ``attend(attn, x)`` (optional) replaces the
        attention's causal computation (``MLA.forward``): the EAGLE-3 draft's training-time test attends over its
        own earlier steps as well (k3train/model/eagle3.py)."""
        h = self.eh_proj(torch.cat([self.hnorm(h_main), self.enorm(next_token_emb)], dim=-1))
        h = h + self.attn(self.attn_norm(h), seq, attend)
        return h + self.ffn(self.ffn_norm(h))
