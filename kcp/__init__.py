"""KCP: KDA context parallelism (and the MLA / ShortConv pieces that come with it).

Public API:
    :class:`KCPContext` -- per-micro-batch object implementing ``conv_halo``, ``kda``, ``gather_latent`` (set as
        ``SeqInfo.cp``); built collectively over ``dims.group('cp')``.
    :func:`kcp.kda_cp.kcp_chunk_kda` -- the KDA composition on explicit layout / plan objects.
    :mod:`kcp.fold` -- the document-aware prefix fold and its adjoint (pure tensor math, no communication).
    :class:`kcp.vision_cp.VisionCPContext` -- the vision encoder's share of a micro-batch's media (set as
        ``Batch.vision_cp``; large media split by patch rows with exact attention, :func:`plan_vision_split`).
"""
from kcp.comm import CommStats
from kcp.context import KCPContext
from kcp.kda_cp import kcp_chunk_kda
from kcp.vision_cp import VisionCPContext, plan_vision_split

__all__ = ["KCPContext", "CommStats", "kcp_chunk_kda", "VisionCPContext", "plan_vision_split"]
