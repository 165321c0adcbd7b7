"""KCP: KDA context parallelism (and the MLA / ShortConv pieces that come with it).

Public API:
    :class:`KCPContext` -- per-micro-batch object implementing ``conv_halo``, ``kda``, ``gather_latent`` (set as
        ``SeqInfo.cp``); built collectively over ``dims.group('cp')``.
    :func:`kcp.kda_cp.kcp_chunk_kda` -- the KDA composition on explicit layout / plan objects.
    :mod:`kcp.fold` -- the document-aware prefix fold and its adjoint (pure tensor math, no communication).
"""
from kcp.comm import CommStats
from kcp.context import KCPContext
from kcp.kda_cp import kcp_chunk_kda

__all__ = ["KCPContext", "CommStats", "kcp_chunk_kda"]
