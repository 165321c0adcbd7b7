"""KCP never hangs (issue 10): cp = 3 and 4 on the layouts that used to hang, and segments shorter than the halo.

Defect 1: a CP segment that neither receives state (it starts at a document start) nor passes it on (its last
document ends at the segment end) made the rank's output independent of the folded entry state, so autograd
skipped that rank's backward all-gather and the other ranks waited forever. Defect 2: segments shorter than the
ShortConv halo (``seq_len / cp < kernel - 1``) raised in ``conv_halo``. Here every layout of
``kcp_cases.HANG_LAYOUTS`` runs the model's call pattern (``conv_halo`` then ``kda`` with outputs only, and the MLA
latent gather) on gloo ranks, compares outputs and every input gradient with the single process at fp32 tight
tolerance, and checks with :mod:`collective_trace` that every rank made the same collectives in the same order.
"""
from __future__ import annotations

import pytest
import torch
from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from kcp_cases import HANG_LAYOUTS
from kcp_checks import check_halo_and_mla, check_kda

from kcp.fold import SegmentDocs, plan_fold
from parallel.dims import ParallelDims


def isolated_ranks(docs: SegmentDocs) -> list[int]:
    """CP ranks that neither receive an entry state nor have a pair read by the next rank (in every row)."""
    out = []
    for r in range(docs.cp):
        plan = plan_fold(docs, r)
        if not bool((plan.fwd_b[:r] != 0).any()) and not bool(plan.needs_pairs.any()):
            out.append(r)
    return out


def _body(rank: int, world_size: int) -> None:
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    cp_ranks = dims.ranks("cp")
    expected = {"all_gather_single": 0, "reduce_scatter_single": 0, "all_to_all_single": 0}
    covered_hang = False
    with trace_collectives() as trace:
        for i, (name, rows) in enumerate(sorted(HANG_LAYOUTS[world_size].items())):
            # the model's pattern: outputs only (no final state), so nothing but the tie consumes the entry state
            ctx = check_kda(dims, rows, torch.float32, seed=20 + i, name=name, with_state=False)
            check_halo_and_mla(dims, rows)
            isolated = isolated_ranks(ctx.docs)
            covered_hang |= ctx.plan.any_chain and bool(isolated)
            # three contexts (2 layout gathers each), KDA pairs + entry gradients when some document crosses,
            # the halo and two MLA gathers (balanced and not) forward, their reduce-scatters backward; each balanced
            # context's doc-id exchange with its partner (two of them) and the query/output swaps, two each way --
            # identical on every rank (the middle rank of cp = 3 swaps with itself)
            expected["all_gather_single"] += 6 + (2 if ctx.plan.any_chain else 0) + 3
            expected["reduce_scatter_single"] += 3
            expected["all_to_all_single"] += 2 + 4
    assert covered_hang, "no layout has an isolated segment next to a carried state: the test lost its point"
    for op, n in expected.items():
        assert trace.count(op, group=cp_ranks) == n, (op, trace.count(op, group=cp_ranks), n)
    assert_collectives_match(trace)


@pytest.mark.parametrize("cp", [3, 4])
def test_kcp_hang_layouts_match_single_process(cp: int) -> None:
    run_distributed(_body, cp, timeout=120)
