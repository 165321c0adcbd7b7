"""KCP under CP = 2 and 4 (gloo, CPU) against a single process on the full rows.

KDA: every rank computes the single-process chunked KDA itself (full rows, same seed) and compares its own segment
of the output, its end-of-segment state (the reference on the row prefix) and the gradients of q, k, v, g, beta.
The loss weights every output and the last rank's final state, so the backward exercises the whole fold adjoint.
ShortConv halo and MLA latent gather: forward values and input gradients against the same ops on the full rows.
One process spawn per layout runs all the checks (spawns dominate the test time).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from kcp_cases import LAYOUTS, T_FULL, doc_ids_from_lengths, kda_inputs

from k3train.model.conv import causal_depthwise_conv
from k3train.ops.kda import chunk_kda, naive_recurrent_kda
from kcp import KCPContext
from kcp.pairs import LocalLayout, flatten_tokens
from parallel.dims import ParallelDims

NAMES = ("q", "k", "v", "g", "beta")


def _reference(x: dict[str, torch.Tensor], doc_ids: torch.Tensor, w_o: torch.Tensor, w_f: torch.Tensor):
    """Single process, full rows: output, each row's final state, and the input gradients of the test loss."""
    B, T = doc_ids.shape
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    lay = LocalLayout.from_doc_ids(doc_ids)
    o, fin = chunk_kda(*(flatten_tokens(leaves[n]) for n in NAMES), output_final_state=True,
                       cu_seqlens=lay.cu_seqlens)
    o = o.view(B, T, *o.shape[2:])
    fin = fin[lay.row_last]
    ((o * w_o).sum() + (fin * w_f).sum()).backward()
    return o.detach(), fin.detach(), {n: leaves[n].grad for n in NAMES}


def _prefix_state(x: dict[str, torch.Tensor], doc_ids: torch.Tensor, end: int) -> torch.Tensor:
    """Reference state after token ``end - 1`` of every row (its document's state)."""
    lay = LocalLayout.from_doc_ids(doc_ids[:, :end])
    _, fin = chunk_kda(*(flatten_tokens(x[n][:, :end]) for n in NAMES), output_final_state=True,
                       cu_seqlens=lay.cu_seqlens)
    return fin[lay.row_last]


