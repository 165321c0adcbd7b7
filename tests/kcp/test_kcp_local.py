"""KCP tests without processes: segment layout, trailing pairs, fold + adjoint, context input checks."""
from __future__ import annotations

import pytest
import torch
from kcp_cases import LAYOUTS, T_FULL, doc_ids_from_lengths, kda_inputs

from k3train.ops.kda import chunk_kda, kda_transition, naive_kda_transition, naive_recurrent_kda
from kcp import KCPContext
from kcp.fold import SegmentDocs, _all_chains, chain_ranks, fold_adjoint, fold_entry, fold_entry_reference, plan_fold
from kcp.pairs import LocalLayout, augmented_pass, flatten_tokens, trailing_pairs


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
    for d in (docs, one, mixed):  # plan_fold's list walk (every rank's chains at once) is the reference's
        assert _all_chains(d) == [[chain_ranks(d, r, b) for b in range(d.rows)] for r in range(d.cp)]


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
    # reference: the token-loop ops on each row's explicit tail slice (from its last document start)
    M_ref, S_ref = [], []
    for b, start in enumerate([7, 0, 39]):
        k, v, g, beta = (x[n][b:b + 1, start:] for n in ("k", "v", "g", "beta"))
        M_ref.append(naive_kda_transition(k, g, beta)[0])
        S_ref.append(naive_recurrent_kda(k, k, v, g, beta, output_final_state=True)[1][0])
    M_ref, S_ref = torch.stack(M_ref), torch.stack(S_ref)
    torch.testing.assert_close(M, M_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=1e-10)


def test_augmented_pass_equals_pairs_and_entry_state_run() -> None:
    """One widened pass gives the trailing pairs and, after ``o0 + E^T c``, the run with the entry state E."""
    x = kda_inputs(3, 40, seed=2, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 7 + [1] * 33, [2] * 40, [0] * 20 + [1] * 19 + [2]])
    lay = LocalLayout.from_doc_ids(doc_ids)
    o0, transport, M, S = augmented_pass(*(x[n] for n in ("q", "k", "v", "g", "beta")), lay, scale=0.7,
                                         kda_fn=chunk_kda)
    M_ref, S_ref = trailing_pairs(x["k"], x["v"], x["g"], x["beta"], lay, kda_fn=chunk_kda,
                                  transition_fn=kda_transition)
    torch.testing.assert_close(M, M_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=1e-10)
    E = torch.randn(3, 2, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    init = torch.zeros(lay.num_seqs, 2, 8, 8, dtype=torch.float64).index_copy(0, lay.row_first, E)
    o_ref, fin_ref = chunk_kda(*(flatten_tokens(x[n]) for n in ("q", "k", "v", "g", "beta")), scale=0.7,
                               initial_state=init, output_final_state=True, cu_seqlens=lay.cu_seqlens)
    o = o0 + torch.einsum("bthk,bhkv->bthv", transport, E)
    torch.testing.assert_close(o, o_ref.view(3, 40, 2, 8), atol=1e-10, rtol=1e-10)
    # trailing state: M E + S~ where the trailing document is also the first (row 1), S~ otherwise
    own = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64).view(3, 1, 1, 1)
    torch.testing.assert_close(M @ (E * own) + S, fin_ref[lay.row_last], atol=1e-10, rtol=1e-10)


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


def test_context_rejects_bad_input() -> None:
    ctx = KCPContext(None, torch.zeros(2, 8, dtype=torch.long))  # CP size 1: no process group needed
    with pytest.raises(ValueError, match="conv_halo"):
        ctx.conv_halo(torch.zeros(2, 8, 3), -1)
    with pytest.raises(ValueError, match="conv_halo"):
        ctx.conv_halo(torch.zeros(2, 7, 3), 3)
    with pytest.raises(ValueError, match="gather_latent"):
        ctx.gather_latent(torch.zeros(2, 7, 3))
    with pytest.raises(ValueError, match="doc_ids"):
        KCPContext(None, torch.zeros(8, dtype=torch.long))
    # CP size 1 degenerates to the plain layer: no halo, keys = queries
    prev, prev_doc = ctx.conv_halo(torch.ones(2, 8, 3), 3)
    assert bool((prev == 0).all()) and bool((prev_doc == -1).all())
    keys, k_doc, k_pos = ctx.gather_latent(torch.ones(2, 8, 3))
    assert keys.shape == (2, 8, 3) and torch.equal(k_pos, torch.arange(8).expand(2, 8))
