"""Gated MLA under context parallelism: all-gather of the compressed per-token latent, causal prefix only.

MLA caches one latent per token (``kv_lora_rank + qk_rope_head_dim`` = 576 numbers in K3) from which keys and
values of all heads are re-expanded, so the cheapest exchange is the latent itself: ONE all-gather of
``[B, T, 576]`` over the CP group per MLA layer (``(cp-1) * B * T * 576`` elements per rank), against
``B * T * H * (192 + 128)`` for gathering expanded K and V (53x more in K3).

Balancing decision: segments stay CONTIGUOUS (KDA needs contiguous segments, and re-permuting for MLA alone would
cost two extra all-to-alls of query-side activations per MLA layer -- at least a q latent (1536) out and the
gated output (7168) back per moved token, i.e. about 7x the latent gather for cp = 2). Each rank returns only the
keys of ranks 0..r (its causal prefix): keys of later ranks would be fully masked, so returning them would double
the average score work for nothing. Causal work is then proportional to r+1: the last rank does ``cp`` units,
the mean is ``(cp+1)/2``, an imbalance of ``2cp/(cp+1)`` (1.33 at cp=2, 1.6 at cp=4, < 2 always) on the MLA
layers only -- a quarter of the layers -- and smaller in practice because document masking removes most
cross-segment work for packed documents shorter than a segment. A zigzag layout for MLA queries is the upgrade
if long single documents make MLA the critical path.

Backward: rank r holds ``dL/dlatent_prefix [B, (r+1)T, L]``; rank j's latent gradient is the sum over ranks of
their slice j. ONE reduce-scatter over the CP group of the zero-padded ``[cp, B, T, L]`` gradient
(:func:`kcp.comm.all_gather_autograd`). Hang safety: the prefix always holds the rank's own segment (ranks
0..r, never empty), which its own queries attend to, so the reduce-scatter runs on every rank whenever the
layer output is used; the gather itself is unconditional.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from kcp.comm import CommStats, all_gather_autograd, group_size_rank


def gather_latent_prefix(latent: Tensor, key_doc_ids: Tensor, key_positions: Tensor, group: Any,
                         stats: CommStats | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """All-gather this rank's MLA latents over the CP group, keep the causal prefix.

    Args: latent ``[B, T, L]``; key_doc_ids / key_positions ``[B, (r+1)*T]`` the prefix's doc ids and row
    positions (precomputed once per micro-batch by :class:`kcp.KCPContext` from the segment edge summaries,
    :mod:`kcp.edges`: earlier segments' keys carry their exact id where they belong to the document this rank's
    segment opens with -- the only one a local query can share -- and -1 elsewhere; positions are exact).
    Returns ``(latent_prefix [B, (r+1)*T, L], key_doc_ids, key_positions)``; mask with
    ``key_pos <= query_pos and key_doc == query_doc``. Collective over ``group`` (all-gather fwd, reduce-scatter bwd).
    """
    if latent.dim() != 3:
        raise ValueError(f"gather_latent: latent must be [B, T, L], got {tuple(latent.shape)}")
    _, rank = group_size_rank(group)
    B, T, L = latent.shape
    allv = all_gather_autograd(latent, group, stats, "mla_fwd", "mla_bwd")  # [cp, B, T, L]
    out = allv[: rank + 1].transpose(0, 1).reshape(B, (rank + 1) * T, L)
    if out.shape[1] != key_doc_ids.shape[1]:
        raise ValueError(f"gather_latent: latent gives {out.shape[1]} keys but the context has "
                         f"{key_doc_ids.shape[1]} (was the context built for this micro-batch?)")
    return out, key_doc_ids, key_positions
