"""Chunked KDA (k3train.ops.kda.chunk_kda / kda_transition) vs the token-loop references: outputs AND gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.ops import kda_chunk
from k3train.ops.kda import chunk_kda, kda_transition, naive_kda_transition, naive_recurrent_kda

torch.set_num_threads(1)
F64 = torch.float64


def make_inputs(B, T, H, K, V, *, dtype=F64, gate="lower_bounded", seed=0):
    """Leaf tensors shaped like the KDA layer produces them (L2-normalised k, sigmoid beta, log-decay g <= 0)."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    q = rn(B, T, H, K)
    k = F.normalize(rn(B, T, H, K), dim=-1)
    v = rn(B, T, H, V)
    z = rn(B, T, H, K)
    if gate == "lower_bounded":          # K3: g = -5 sigmoid(z) in (-5, 0)
        g = -5.0 * torch.sigmoid(z)
    elif gate == "softplus":             # Kimi Linear: unbounded below; make some steps very large
        g = -F.softplus(3 * z) * 4.0
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(rn(B, T, H))
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def run_with_grads(fn, inputs, h0, cu=None, seed=1, **kw):
    """Run ``fn``, backprop a random linear functional of (o, final_state); return o, state, grads."""
    o, s = fn(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)
    ws = torch.randn(s.shape, generator=gen, dtype=F64).to(s.dtype)
    loss = (o.float() * wo.float()).sum() + (s.float() * ws.float()).sum()
    leaves = list(inputs) + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad(loss.to(F64) if o.dtype == F64 else loss, leaves)
    return o.detach(), s.detach(), grads


def assert_close_all(a, b, *, atol, rtol, what=""):
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x.to(F64), y.to(F64), atol=atol, rtol=rtol, msg=lambda m: f"{what} d{names[i]}: {m}")


def compare(inputs, h0, cu=None, *, atol, rtol, ref_inputs=None, ref_h0=None, **kw):
    o1, s1, g1 = run_with_grads(chunk_kda, inputs, h0, cu, **kw)
    o2, s2, g2 = run_with_grads(naive_recurrent_kda, ref_inputs or inputs, ref_h0 if ref_inputs else h0, cu)
    assert o1.dtype == inputs[0].dtype and o1.shape == inputs[2].shape
    torch.testing.assert_close(o1.to(F64), o2.to(F64), atol=atol, rtol=rtol)
    torch.testing.assert_close(s1.to(F64), s2.to(F64), atol=atol, rtol=rtol)
    assert_close_all(g1, g2, atol=atol, rtol=rtol)
    return o1, s1, g1


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [64, 16, 32])
@pytest.mark.parametrize("T", [100, 128, 7])
def test_float64_matches_naive(T, chunk_size):
    inputs = make_inputs(2, T, 2, 8, 16)
    h0 = torch.randn(2, 2, 8, 16, dtype=F64, requires_grad=True)
    compare(inputs, h0, atol=1e-9, rtol=1e-9, chunk_size=chunk_size)


def test_float64_no_initial_state_and_no_final_state():
    q, k, v, g, b = make_inputs(1, 70, 2, 16, 8, seed=3)
    o, s = chunk_kda(q, k, v, g, b, scale=0.3)
    assert s is None
    o_ref, _ = naive_recurrent_kda(q, k, v, g, b, scale=0.3)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=1e-10)
    # zero initial state given explicitly == None
    o0, _ = chunk_kda(q, k, v, g, b, scale=0.3, initial_state=torch.zeros(1, 2, 16, 8, dtype=F64))
    torch.testing.assert_close(o0, o, atol=1e-12, rtol=0)


