"""KCP checks run inside every rank of a CP group against the single-process ops on the full rows.

Each check builds the same full-row inputs on every rank (same seed), runs the reference on them itself and
compares its own segment: outputs, states, and the gradients of every input (fp32 / fp64 tight tolerance).
Used by the cp = 2/4 tests (``test_kcp_dist.py``) and the hang-layout tests at cp = 3/4 (``test_kcp_no_hang.py``).
"""
from __future__ import annotations

import torch
from kcp_cases import doc_ids_from_lengths, kda_inputs

from k3train.model.conv import causal_depthwise_conv
from k3train.ops.kda import chunk_kda, naive_recurrent_kda
from kcp import KCPContext
from kcp.pairs import LocalLayout, flatten_tokens
from parallel.dims import ParallelDims

NAMES = ("q", "k", "v", "g", "beta")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}  # bf16: inputs/outputs rounded, states fp32


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


def check_kda(dims: ParallelDims, rows: list[list[int]], dtype: torch.dtype, seed: int, naive_ops: bool = False,
              name: str = "", with_state: bool = True) -> KCPContext:
    """KCP's KDA on this rank's segment of ``rows`` (per-row document lengths) against the full-row op.

    ``with_state``: the loss also weights the last rank's final state (``kda_with_state``); otherwise only the
    outputs through :meth:`KCPContext.kda`, as the model layer calls it. Returns the context (for its stats).
    """
    cp, r = dims.cp, dims.cp_rank
    tol = TOL[dtype]
    t_full = sum(rows[0])
    doc_ids = doc_ids_from_lengths(rows, t_full)
    B, T = doc_ids.shape[0], t_full // cp
    x = kda_inputs(B, t_full, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    w_o = torch.randn(x["v"].shape, generator=gen, dtype=dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # chunk_kda's state dtype
    w_f = torch.randn(B, *x["k"].shape[2:], x["v"].shape[-1], generator=gen, dtype=state_dtype)
    if not with_state:
        w_f = torch.zeros_like(w_f)
    o_ref, fin_ref, g_ref = _reference(x, doc_ids, w_o, w_f)

    sl = slice(r * T, (r + 1) * T)
    loc = {n: x[n][:, sl].clone().requires_grad_(True) for n in NAMES}
    positions = torch.arange(t_full).expand(B, t_full)[:, sl]
    ops = dict(kda_fn=naive_recurrent_kda) if naive_ops else {}
    ctx = KCPContext(dims, doc_ids[:, sl], positions, **ops)
    if with_state:
        o, fin = ctx.kda_with_state(*(loc[n] for n in NAMES), output_final_state=True)
    else:
        o, fin = ctx.kda(*(loc[n] for n in NAMES), scale=None), None
    loss = (o * w_o[:, sl]).sum()
    if with_state and r == cp - 1:
        loss = loss + (fin * w_f).sum()
    loss.backward()

    where = f"case={name} dtype={dtype} rank={r}/{cp}"
    torch.testing.assert_close(o, o_ref[:, sl], **tol, msg=lambda m: f"output {where}: {m}")
    if with_state:
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
    return ctx


def seen_by(earlier_doc: torch.Tensor, first_doc: torch.Tensor) -> torch.Tensor:
    """Doc ids ``[B, n]`` of tokens before a segment as KCP reports them to it: exact where they belong to the
    segment's first document ``first_doc [B]``, -1 elsewhere (see kcp/edges.py)."""
    return torch.where(earlier_doc == first_doc[:, None], earlier_doc, torch.full_like(earlier_doc, -1))


def _masked_attention(q, keys, q_doc, q_pos, k_doc, k_pos):
    """Tiny attention over latents with the contract's mask (``key_pos <= query_pos and same document``)."""
    s = q @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_doc[:, None, :] == q_doc[:, :, None])
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ torch.tanh(keys)


def check_halo(dims: ParallelDims, doc_ids: torch.Tensor, ctx: KCPContext, K: int = 4) -> None:
    """ShortConv through ``ctx.conv_halo`` (kernel K, any segment length) against the conv on the full rows."""
    cp, r = dims.cp, dims.cp_rank
    B, t_full = doc_ids.shape
    T = t_full // cp
    sl = slice(r * T, (r + 1) * T)
    gen = torch.Generator().manual_seed(1)
    C = 6
    x = torch.randn(B, t_full, C, generator=gen)
    w = torch.randn(C, 1, K, generator=gen)
    w_y = torch.randn(B, t_full, C, generator=gen)
    x_ref = x.clone().requires_grad_(True)
    y_ref = causal_depthwise_conv(x_ref, w, doc_ids)
    (y_ref * w_y).sum().backward()

    x_loc = x[:, sl].clone().requires_grad_(True)
    prev, prev_doc = ctx.conv_halo(x_loc, K - 1)
    # the K-1 positions before the segment (zeros / doc -1 before the row start), however many ranks back
    start = r * T - (K - 1)
    want = torch.cat([torch.zeros(B, max(0, -start), C), x[:, max(0, start): r * T]], dim=1)
    want_doc = torch.cat([torch.full((B, max(0, -start)), -1), doc_ids[:, max(0, start): r * T]], dim=1)
    torch.testing.assert_close(prev, want, atol=0, rtol=0)
    # doc ids are exact on the document the segment opens with (the only one that reaches back), -1 elsewhere
    assert torch.equal(prev_doc, seen_by(want_doc, doc_ids[:, r * T]))
    y = causal_depthwise_conv(x_loc, w, doc_ids[:, sl], prev, prev_doc)
    (y * w_y[:, sl]).sum().backward()
    torch.testing.assert_close(y, y_ref[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x_loc.grad, x_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    # one all-gather of every rank's last min(K-1, T) tokens forward, one reduce-scatter backward, on EVERY rank
    m = min(K - 1, T)
    assert ctx.stats.bytes["halo_fwd"] == ctx.stats.bytes["halo_bwd"] == (cp - 1) * B * m * C * 4


def check_mla(dims: ParallelDims, doc_ids: torch.Tensor, positions: torch.Tensor, ctx: KCPContext) -> None:
    """Masked attention over ``ctx.gather_latent`` keys, on the queries ``ctx.mla_queries`` gives this rank and
    with the outputs handed back by ``ctx.mla_outputs``, against the same attention on the full rows: values, the
    kept keys and their ids, and the gradients of the queries and the latents. Without the causal balance a rank
    keeps the prefix ``0..r`` and its own queries; with it (kcp/mla_cp.py) the segments ``0..max(r, p)`` and its
    first half-segment + the partner ``p = cp - 1 - r``'s second."""
    cp, r = dims.cp, dims.cp_rank
    B, t_full = doc_ids.shape
    T = t_full // cp
    sl = slice(r * T, (r + 1) * T)
    gen = torch.Generator().manual_seed(2)
    L = 12
    lat = torch.randn(B, t_full, L, generator=gen)
    q = torch.randn(B, t_full, L, generator=gen)
    w_o = torch.randn(B, t_full, L, generator=gen)
    lat_ref, q_ref = lat.clone().requires_grad_(True), q.clone().requires_grad_(True)
    o_ref = _masked_attention(q_ref, lat_ref, doc_ids, positions, doc_ids, positions)
    (o_ref * w_o).sum().backward()

    lat_loc, q_loc = lat[:, sl].clone().requires_grad_(True), q[:, sl].clone().requires_grad_(True)
    keys, k_doc, k_pos = ctx.gather_latent(lat_loc)
    p = cp - 1 - r if ctx.mla_balance else r
    n = max(r, p) + 1
    h = T // 2
    # the kept keys: segments 0..n-1, in order, with their positions; their doc ids are exact wherever the
    # document of a query of this rank (own segment or, balanced, the partner's) reaches, -1 elsewhere
    torch.testing.assert_close(keys, lat[:, : n * T], atol=0, rtol=0)
    assert torch.equal(k_pos, positions[:, : n * T])
    for seg, view in ((r, seen_by(doc_ids[:, : r * T], doc_ids[:, r * T])), (p, seen_by(doc_ids[:, : p * T],
                                                                                         doc_ids[:, p * T]))):
        want = torch.cat([view, doc_ids[:, seg * T: (seg + 1) * T]], dim=1)
        got = k_doc[:, : (seg + 1) * T]
        assert bool(((got == want) | (want == -1)).all()) and bool((got[want != -1] == want[want != -1]).all())
        other = got[want == -1]
        assert bool(((other == -1) | (other == doc_ids[:, : (seg + 1) * T][want == -1])).all())  # true ids only
    x_q, q_doc, q_pos = ctx.mla_queries(q_loc)
    mine = torch.cat([torch.arange(r * T, r * T + h), torch.arange(p * T + h, (p + 1) * T)])
    torch.testing.assert_close(x_q, q[:, mine], atol=0, rtol=0)
    assert torch.equal(q_doc, doc_ids[:, mine]) and torch.equal(q_pos, positions[:, mine])
    o = ctx.mla_outputs(_masked_attention(x_q, keys, q_doc, q_pos, k_doc, k_pos))
    (o * w_o[:, sl]).sum().backward()
    torch.testing.assert_close(o, o_ref[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q_loc.grad, q_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lat_loc.grad, lat_ref.grad[:, sl], atol=1e-6, rtol=1e-6)
    assert ctx.stats.bytes["mla_fwd"] == ctx.stats.bytes["mla_bwd"] == (cp - 1) * B * T * L * 4
    if ctx.mla_balance:  # the queries' input and the outputs swapped forward, their gradients backward
        assert ctx.stats.bytes["mla_swap_fwd"] == ctx.stats.bytes["mla_swap_bwd"] == 2 * B * (T - h) * L * 4
    else:
        assert "mla_swap_fwd" not in ctx.stats.bytes


def check_halo_and_mla(dims: ParallelDims, rows: list[list[int]]) -> None:
    """Both checks on one context over ``rows`` (per-row document lengths)."""
    t_full = sum(rows[0])
    doc_ids = doc_ids_from_lengths(rows, t_full)
    positions = torch.arange(t_full).expand(doc_ids.shape[0], t_full)
    T = t_full // dims.cp
    sl = slice(dims.cp_rank * T, (dims.cp_rank + 1) * T)
    ctx = KCPContext(dims, doc_ids[:, sl], positions[:, sl])
    check_halo(dims, doc_ids, ctx)
    check_mla(dims, doc_ids, positions, ctx)
    check_mla(dims, doc_ids, positions, KCPContext(dims, doc_ids[:, sl], positions[:, sl], mla_balance=False))
