"""Pure-logic KCP tests (no processes): segment layout, trailing pairs, the vectorised fold and its adjoint."""
from __future__ import annotations

import pytest
import torch
from kcp_cases import LAYOUTS, T_FULL, doc_ids_from_lengths, kda_inputs

from k3train.ops.kda import chunk_kda, kda_transition
from kcp.fold import SegmentDocs, chain_ranks, fold_adjoint, fold_entry, fold_entry_reference, plan_fold
from kcp.pairs import LocalLayout, pairs_reference, trailing_pairs


def test_chain_ranks_by_hand() -> None:
    # cp=4, T=16: row 0 docs [0..16) [16..32) [32..64); row 1 one doc over all ranks; row 2 docs start inside.
    doc_ids = doc_ids_from_lengths(LAYOUTS["boundaries"])  # rows: [16,16,32], [32,32]
    docs = SegmentDocs.from_doc_ids(doc_ids.view(2, 4, 16).transpose(0, 1))
    assert [chain_ranks(docs, r, 0) for r in range(4)] == [[], [], [], [2]]
    assert [chain_ranks(docs, r, 1) for r in range(4)] == [[], [0], [], [2]]
    one = SegmentDocs.from_doc_ids(doc_ids_from_lengths(LAYOUTS["one_doc"]).view(2, 4, 16).transpose(0, 1))
    assert [chain_ranks(one, r, 0) for r in range(4)] == [[], [0], [0, 1], [0, 1, 2]]
    mixed = SegmentDocs.from_doc_ids(doc_ids_from_lengths(LAYOUTS["mixed"]).view(2, 4, 16).transpose(0, 1))
    # row 0: docs of 3,3,3 then one of 55 starting at 9 inside rank 0 -> chains through rank 0 (inner start)
    assert [chain_ranks(mixed, r, 0) for r in range(4)] == [[], [0], [0, 1], [0, 1, 2]]
    # row 1: [0,40) [40,57) [57,64): rank 2 starts inside doc 0, doc 1 starts inside rank 2
    assert [chain_ranks(mixed, r, 1) for r in range(4)] == [[], [0], [0, 1], [2]]


def test_local_layout() -> None:
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5], [1, 2, 3, 4, 5, 6]])
    lay = LocalLayout.from_doc_ids(doc_ids)
    assert lay.cu_seqlens.tolist() == [0, 2, 5, 6, 12, 13, 14, 15, 16, 17, 18]
    assert lay.row_first.tolist() == [0, 3, 4]
    assert lay.row_last.tolist() == [2, 3, 9]
    assert lay.trail_start.tolist() == [5, 0, 5]
    assert lay.trail_index.tolist() == [5] + list(range(6, 12)) + [17]
    assert lay.trail_cu.tolist() == [0, 1, 7, 8]


def test_trailing_pairs_match_token_loop() -> None:
    x = kda_inputs(3, 40, seed=1, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 7 + [1] * 33, [2] * 40, [0] * 39 + [1]])
    lay = LocalLayout.from_doc_ids(doc_ids)
    M, S = trailing_pairs(x["k"], x["v"], x["g"], x["beta"], lay, kda_fn=chunk_kda, transition_fn=kda_transition)
    M_ref, S_ref = pairs_reference(x["k"], x["v"], x["g"], x["beta"], lay)
    torch.testing.assert_close(M, M_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=1e-10)


def _random_pairs(cp: int, B: int, H: int = 2, K: int = 4, V: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    Ms = 0.5 * torch.randn(cp, B, H, K, K, generator=gen, dtype=torch.float64)
    Ss = torch.randn(cp, B, H, K, V, generator=gen, dtype=torch.float64)
    return Ms, Ss


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_fold_and_adjoint_match_autograd(cp: int, case: str) -> None:
    doc_ids = doc_ids_from_lengths(LAYOUTS[case])
    B = doc_ids.shape[0]
    docs = SegmentDocs.from_doc_ids(doc_ids.view(B, cp, T_FULL // cp).transpose(0, 1))
    Ms, Ss = _random_pairs(cp, B)
    Ms.requires_grad_(True)
    Ss.requires_grad_(True)
    # reference: every rank's entry state by the per-row loop; loss = sum_i <G_i, E_i>
    Es = torch.stack([fold_entry_reference(Ms, Ss, docs, r) for r in range(cp)])
    Gs = torch.randn(Es.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    # (+ 0 * ...: layouts without any cross-rank document give E = 0 with no graph; gradients are then zero)
    dM_ref, dS_ref = torch.autograd.grad((Es * Gs).sum() + 0 * (Ms.sum() + Ss.sum()), (Ms, Ss))
    for r in range(cp):
        plan = plan_fold(docs, r)
        E = fold_entry(Ms.detach(), Ss.detach(), plan)
        torch.testing.assert_close(E, Es[r].detach(), atol=1e-12, rtol=1e-12)
        A = fold_adjoint(Ms.detach()[r + 1:], Gs, plan)
        e_own = E * plan.own_entry_used.double().view(-1, 1, 1, 1)
        torch.testing.assert_close(A, dS_ref[r], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(A @ e_own.transpose(-1, -2), dM_ref[r], atol=1e-12, rtol=1e-12)
        # the pair of rank r is needed by r+1 exactly when it appears in r+1's chain
        if r + 1 < cp:
            assert plan.needs_pairs.tolist() == [r in chain_ranks(docs, r + 1, b) for b in range(B)]


def test_no_cross_rank_document_means_no_chain() -> None:
    doc_ids = doc_ids_from_lengths([[16, 16, 16, 16], [8, 8, 16, 16, 16]])
    docs = SegmentDocs.from_doc_ids(doc_ids.view(2, 4, 16).transpose(0, 1))
    assert not plan_fold(docs, 3).any_chain
    docs2 = SegmentDocs.from_doc_ids(doc_ids_from_lengths([[16, 16, 16, 16], [24, 40]]).view(2, 4, 16)
                                     .transpose(0, 1))
    assert all(plan_fold(docs2, r).any_chain for r in range(4))  # every rank agrees
