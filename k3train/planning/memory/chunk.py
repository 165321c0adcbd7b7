"""One local chunk on one micro-batch: traced whole, or composed from its pieces."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.model import CE_CHUNK_TOKENS
from k3train.planning.dtypes import train_dtype
from k3train.planning.memory.buffers import plan_bytes
from k3train.planning.memory.compose import compose, whole_traces
from k3train.planning.memory.limits import TraceTooBig, check_deadline
from k3train.planning.memory.media import MediaCase
from k3train.planning.memory.pieces import layer_signature, piece_layers, trace_piece
from k3train.planning.memory.results import ChunkTrace
from k3train.planning.memory.run_data import segments
from k3train.planning.memory.trace import trace_range
from parallel.pipeline.stage import recompute_unit


def trace_chunk(cfg: Config, model: nn.Module, part: Any, plan: Any, v: int, chunk: int, batch: Any,
                fake: FakeTensorMode, cache: dict | None = None, batch_hi: Any = None,
                cp_rank: int = 0, rows: tuple[Any, Any] = (None, None),
                media: MediaCase | None = None, deadline: float | None = None,
                limit: float | None = None, in_flight: int = 1, whole: bool | None = None) -> ChunkTrace:
    """Virtual stage ``v`` on one micro-batch of CP rank ``cp_rank`` (see :func:`trace_range`; composed per layer
    above ``TRACE_BUDGET``, ``cache`` holding the per-signature fits).

    Under CP the real KCP context runs with simulated collectives. Composed traces are taken at CP ranks 0 and 1
    and extended to rank r affinely in the MLA key segments of the rank (:func:`~.pieces.mla_key_segments`: every key-side
    byte -- the latent keys, their doc ids, the latent gradient -- grows linearly with them; the KCP pairs are the
    whole group's on every rank). ``deadline``: :class:`TraceDeadline` before any trace that starts after it;
    ``limit``: :class:`TraceTooBig` as soon as the pieces composed so far exceed it, or their saved bytes times
    ``in_flight`` (the forwards of this chunk the schedule runs before the rank's first backward, each holding
    as much) do (composed traces only). ``whole``: trace the chunk whole (True) or compose it (False) whatever
    :func:`whole_traces` says."""
    s, e = part.bounds[v]
    first, last = v == 0, v == part.num_stages - 1
    d = cfg.model.hidden_size
    dtype = train_dtype(cfg)
    B, T = batch.tokens.shape
    recompute = cfg.parallel.recompute
    hi = None
    if whole_traces(cfg, B, T) if whole is None else whole:
        check_deadline(deadline)
        saved, f_peak, b_peak = trace_range(cfg, model, s, e, first, last, batch, fake, recompute, cp_rank, rows[0],
                                            media)
        if batch_hi is not None:
            hi = trace_range(cfg, model, s, e, first, last, batch_hi, fake, recompute, cp_rank, rows[1], media)
    else:
        saved, f_peak, b_peak = _composed(cfg, model, fake, {} if cache is None else cache, (s, e), first, last,
                                          (B, T), cp_rank, media, deadline, limit, in_flight)
    recv = plan_bytes(plan, v - 1, B, T, d, dtype) if not first else 0
    grad_msg = plan_bytes(plan, v, B, T, d, dtype) if not last else 0
    return ChunkTrace(chunk=chunk, stage=v, layers=(s, e), saved=saved, f_peak=f_peak, b_peak=b_peak,
                      recv=recv, grad_msg=grad_msg, seg_lo=segments(batch, cfg.model.kda_chunk_size),
                      seg_hi=segments(batch_hi if batch_hi is not None else batch, cfg.model.kda_chunk_size),
                      hi=hi)


def _composed(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, layers: tuple[int, int], first: bool,
              last: bool, shape: tuple[int, int], cp_rank: int, media: MediaCase | None, deadline: float | None,
              limit: float | None, in_flight: int) -> tuple[int, int, int]:
    """``(saved, f_peak, b_peak)`` of a chunk (``layers``, on a ``shape`` micro-batch) composed from its pieces in
    order (:func:`trace_chunk`)."""
    (s, e), (B, T) = layers, shape
    L = cfg.model.num_hidden_layers
    recompute = cfg.parallel.recompute
    unit = recompute_unit(cfg, recompute)
    chunk_rc = recompute and unit is None  # the whole chunk one region: pieces traced without recomputation
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    reps = piece_layers(cfg)

    def piece(key: tuple, a: int, b: int, fst: bool, lst: bool, sub: str | None = None,
              chunks: tuple[int, ...] = (), kind: str = "") -> tuple[int, int, int]:
        return trace_piece(cfg, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                           cp_rank=cp_rank, media=media, deadline=deadline)

    pieces: list[tuple[int, int, int]] = []

    def add(p: tuple[int, int, int]) -> None:
        pieces.append(p)
        if limit is not None:
            saved_so_far, f_so_far, b_so_far = compose(pieces)
            if chunk_rc:  # the chunk keeps only its inputs (below): its forward holds one piece's transient at a
                # time, its backward the recomputed pieces so far; nothing of it stays in flight
                held = max(max(f for _, f, _ in pieces), b_so_far)
            else:
                held = max(f_so_far, b_so_far, in_flight * saved_so_far)
            if held > limit:
                raise TraceTooBig(held)

    if first:
        add(piece(("embed",), 0, 0, True, False))
    for i in range(s, e):
        sig = layer_signature(cfg, i)
        kind = cfg.model.layer_kind(i)
        moe = (moe_chunk,) if cfg.model.is_moe_layer(i) else ()
        if unit == "sublayer":  # a mixer's bytes depend on its kind and sources, an FFN's on dense / MoE and
            # sources: the deepest layer of each (the most AttnRes sources) is traced for all (an FFN that
            # completes a block holds no more: its partial sum becomes the block)
            mkey, fkey = ("mixer", kind), ("ffn", sig[1])
            add(piece(mkey, reps[mkey], reps[mkey] + 1, False, False, "mixer", (), kind))
            add(piece(fkey, reps[fkey], reps[fkey] + 1, False, False, "ffn", moe))
        else:  # the MoE's token chunks run without recomputation inside a layer / chunk: traced whole
            r = reps[sig]
            add(piece(("layer",) + sig, r, r + 1, False, False, None, (), kind))
    if last:
        # the LM head + MTP cross-entropy in token chunks, the MTP layer's MoE; the MTP's MLA on short documents
        add(piece(("head",), L, L, False, True, None, (CE_CHUNK_TOKENS,) + (moe_chunk,), "mla"))
    saved, f_peak, b_peak = compose(pieces)
    if chunk_rc:  # the chunk keeps only its inputs; its backward re-runs the forward (already in b_peak)
        saved, f_peak = 0, max(f for _, f, _ in pieces)
    return saved, f_peak, b_peak
