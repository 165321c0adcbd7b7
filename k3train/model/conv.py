"""Causal depthwise short convolution (KDA's ShortConv) that never mixes tokens of different documents.

``y[t, c] = sum_{j=0}^{K-1} w[c, 0, K-1-j] * x[t-j, c] * [doc(t-j) == doc(t)]``

(the weight layout and tap order of ``nn.Conv1d(C, C, K, groups=C)`` with K-1 left padding, so checkpoints
move to and from HF-format ShortConvolution weights unchanged). Under context parallelism the first K-1 tokens
of a rank's segment need the last K-1 tokens of the previous rank's segment: the caller passes them as a *halo*
(``prev``, ``prev_doc``), and the document test above drops them when a new document starts at the boundary.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor,
                          prev: torch.Tensor | None = None, prev_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Document-masked causal depthwise conv.

    Args:
        x: ``[B, T, C]`` input.
        weight: ``[C, 1, K]`` depthwise taps (``weight[:, 0, K-1]`` multiplies the current token).
        doc_ids: ``[B, T]`` document id per token.
        prev, prev_doc: optional left halo ``[B, n, C]`` / ``[B, n]`` (n >= K-1 tokens that precede ``x`` in the
            same row, e.g. from the previous CP rank). Halo tokens whose doc id differs from the query token's
            (use -1 for "no previous token") contribute nothing. Without a halo the row starts at ``x[:, 0]``.

    Returns ``[B, T, C]`` in ``x``'s dtype.
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    n = K - 1
    if weight.shape != (C, 1, K):
        raise ValueError(f"conv weight must be [C, 1, K] = [{C}, 1, K], got {tuple(weight.shape)}")
    if prev is None:
        prev = x.new_zeros(B, n, C)
        prev_doc = torch.full((B, n), -1, dtype=doc_ids.dtype, device=doc_ids.device)
    else:
        if prev_doc is None or prev.shape[1] < n or prev_doc.shape != prev.shape[:2]:
            raise ValueError(f"halo must give >= {n} tokens of x and doc ids, got prev {tuple(prev.shape)}"
                             f" and prev_doc {None if prev_doc is None else tuple(prev_doc.shape)}")
        prev, prev_doc = prev[:, prev.shape[1] - n:], prev_doc[:, prev_doc.shape[1] - n:]
    x_ext = torch.cat([prev.to(x.dtype), x], dim=1)  # [B, n+T, C]; x_ext[:, n + t] = x[:, t]
    d_ext = torch.cat([prev_doc.to(doc_ids.dtype), doc_ids], dim=1)
    w = weight[:, 0, :].to(x.dtype)  # [C, K]
    y = x * w[:, K - 1]  # lag 0: the token itself is always in its own document
    for lag in range(1, K):
        shifted = x_ext[:, n - lag:n - lag + T]
        same_doc = (d_ext[:, n - lag:n - lag + T] == doc_ids).unsqueeze(-1).to(x.dtype)
        y = y + shifted * same_doc * w[:, K - 1 - lag]
    return y


class ShortConv(nn.Module):
    """Depthwise causal conv over ``channels`` with ``kernel_size`` taps, document-masked (see module doc).

    Parameter: ``weight [channels, 1, kernel_size]`` (not a matrix: optimised with AdamW, not Muon).
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"model.short_conv_kernel_size must be >= 1, got {kernel_size}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Conv1d's default for a depthwise conv: U(-1/sqrt(K), 1/sqrt(K)) (fan_in = K); init_weights redoes it
        # from the name-seeded generator.
        bound = 1.0 / math.sqrt(self.kernel_size)
        if not self.weight.is_meta:
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor,
                halo: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [B, T, C]``, ``doc_ids [B, T]``, optional ``halo = (prev [B, n, C], prev_doc [B, n])``."""
        prev, prev_doc = halo if halo is not None else (None, None)
        return causal_depthwise_conv(x, self.weight, doc_ids, prev, prev_doc)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}"
