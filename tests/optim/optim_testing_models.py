"""Small real modules for the optimizer tests (not the K3 model: these tests must not depend on it).

``CausalAttention`` is a plain causal softmax attention with per-head q/k/v projections marked for Per-Head Muon
and the QK-Clip protocol (``qk_max`` buffer + ``qk_clip_params()``). ``TinyNet`` mixes every parameter kind the
optimizer distinguishes: embedding and LM head (AdamW by pattern), plain matrices, per-head and segmented per-head
matrices, stacked 3-D "experts", vectors, a degenerate conv kernel, a frozen parameter and a buffer.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from k3train.optim.param_groups import mark_per_head


class CausalAttention(nn.Module):
    """``x[B, T, d] -> [B, T, d]``; tracks the running max pre-softmax logit per head in ``qk_max`` [H]."""

    def __init__(self, d: int, heads: int, head_dim: int):
        super().__init__()
        self.h, self.dh = heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            mark_per_head(lin.weight, heads)
        self.register_buffer("qk_max", torch.zeros(heads), persistent=False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Masked pre-softmax logits ``[B, H, T, T]`` (-inf above the diagonal)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.dh).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.h, self.dh).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        return s.masked_fill(mask, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.logits(x)
        if self.training:
            with torch.no_grad():
                self.qk_max.copy_(torch.maximum(self.qk_max, s.amax(dim=(0, 2, 3))))
        v = self.v_proj(x).view(b, t, self.h, self.dh).transpose(1, 2)
        o = torch.softmax(s, dim=-1) @ v
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.dh))

    def qk_clip_params(self):
        return [(self.q_proj.weight, self.h, self.dh, 0, self.dh, "q"),
                (self.k_proj.weight, self.h, self.dh, 0, self.dh, "k")]


class TinyNet(nn.Module):
    """Token model using every parameter kind; ``loss_sum(tokens[B, T]) -> scalar`` (sum over tokens)."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, head_dim: int = 8, experts: int = 4,
                 seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.attn = CausalAttention(d, heads, head_dim)
        self.kv = nn.Linear(d, heads * (3 + 5), bias=False)  # per head: 3 "k" rows then 5 "v" rows
        mark_per_head(self.kv.weight, heads, segments=(3, 5))
        self.mix = nn.Linear(heads * 8, d)  # plain matrix + bias (vector)
        self.experts = nn.Parameter(torch.empty(experts, d, 6))  # stacked [E, d, f]
        self.expert_out = nn.Parameter(torch.empty(experts, 6, d))
        self.conv = nn.Parameter(torch.empty(d, 1, 3))  # depthwise kernel: degenerate -> AdamW
        self.norm = nn.Parameter(torch.ones(d))
        self.frozen = nn.Parameter(torch.ones(d, d), requires_grad=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("router_bias", torch.zeros(experts))
        with torch.no_grad():
            for p in self.parameters():
                if p.requires_grad and p is not self.norm:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim >= 2 else 0.1))
        self.to(dtype)

    def loss_sum(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)                                           # [B, T, d]
        x = x + torch.nn.functional.conv1d(x.transpose(1, 2), self.conv, padding=1, groups=x.shape[-1]
                                           ).transpose(1, 2)
        x = x + self.attn(x)
        x = x + self.mix(self.kv(x))
        e = torch.einsum("btd,edf->btef", x, self.experts).relu()
        x = x + torch.einsum("btef,efd->btd", e, self.expert_out) / e.shape[2]
        x = x * self.norm * self.frozen.diagonal()
        logits = self.lm_head(x).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 reduction="sum")


def tiny_batch(seed: int, batch: int = 2, seq: int = 6, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]