def _check_case(dims: ParallelDims, case: str, dtype: torch.dtype, seed: int, naive_ops: bool = False) -> None:
    cp, r = dims.cp, dims.cp_rank
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10),
           torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]  # bf16: inputs/outputs rounded, states fp32
    doc_ids = doc_ids_from_lengths(LAYOUTS[case])
    B, T = doc_ids.shape[0], T_FULL // cp
    x = kda_inputs(B, T_FULL, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    w_o = torch.randn(x["v"].shape, generator=gen, dtype=dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # chunk_kda's state dtype
    w_f = torch.randn(B, *x["k"].shape[2:], x["v"].shape[-1], generator=gen, dtype=state_dtype)
    o_ref, fin_ref, g_ref = _reference(x, doc_ids, w_o, w_f)

    sl = slice(r * T, (r + 1) * T)
    loc = {n: x[n][:, sl].clone().requires_grad_(True) for n in NAMES}
    positions = torch.arange(T_FULL).expand(B, T_FULL)[:, sl]
    ops = dict(kda_fn=naive_recurrent_kda) if naive_ops else {}
    ctx = KCPContext(dims, doc_ids[:, sl], positions, **ops)
    o, fin = ctx.kda_with_state(*(loc[n] for n in NAMES), output_final_state=True)
    loss = (o * w_o[:, sl]).sum()
    if r == cp - 1:
        loss = loss + (fin * w_f).sum()
    loss.backward()

    where = f"case={case} dtype={dtype} rank={r}/{cp}"
    torch.testing.assert_close(o, o_ref[:, sl], **tol, msg=lambda m: f"output {where}: {m}")
    torch.testing.assert_close(fin, _prefix_state(x, doc_ids, (r + 1) * T), **tol,
                               msg=lambda m: f"segment-end state {where}: {m}")
    if r == cp - 1:
        torch.testing.assert_close(fin, fin_ref, **tol, msg=lambda m: f"final state {where}: {m}")
    for n in NAMES:
        torch.testing.assert_close(loc[n].grad, g_ref[n][:, sl], **tol, msg=lambda m: f"d{n} {where}: {m}")

    # communication: one fixed-size all-gather each way when a document crosses a boundary, none otherwise
    H, K, Vd = x["k"].shape[2], x["k"].shape[3], x["v"].shape[3]
    esz = 8 if dtype == torch.float64 else 4  # pairs and entry gradients travel in the state dtype
    if ctx.plan.any_chain:
        assert ctx.stats.bytes["kda_fwd"] == (cp - 1) * B * H * K * (K + Vd) * esz, where
        assert ctx.stats.bytes["kda_bwd"] == (cp - 1) * B * H * K * Vd * esz, where
    else:
        assert "kda_fwd" not in ctx.stats.bytes and "kda_bwd" not in ctx.stats.bytes, where


def _masked_attention(q, keys, q_doc, q_pos, k_doc, k_pos):
    """Tiny attention over latents with the contract's mask (``key_pos <= query_pos and same document``)."""
    s = q @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_doc[:, None, :] == q_doc[:, :, None])
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ torch.tanh(keys)


def _check_halo(dims: ParallelDims, doc_ids: torch.Tensor, positions: torch.Tensor, ctx: KCPContext) -> None:
    cp, r = dims.cp, dims.cp_rank
    B, T = doc_ids.shape[0], T_FULL // cp
    sl = slice(r * T, (r + 1) * T)
    gen = torch.Generator().manual_seed(1)
    C, K = 6, 4
    x = torch.randn(B, T_FULL, C, generator=gen)
    w = torch.randn(C, 1, K, generator=gen)
    w_y = torch.randn(B, T_FULL, C, generator=gen)
    x_ref = x.clone().requires_grad_(True)
    y_ref = causal_depthwise_conv(x_ref, w, doc_ids)
    (y_ref * w_y).sum().backward()

    x_loc = x[:, sl].clone().requires_grad_(True)
    prev, prev_doc = ctx.conv_halo(x_loc, K - 1)
    if r == 0:
        assert bool((prev == 0).all()) and bool((prev_doc == -1).all())
    else:
        torch.testing.assert_close(prev, x[:, r * T - (K - 1): r * T], atol=0, rtol=0)
        assert torch.equal(prev_doc, doc_ids[:, r * T - (K - 1): r * T])
    y = causal_depthwise_conv(x_loc, w, doc_ids[:, sl], prev, prev_doc)
    (y * w_y[:, sl]).sum().backward()
    torch.testing.assert_close(y, y_ref[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x_loc.grad, x_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    assert ctx.stats.bytes["halo_bwd"] == (B * (K - 1) * C * 4 if r > 0 else 0)


def _check_mla(dims: ParallelDims, doc_ids: torch.Tensor, positions: torch.Tensor, ctx: KCPContext) -> None:
    cp, r = dims.cp, dims.cp_rank
    B, T = doc_ids.shape[0], T_FULL // cp
    sl = slice(r * T, (r + 1) * T)
    gen = torch.Generator().manual_seed(2)
    L = 12
    lat = torch.randn(B, T_FULL, L, generator=gen)
    q = torch.randn(B, T_FULL, L, generator=gen)
    w_o = torch.randn(B, T_FULL, L, generator=gen)
    lat_ref, q_ref = lat.clone().requires_grad_(True), q.clone().requires_grad_(True)
    o_ref = _masked_attention(q_ref, lat_ref, doc_ids, positions, doc_ids, positions)
    (o_ref * w_o).sum().backward()

    lat_loc, q_loc = lat[:, sl].clone().requires_grad_(True), q[:, sl].clone().requires_grad_(True)
    keys, k_doc, k_pos = ctx.gather_latent(lat_loc)
    # the causal prefix: ranks 0..r, in order, with their doc ids and positions
    torch.testing.assert_close(keys, lat[:, : (r + 1) * T], atol=0, rtol=0)
    assert torch.equal(k_doc, doc_ids[:, : (r + 1) * T]) and torch.equal(k_pos, positions[:, : (r + 1) * T])
    o = _masked_attention(q_loc, keys, doc_ids[:, sl], positions[:, sl], k_doc, k_pos)
    (o * w_o[:, sl]).sum().backward()
    torch.testing.assert_close(o, o_ref[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q_loc.grad, q_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lat_loc.grad, lat_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    assert ctx.stats.bytes["mla_fwd"] == (cp - 1) * B * T * L * 4


def _check_halo_and_mla(dims: ParallelDims) -> None:
    T = T_FULL // dims.cp
    for case in ("short_docs", "boundaries"):
        doc_ids = doc_ids_from_lengths(LAYOUTS[case])
        positions = torch.arange(T_FULL).expand(doc_ids.shape[0], T_FULL)
        sl = slice(dims.cp_rank * T, (dims.cp_rank + 1) * T)
        ctx = KCPContext(dims, doc_ids[:, sl], positions[:, sl])
        _check_halo(dims, doc_ids, positions, ctx)
        _check_mla(dims, doc_ids, positions, ctx)


def _body_all_layouts(rank: int, world_size: int) -> None:
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    for i, case in enumerate(sorted(LAYOUTS)):
        _check_case(dims, case, torch.float32, seed=i)
    _check_case(dims, "mixed", torch.float64, seed=11)
    _check_case(dims, "short_docs", torch.float64, seed=12, naive_ops=True)
    _check_case(dims, "mixed", torch.bfloat16, seed=13)
    _check_halo_and_mla(dims)


@pytest.mark.parametrize("cp", [2, 4])
def test_kcp_matches_single_process(cp: int) -> None:
    run_distributed(_body_all_layouts, cp)


def _body_dp_cp(rank: int, world_size: int) -> None:
    # dp=2 x cp=2: the CP groups are {0,1} and {2,3}; each replica runs a different layout (group-local ranks)
    dims = ParallelDims(dp=2, cp=2, world_size=world_size, rank=rank).build_groups()
    assert dims.ranks("cp") == ([0, 1] if rank < 2 else [2, 3])
    _check_case(dims, "one_doc" if dims.dp_rank == 0 else "short_docs", torch.float32, seed=3 + dims.dp_rank)
    _check_halo_and_mla(dims)
    dist.barrier()


def test_kcp_inside_dp_cp_layout() -> None:
    run_distributed(_body_dp_cp, 4)
