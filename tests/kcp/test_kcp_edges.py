"""KCP's segment edge summaries (kcp/edges.py): what every rank learns of the other segments from ``[B, 5]`` int64
per rank equals what it derived from all-gathering every doc id and position (the fold's facts exactly; doc ids
the same under equality with this rank's; positions exactly); the exchange is fixed-size whatever the documents
and the sequence length; and malformed doc ids make EVERY rank raise, never some ranks only."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from kcp_cases import HANG_LAYOUTS, LAYOUTS, doc_ids_from_lengths
from kcp_checks import seen_by

from kcp import KCPContext
from kcp.edges import EDGE_FIELDS, SegmentEdges, local_edges
from kcp.fold import SegmentDocs


def _edges(doc_ids: torch.Tensor, cp: int) -> SegmentEdges:
    B, t_full = doc_ids.shape
    T = t_full // cp
    pos = torch.arange(t_full).expand(B, t_full)
    per_rank = [local_edges(doc_ids[:, r * T:(r + 1) * T], pos[:, r * T:(r + 1) * T]) for r in range(cp)]
    return SegmentEdges.from_gathered(torch.stack(per_rank), T)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_edges_give_what_the_full_gather_gave(cp: int) -> None:
    layouts = list(LAYOUTS.values()) if cp != 3 else []
    layouts += list(HANG_LAYOUTS.get(cp, {}).values())
    for rows in layouts:
        t_full = sum(rows[0])
        doc_ids = doc_ids_from_lengths(rows, t_full)
        B, T = doc_ids.shape[0], t_full // cp
        edges = _edges(doc_ids, cp)
        full = doc_ids.view(B, cp, T).transpose(0, 1)  # what every rank used to all-gather
        docs, want = edges.segment_docs(), SegmentDocs.from_doc_ids(full)
        for f in ("first", "last", "inner_start"):
            assert torch.equal(getattr(docs, f), getattr(want, f)), (rows, f)
        for r in range(cp):
            seen = edges.seen_doc_ids(r, full[r])
            assert torch.equal(seen[r], full[r])
            for j in range(r):  # earlier segments: exact on r's first document, -1 elsewhere
                assert torch.equal(seen[j], seen_by(full[j], full[r][:, 0])), (rows, r, j)
            assert torch.equal(edges.positions(r, torch.device("cpu")).transpose(0, 1).reshape(B, -1),
                               torch.arange((r + 1) * T).expand(B, -1))


def _body(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    with trace_collectives() as trace:
        for t_full, rows in ((64, LAYOUTS["short_docs"]), (64, LAYOUTS["one_doc"]), (256, [[256], [3, 250, 3]])):
            T = t_full // world
            doc_ids = doc_ids_from_lengths(rows, t_full)[:, rank * T:(rank + 1) * T]
            for balance in (False, True):
                ctx = KCPContext(group, doc_ids, mla_balance=balance)
                # fixed size: the [B, T] shape and one [B, 5] summary per rank, whatever T and the documents; with
                # the MLA causal balance (kcp/mla_cp.py) also the [B, T] doc ids swapped with the balance partner
                swap = doc_ids.numel() * 8 if balance else 0
                assert ctx.stats.bytes["layout"] == (world - 1) * (2 + 2 * len(EDGE_FIELDS)) * 8 + swap, \
                    (balance, ctx.stats.bytes)
        # malformed input on ONE rank (decreasing doc ids): every rank raises, and the group stays in step
        bad = torch.tensor([[0, 0, 1, 1]] * 2) if rank else torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]])
        with pytest.raises(ValueError, match=r"non-decreasing doc ids"):
            KCPContext(group, bad)
        # doc ids falling across the boundary (rank 1 restarts the numbering)
        with pytest.raises(ValueError, match="decrease across a CP segment boundary"):
            KCPContext(group, torch.tensor([[5, 5]]) if rank == 0 else torch.tensor([[0, 0]]))
        t = torch.ones(1)
        dist.all_reduce(t)
    assert t.item() == world
    assert_collectives_match(trace)


def test_fixed_size_exchange_and_errors_on_every_rank() -> None:
    run_distributed(_body, 2, timeout=120)