def test_float32_matches_float64_reference():
    inputs = make_inputs(2, 150, 2, 16, 16, dtype=torch.float32, seed=4)
    h0 = torch.randn(2, 2, 16, 16, requires_grad=True)
    ref = [x.detach().to(F64).requires_grad_() for x in inputs]
    ref_h0 = h0.detach().to(F64).requires_grad_()
    o, s, _ = compare(inputs, h0, atol=2e-4, rtol=1e-4, ref_inputs=ref, ref_h0=ref_h0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32


def test_bf16_inputs_loose():
    inputs = make_inputs(1, 130, 2, 16, 16, dtype=torch.bfloat16, seed=5)
    h0 = torch.randn(1, 2, 16, 16, requires_grad=True)
    # the reference sees the same bf16-rounded values, computed in float64
    ref = [x.detach().to(F64).requires_grad_() for x in inputs]
    ref_h0 = h0.detach().to(F64).requires_grad_()
    o, s, grads = compare(inputs, h0, atol=5e-2, rtol=3e-2, ref_inputs=ref, ref_h0=ref_h0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32      # state accumulates in fp32
    assert all(gr.dtype == x.dtype for gr, x in zip(grads, inputs + [h0]))


@pytest.mark.parametrize("lengths", [[1, 5, 64, 70, 3], [64, 1, 128, 7], [3, 0, 20, 0], [200]])
def test_cu_seqlens_matches_naive_and_independent_docs(lengths):
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make_inputs(1, T, 2, 8, 8, seed=6)
    h0 = torch.randn(len(lengths), 2, 8, 8, dtype=F64, requires_grad=True)
    o, s, _ = compare(inputs, h0, cu, atol=1e-9, rtol=1e-9)
    # each document alone (no cu_seqlens) gives the same output slice and final state: the state resets
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == a:
            torch.testing.assert_close(s[n], h0[n].detach())   # empty document: state passes through
            continue
        o_n, s_n = chunk_kda(*(x.detach()[:, a:e] for x in inputs), initial_state=h0[n:n + 1].detach(),
                             output_final_state=True)
        torch.testing.assert_close(o[:, a:e], o_n, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(s[n:n + 1], s_n, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("split", [37, 64, 1])
def test_split_with_carried_state_equals_whole(split):
    q, k, v, g, b = make_inputs(2, 130, 2, 8, 16, seed=7)
    h0 = torch.randn(2, 2, 8, 16, dtype=F64, requires_grad=True)
    leaves = [q, k, v, g, b, h0]
    w = torch.randn(2, 130, 2, 16, dtype=F64)
    o_whole, s_whole = chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True)
    g_whole = torch.autograd.grad((o_whole * w).sum() + s_whole.sum(), leaves)
    part = lambda x, sl: x[:, sl]  # noqa: E731
    o1, s1 = chunk_kda(*(part(x, slice(0, split)) for x in (q, k, v, g, b)), initial_state=h0,
                       output_final_state=True)
    o2, s2 = chunk_kda(*(part(x, slice(split, None)) for x in (q, k, v, g, b)), initial_state=s1,
                       output_final_state=True)
    o_split = torch.cat([o1, o2], 1)
    torch.testing.assert_close(o_split, o_whole, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s2, s_whole, atol=1e-10, rtol=1e-10)
    g_split = torch.autograd.grad((o_split * w).sum() + s2.sum(), leaves)
    assert_close_all(g_split, g_whole, atol=1e-10, rtol=1e-10, what="split")


# ---------------------------------------------------------------------------------------------------------------
# Numerics of the decay factors
def chunk_decay(g, T):
    layout = kda_chunk._build_layout([T], 64, g.device)
    return kda_chunk._decay_sums(kda_chunk._to_chunks(g.detach(), layout, 64, torch.float32))


def test_lower_bounded_gate_range_and_bf16_safety():
    """g = -5 at every token (the bound) for whole chunks: dense diagonal sub-tiles, no inf/nan, matches reference."""
    T, H, K, V = 192, 2, 16, 16
    q, k, v, _, b = make_inputs(1, T, H, K, V, dtype=torch.bfloat16, seed=8)
    g = torch.full((1, T, H, K), -5.0, dtype=torch.bfloat16, requires_grad=True)
    dec = chunk_decay(g, T)
    assert float(dec.Gl.min()) >= -80.0 and float(dec.G.min()) == pytest.approx(-320.0)   # 16 / 64 tokens x -5
    assert dec.span == pytest.approx(75.0) and dec.span <= kda_chunk._DENSE_SPAN_MAX[torch.float32]  # dense path
    inputs = [q, k, v, g, b]
    h0 = torch.randn(1, H, K, V, requires_grad=True)
    o, s, grads = run_with_grads(chunk_kda, inputs, h0)
    for x in [o, s, *grads]:
        assert torch.isfinite(x.float()).all()
    ref = [x.detach().to(F64).requires_grad_() for x in inputs]
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref, h0.detach().to(F64).requires_grad_())
    torch.testing.assert_close(o.to(F64), o_ref, atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(s.to(F64), s_ref, atol=5e-2, rtol=3e-2)
    assert_close_all(grads, g_ref, atol=5e-2, rtol=3e-2, what="g=-5 bf16")


def test_unbounded_gate_fp32_safe():
    """Softplus-style gate with huge steps (and -1e4 hard resets): pairwise diagonal fallback, exact and finite."""
    q, k, v, g, b = make_inputs(1, 140, 2, 8, 8, dtype=torch.float32, gate="softplus", seed=9)
    with torch.no_grad():
        g[0, 50] = -1e4
        g[0, 90:93] = -60.0
    assert chunk_decay(g, 140).span > kda_chunk._DENSE_SPAN_MAX[torch.float32]      # fallback is exercised
    inputs = [q, k, v, g, b]
    h0 = torch.randn(1, 2, 8, 8, requires_grad=True)
    o, s, grads = run_with_grads(chunk_kda, inputs, h0)
    for x in [o, s, *grads]:
        assert torch.isfinite(x).all()
    ref = [x.detach().to(F64).requires_grad_() for x in inputs]
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref, h0.detach().to(F64).requires_grad_())
    torch.testing.assert_close(o.to(F64), o_ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(s.to(F64), s_ref, atol=2e-4, rtol=1e-4)
    assert_close_all(grads, g_ref, atol=2e-4, rtol=1e-4, what="softplus fp32")


@pytest.mark.parametrize("strict", [True, False])
def test_decayed_gram_dense_and_pairwise_agree_with_explicit(strict):
    gen = torch.Generator().manual_seed(10)
    x, k = torch.randn(2, 3, 64, 8, generator=gen, dtype=F64), torch.randn(2, 3, 64, 8, generator=gen, dtype=F64)
    g = -3.0 * torch.rand(2, 3, 64, 8, generator=gen, dtype=F64)
    G = g.cumsum(-2)
    diff = (G[..., :, None, :] - G[..., None, :, :]).clamp(max=0)           # j <= i entries are <= 0 anyway
    full = (x[..., :, None, :] * k[..., None, :, :] * diff.exp()).sum(-1)
    want = full.tril(-1 if strict else 0)
    dec = kda_chunk._decay_sums(g)
    torch.testing.assert_close(dec.G, G)
    torch.testing.assert_close(dec.suf, G[..., -1:, :] - G)
    for dense in (True, False):
        got = kda_chunk._decayed_gram(x, k, dec, strict=strict, dense_diag=dense)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# kda_transition (for KCP)
@pytest.mark.parametrize("cu_lengths", [None, [1, 5, 64, 70, 3, 0]])
def test_transition_matches_explicit_product(cu_lengths):
    if cu_lengths is None:
        B, T, cu = 2, 150, None
    else:
        B, T = 1, sum(cu_lengths)
        cu = torch.tensor([0] + torch.tensor(cu_lengths).cumsum(0).tolist())
    _, k, _, g, b = make_inputs(B, T, 2, 8, 4, seed=11)
    M = kda_transition(k, g, b, cu_seqlens=cu)
    M_ref = naive_kda_transition(k, g, b, cu_seqlens=cu)
    assert M.shape == M_ref.shape == (B if cu is None else len(cu_lengths), 2, 8, 8)
    torch.testing.assert_close(M, M_ref, atol=1e-10, rtol=1e-10)
    R = torch.randn(M.shape, dtype=F64)
    gr = torch.autograd.grad((M * R).sum(), [k, g, b])
    gr_ref = torch.autograd.grad((M_ref * R).sum(), [k, g, b])
    assert_close_all(gr, gr_ref, atol=1e-10, rtol=1e-10, what="transition")
    if cu_lengths is not None:
        torch.testing.assert_close(M[-1], torch.eye(8, dtype=F64).expand(2, 8, 8))   # empty doc -> identity


def test_transition_composes_states_like_kcp():
    """final_state(h0) == M h0 + final_state(0): the pair (M, S~) that KCP all-gathers."""
    q, k, v, g, b = make_inputs(1, 90, 2, 8, 16, seed=12)
    h0 = torch.randn(1, 2, 8, 16, dtype=F64)
    _, s_h0 = chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True)
    _, s_zero = chunk_kda(q, k, v, g, b, output_final_state=True)
    M = kda_transition(k, g, b)
    torch.testing.assert_close(s_h0, M @ h0 + s_zero, atol=1e-10, rtol=1e-10)


def test_bad_inputs_raise():
    q, k, v, g, b = (x.detach() for x in make_inputs(2, 10, 1, 4, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, b, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, b, initial_state=torch.zeros(1, 1, 4, 4, dtype=F64))
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, b[..., None])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, b, chunk_size=40)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q[:1], k[:1], v[:1], g[:1], b[:1], cu_seqlens=torch.tensor([0, 4, 3, 10]))
