"""Synthetic micro-batches, and one context-parallel rank's real sequence layout without its peers.

:func:`trace_batch` makes the rows the memory estimator traces (and the CPU layer timing runs) when the run's data
cannot be read, one document per row; :func:`cp_rank_seq` builds the real KCP context of one CP rank the way the
run builds it -- every CP rank of the group as a thread of this process, exchanging real values through
:func:`~k3train.planning.fakerun.sim_collectives.run_ranks` -- and re-points it at a board-less
:class:`~k3train.planning.fakerun.sim_collectives.SimGroup`, so the traced or timed step runs that rank alone.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from k3train.config import Config
from k3train.data.batch import Batch
from k3train.model.seq import SeqInfo
from k3train.parallelize import seq_builder
from k3train.planning.fakerun.sim_collectives import SimGroup, run_ranks, simulated_collectives


def trace_batch(cfg: Config, B: int, T: int, cp_rank: int = 0, doc_len: int = 0) -> tuple[Any, str]:
    """A synthetic micro-batch ``[B, T]``, one document per row (the least chunked-KDA padding), for runs
    whose data cannot be read yet (planning) and the per-layer traces of long sequences; under CP the
    ``cp_rank``-th segment of each row (positions ``cp_rank*T ...``, the row's one document crossing it).

    ``doc_len > 0`` (dividing T): documents of ``doc_len`` tokens instead, numbered on from the earlier CP
    segments'. What the per-layer traces of the MLA attention use: the blockwise op's bytes do not depend on which
    blocks the mask empties (every computed block allocates the same transients, the key-side tensors are sized by
    the keys), only its time does, and with one document per block it computes one block per query block instead
    of the causal triangle of a 1M-token row (hours of fake ops)."""
    g = torch.Generator().manual_seed(0)
    samples = torch.randint(3, max(4, cfg.model.vocab_size), (B, T + 1), generator=g)
    samples[samples == cfg.model.eos_token_id] = 3
    if doc_len > 0:
        samples[:, doc_len - 1:T:doc_len] = cfg.model.eos_token_id
    batch = Batch.from_samples(samples, eos_id=cfg.model.eos_token_id, pad_id=cfg.model.pad_token_id)
    if cp_rank:
        batch = dataclasses.replace(batch, positions=batch.positions + cp_rank * T)
        if doc_len > 0:
            batch = dataclasses.replace(batch, doc_ids=batch.doc_ids + cp_rank * (T // doc_len))
    return batch, "a synthetic (one document per row)"


def single_rank_cp(ctx: Any, rank: int, size: int) -> Any:
    """The KCP context of one thread-rank, re-pointed at a board-less group: the traced step runs that rank
    alone (its float collectives simulated by replication)."""
    ctx.group = SimGroup(size, rank, "cp")
    return ctx


def cp_rank_seq(cfg: Config, rows: list[Any], rank: int) -> SeqInfo:
    """The real KCP sequence layout of CP rank ``rank`` (``rows``: every CP rank's segment of the micro-batch's
    rows), built by all CP ranks as threads with their collectives simulated, then re-pointed at a board-less
    group (:func:`single_rank_cp`)."""
    C = cfg.parallel.cp
    with simulated_collectives():
        ctx_seq = run_ranks(C, lambda g: seq_builder(cfg, C, g)(rows[g.rank]), "cp")[rank]
    return SeqInfo(ctx_seq.doc_ids, ctx_seq.positions, ctx_seq.cu_seqlens, single_rank_cp(ctx_seq.cp, rank, C))
