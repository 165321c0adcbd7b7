"""Stable LatentMoE: grouped expert FFN vs per-expert / per-token references (outputs and gradients), routing,
balancing statistics and bias updates of the Router."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from k3train.config import ModelConfig
from k3train.config.presets import tiny_moe_config
from k3train.model.moe import (
    GroupedExperts,
    LatentMoE,
    LocalDispatcher,
    Router,
    _grouped_mm_applies,
    grouped_expert_ffn,
    latent_moe_reference,
    permute_tokens,
    reference_expert_ffn_loop,
    reference_grouped_expert_ffn,
    unpermute_combine,
)

torch.set_num_threads(1)


# the preset's LatentMoE with an expert FFN width (12) unlike the latent's (16) and two shared experts, 20 wide
SIZES = dict(moe_intermediate_size=12, num_shared_experts=2, shared_expert_intermediate_size=20)


def tiny_cfg(**kw) -> ModelConfig:
    return tiny_moe_config(**{**SIZES, **kw})


def _assert_close(got, exp, atol: float) -> None:
    """Max abs error <= atol relative to the tensor's scale (gradients here reach O(50))."""
    for a, b in zip(got, exp):
        assert a.shape == b.shape
        scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
        err = float((a - b).detach().abs().max()) if a.numel() else 0.0
        assert err <= atol * scale, (err, scale)


# ---- permutation -----------------------------------------------------------------------------------------------
def test_permute_unpermute() -> None:
    topk_idx = torch.tensor([[2, 0], [0, 2], [3, 0], [2, 3]])
    order, counts, offsets = permute_tokens(topk_idx, 5)
    assert counts.tolist() == [3, 0, 3, 2, 0]
    assert offsets.dtype == torch.int32 and offsets.tolist() == [3, 3, 6, 8, 8]
    assert order.tolist() == [1, 2, 5, 0, 3, 6, 4, 7]  # stable: token order kept within an expert
    assert torch.equal(topk_idx.reshape(-1)[order], torch.tensor([0, 0, 0, 2, 2, 2, 3, 3]))
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.rand(4, 2, dtype=torch.float64)
    out = unpermute_combine(x[order // 2], order, w)  # identity "experts": combine = (sum_k w) * x
    assert torch.allclose(out, x * w.sum(1, keepdim=True), atol=1e-14)


# ---- grouped expert FFN ----------------------------------------------------------------------------------------
def _experts_inputs(counts: list[int], l_dim: int, f_dim: int, dtype: torch.dtype, scale: float = 1.0):
    g = torch.Generator().manual_seed(len(counts) * 31 + sum(counts))
    n_exp = len(counts)
    x = torch.randn(sum(counts), l_dim, generator=g, dtype=dtype).requires_grad_()
    ws = [(torch.randn(n_exp, a, b, generator=g, dtype=dtype) * scale).requires_grad_()
          for a, b in ((l_dim, f_dim), (l_dim, f_dim), (f_dim, l_dim))]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, ws, offsets


@pytest.mark.parametrize("impl", ["grouped_mm", "padded_bmm", "auto"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2, 0], [0, 0, 7, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 4]])
def test_grouped_expert_ffn_fp32(impl: str, counts: list[int]) -> None:
    x, ws, offsets = _experts_inputs(counts, 16, 12, torch.float32, scale=0.8)
    y = grouped_expert_ffn(x, offsets, *ws, 4.0, 25.0, impl=impl)
    ref = reference_grouped_expert_ffn(x, offsets, *ws, 4.0, 25.0)
    _assert_close([y], [ref], atol=1e-5)
    if y.numel() == 0:
        return
    gy = torch.randn_like(y)
    _assert_close(torch.autograd.grad(y, [x, *ws], gy), torch.autograd.grad(ref, [x, *ws], gy), atol=1e-5)
    # an expanded (stride-0) upstream gradient, as from y.sum(), must work on the grouped_mm path too
    got = torch.autograd.grad(grouped_expert_ffn(x, offsets, *ws, impl=impl).sum(), [x, *ws])
    exp = torch.autograd.grad(reference_grouped_expert_ffn(x, offsets, *ws).sum(), [x, *ws])
    _assert_close(got, exp, atol=1e-5)


def test_grouped_expert_ffn_fp64_and_auto_choice() -> None:
    x, ws, offsets = _experts_inputs([4, 0, 2, 6], 6, 5, torch.float64, scale=3.0)
    assert not _grouped_mm_applies(x, *ws)  # float64 / unaligned -> padded bmm fallback
    y = grouped_expert_ffn(x, offsets, *ws, 2.0, 5.0)
    ref = reference_grouped_expert_ffn(x, offsets, *ws, 2.0, 5.0)
    _assert_close([y], [ref], atol=1e-10)
    gy = torch.randn_like(y)
    _assert_close(torch.autograd.grad(y, [x, *ws], gy), torch.autograd.grad(ref, [x, *ws], gy), atol=1e-10)
    x32, ws32, _ = _experts_inputs([1, 2], 16, 12, torch.float32)
    assert _grouped_mm_applies(x32, *ws32)
    with pytest.raises(ValueError, match="impl"):
        grouped_expert_ffn(x, offsets, *ws, impl="nope")
    with pytest.raises(ValueError, match="inconsistent"):
        grouped_expert_ffn(x, offsets[:2], *ws)


@pytest.mark.parametrize("dtype,impl,atol", [(torch.float32, "auto", 1e-5), (torch.float32, "padded_bmm", 1e-5),
                                             (torch.float64, "auto", 1e-10)])
def test_local_dispatcher_vs_per_token_loop(dtype: torch.dtype, impl: str, atol: float) -> None:
    torch.manual_seed(0)
    n_tok, k, n_exp, l_dim, f_dim = 13, 3, 6, 8, 12
    experts = GroupedExperts(n_exp, l_dim, f_dim, 4.0, 25.0).to(dtype)
    x = torch.randn(n_tok, l_dim, dtype=dtype, requires_grad=True)
    # experts 1 and 4 receive nothing
    topk_idx = torch.stack([torch.randperm(4)[:k] for _ in range(n_tok)])
    topk_idx = torch.tensor([0, 2, 3, 5])[topk_idx]
    topk_w = torch.rand(n_tok, k, dtype=dtype, requires_grad=True)
    out = LocalDispatcher(impl)(x, topk_idx, topk_w, experts)
    ref = reference_expert_ffn_loop(x, topk_idx, topk_w, experts.w_gate, experts.w_up, experts.w_down, 4.0, 25.0)
    _assert_close([out], [ref], atol=atol)
    gy = torch.randn_like(out)
    params = [x, topk_w, experts.w_gate, experts.w_up, experts.w_down]
    got = torch.autograd.grad(out, params, gy)
    exp = torch.autograd.grad(ref, params, gy)
    _assert_close(got, exp, atol=atol)
    assert got[2][1].abs().max() == 0 and got[2][4].abs().max() == 0  # empty experts: zero gradient


# ---- LatentMoE -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,atol,kw", [
    (torch.float32, 1e-5, {}),
    (torch.float64, 1e-10, {}),
    (torch.float64, 1e-10, dict(latent_moe_use_norm=False, moe_renormalize=False, routed_scaling_factor=2.5,
                                num_shared_experts=1)),
])
def test_latent_moe_vs_reference(dtype: torch.dtype, atol: float, kw: dict) -> None:
    torch.manual_seed(0)
    moe = LatentMoE(tiny_cfg(**kw)).to(dtype)
    with torch.no_grad():
        moe.router.bias.copy_(torch.linspace(-0.2, 0.2, 8))
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    y = moe(x)
    ref = latent_moe_reference(moe, x)
    assert y.shape == x.shape
    _assert_close([y], [ref], atol=atol)
    gy = torch.randn_like(y)
    params = [x] + list(moe.parameters())
    got = torch.autograd.grad(y, params, gy)
    exp = torch.autograd.grad(ref, params, gy)
    _assert_close(got, exp, atol=atol)
    names = [n for n, _ in moe.named_parameters()]
    assert "router.weight" in names and got[1 + names.index("router.weight")].abs().max() > 0


def test_latent_moe_structure_and_param_count() -> None:
    cfg = tiny_cfg()
    moe = LatentMoE(cfg)
    d, l_dim, f_dim, n_exp, w = 32, 16, 12, 8, 20
    expected = n_exp * d + d * l_dim + n_exp * 3 * l_dim * f_dim + l_dim + l_dim * d + 2 * 3 * d * w
    assert sum(p.numel() for p in moe.parameters()) == expected
    assert sum(p.numel() for p in moe.shared_experts.parameters()) == cfg.num_shared_experts * 3 * d * w
    sd = moe.state_dict()
    assert "router.bias" in sd and not any("expert_loads" in k or "qb_hist" in k for k in sd)
    assert "router.bias" not in dict(moe.named_parameters())
    assert not isinstance(moe.dispatcher, torch.nn.Module)
    with pytest.raises(ValueError, match="num_experts_per_token"):
        LatentMoE(tiny_cfg(num_experts_per_token=8))
    with pytest.raises(ValueError, match="last dimension"):
        moe(torch.randn(3, 31))


# ---- Router ----------------------------------------------------------------------------------------------------
def test_router_weights_exclude_bias() -> None:
    torch.manual_seed(0)
    router = Router(16, 6, 2, scaling_factor=1.5)
    x = torch.randn(10, 16)
    scores = torch.sigmoid(x @ router.weight.T)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 5.0]))  # forces expert 5 into every top-2
    idx, w, s = router(x)
    assert torch.allclose(s, scores, atol=1e-6)
    assert (idx == 5).any(dim=1).all()
    sel = scores.gather(1, idx)
    assert torch.allclose(w, 1.5 * sel / sel.sum(1, keepdim=True), atol=1e-6)
    # selection excludes the bias from the weights, but not from the choice: without bias expert 5 is rare
    router.bias.zero_()
    idx0, _, _ = router(x)
    assert (idx0 == 5).any(dim=1).sum() < 10
    # without renormalisation: weights are the raw scores times the scaling factor
    raw = Router(16, 6, 2, renormalize=False, scaling_factor=2.0)
    with torch.no_grad():
        raw.weight.copy_(router.weight)
    idx2, w2, _ = raw(x)
    assert torch.allclose(w2, 2.0 * scores.gather(1, idx2), atol=1e-6)
    assert w.dtype == torch.float32 and idx.dtype == torch.long


def test_router_statistics_collection() -> None:
    torch.manual_seed(0)
    router = Router(16, 6, 2, bins=32)
    x = torch.randn(40, 16, requires_grad=True)
    router.eval()
    router(x)
    assert router.expert_loads.sum() == 0
    router.train()
    router(x[:15])
    router(x[15:])
    loads_two, hist_two = [t.clone() for t in router.balance_stats()]
    router.reset_balance_state()
    router(x)
    loads_one, hist_one = router.balance_stats()
    assert torch.equal(loads_two, loads_one) and torch.equal(hist_two, hist_one)
    assert loads_one.sum() == 80 and hist_one.sum(1).tolist() == [40] * 6
    assert [t.dtype for t in router.balance_stats()] == [torch.int32, torch.int32]
    # activation recomputation re-runs forward inside backward: counted once, both checkpoint flavours
    for reentrant in (True, False):
        router.reset_balance_state()
        _, w, _ = checkpoint(router, x, use_reentrant=reentrant)
        w.sum().backward()
        assert router.expert_loads.sum() == 80, reentrant
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_router_balance_step_modes() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    # 'none': bias stays, metrics still reported
    r_none = Router(16, 6, 2, balance="none")
    r_none.train()
    r_none(x)
    m = r_none.balance_step()
    assert torch.equal(r_none.bias, torch.zeros(6)) and m["tokens"] == 64
    assert m["maxvio"] == pytest.approx(float(m["loads"].max() / m["loads"].double().mean()))
    assert r_none.expert_loads.sum() == 0  # reset
    # 'sign': +-rate
    r_sign = Router(16, 6, 2, balance="sign", sign_rate=0.01)
    r_sign(x)
    loads = r_sign.expert_loads.double().clone()
    r_sign.balance_step()
    assert torch.allclose(r_sign.bias.double(), 0.01 * torch.sign(loads.mean() - loads), atol=1e-7)
    # 'qb' exact estimator == the pure function on the concatenated micro-batches; EMA mixes with the old bias
    from k3train.ops.quantile_balancing import qb_exact_update
    r_ex = Router(16, 6, 2, estimator="exact", ema=0.5)
    with torch.no_grad():
        r_ex.bias.copy_(torch.linspace(-0.1, 0.1, 6))
    old = r_ex.bias.clone()
    r_ex(x[:20])
    r_ex(x[20:])
    scores = torch.sigmoid(x @ r_ex.weight.detach().T)
    expected = 0.5 * old + 0.5 * qb_exact_update(scores, old, 2)
    r_ex.balance_step()
    assert torch.allclose(r_ex.bias, expected, atol=1e-6)
    assert r_ex.balance_stats()[0].sum() == 0 and r_ex._exact_scores == []


def test_router_qb_histogram_balances_skewed_router() -> None:
    # a linear router whose expert popularity is strongly skewed (a shared input offset along feature 0), the same
    # data every step, two micro-batches per step. QB (histogram) removes most of the imbalance in a few steps, the
    # sign rule with the usual rate 1e-3 barely moves; the new bias only routes the NEXT step.
    torch.manual_seed(0)
    d, n_exp, k = 16, 16, 2
    x = torch.randn(2048, d)
    x[:, 0] += 1.5
    weight = torch.nn.init.kaiming_uniform_(torch.empty(n_exp, d), a=5 ** 0.5)
    weight[:, 0] = torch.linspace(-1.5, 1.5, n_exp)
    maxvio = {}
    for balance in ("qb", "sign"):
        router = Router(d, n_exp, k, balance=balance, bins=1000)
        with torch.no_grad():
            router.weight.copy_(weight)
        vio = []
        for _ in range(8):
            bias_before = router.bias.clone()
            router(x[:1000])
            router(x[1000:])
            assert torch.equal(router.bias, bias_before)
            vio.append(router.balance_step()["maxvio"])
        maxvio[balance] = vio
    assert maxvio["qb"][0] == maxvio["sign"][0] > 4.0
    assert maxvio["qb"][-1] < 1.6
    assert maxvio["sign"][-1] > 4.0


def test_router_stats_summed_over_ranks_equal_single_process() -> None:
    # What the trainer does across the dp x cp ranks of a stage: each rank routes its share (here in two
    # micro-batches), the live buffers of balance_stats() are SUM-all-reduced in place, every rank runs
    # balance_step(). Simulated in-process (a SUM all-reduce of int32 counts is plain addition): every "rank" must
    # end with exactly the bias of one process that routed the whole batch.
    torch.manual_seed(0)
    world = 4
    x = torch.randn(world * 30, 16)
    full = Router(16, 8, 2, bins=100)
    with torch.no_grad():
        full.weight[:, 0] = torch.linspace(-2, 2, 8)
    ranks = [Router(16, 8, 2, bins=100) for _ in range(world)]
    for r in ranks:
        r.load_state_dict(full.state_dict())
    full(x)
    full_metrics = full.balance_step()
    for rank, r in enumerate(ranks):
        mine = x[rank * 30:(rank + 1) * 30]
        r(mine[:11])
        r(mine[11:])
    summed = [sum(ts) for ts in zip(*[[t.clone() for t in r.balance_stats()] for r in ranks])]
    for r in ranks:
        for live, total in zip(r.balance_stats(), summed):
            live.copy_(total)  # = dist.all_reduce(live) over the ranks
        metrics = r.balance_step()
        assert torch.equal(r.bias, full.bias)
        assert metrics["maxvio"] == full_metrics["maxvio"] and metrics["tokens"] == world * 30
    assert full.bias.abs().max() > 0


def test_empty_batch_and_bf16_activations() -> None:
    torch.manual_seed(0)
    moe = LatentMoE(tiny_cfg())
    x = torch.randn(0, 3, 32, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    assert y.shape == (0, 3, 32) and moe.router.balance_step()["tokens"] == 0
    # bf16 activations with fp32 master weights: the grouped path computes in bf16, gradients reach the masters
    z = torch.randn(20, 16)
    topk_idx = torch.randint(0, 8, (20, 2))
    topk_w = torch.rand(20, 2)
    out = LocalDispatcher()(z.bfloat16(), topk_idx, topk_w, moe.experts)
    ex = moe.experts
    ref = reference_expert_ffn_loop(z, topk_idx, topk_w, ex.w_gate, ex.w_up, ex.w_down)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - ref).detach().abs().max()) <= 0.05 * max(1.0, float(ref.detach().abs().max()))
    out.float().sum().backward()
    assert ex.w_gate.grad is not None and ex.w_gate.grad.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------
# the split backward: input gradient first, weight gradients later (moonep/dispatcher.py, parallel.expert_wgrad_split)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl,dtype,qat,rows", [
    ("grouped_mm", torch.float32, "none", [5, 0, 7, 3]),
    ("padded_bmm", torch.float32, "none", [5, 0, 7, 3]),
    ("grouped_mm", torch.bfloat16, "none", [4, 4, 0, 9]),
    ("grouped_mm", torch.float32, "mxfp8", [6, 2, 0, 8]),
    ("padded_bmm", torch.float32, "mxfp8", [6, 2, 0, 8]),
    ("loop", torch.float32, "none", [3, 3, 3, 3]),   # the reference: no cut, one pass
    ("grouped_mm", torch.float32, "none", [0, 0, 0, 0]),  # nothing routed here
])
def test_split_expert_backward_equals_one_pass(impl, dtype, qat, rows):
    """``expert_input_grad`` (input gradient, then the weight gradients on demand) returns exactly what one
    ``torch.autograd.grad`` over the uncut FFN does: the same matmuls in the same order of accumulation."""
    from k3train.model.moe import DownCut, expert_input_grad, grouped_expert_ffn
    from k3train.quant.qat import ExpertQuant

    g = torch.Generator().manual_seed(3)
    n_exp, l_dim, f_dim = len(rows), 32, 64
    offsets = torch.tensor(rows).cumsum(0).to(torch.int32)
    n = int(offsets[-1])
    x = torch.randn(n, l_dim, generator=g).to(dtype)
    ws = [torch.randn(n_exp, l_dim, f_dim, generator=g) * 0.2, torch.randn(n_exp, l_dim, f_dim, generator=g) * 0.2,
          torch.randn(n_exp, f_dim, l_dim, generator=g) * 0.2]
    gy = torch.randn(n, l_dim, generator=g).to(dtype)
    quant = ExpertQuant("mxfp4", qat) if qat != "none" else None

    def run(cut):
        xl = x.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        y = grouped_expert_ffn(xl, offsets, *wl, impl=impl, quant=quant, cut=cut)
        return xl, wl, y

    xl, wl, y = run(None)
    if n:
        want = torch.autograd.grad(y, [xl] + wl, gy)
    else:
        want = [torch.zeros_like(xl)] + [torch.zeros_like(w) for w in wl]
    cut = DownCut()
    xl, wl, y2 = run(cut)
    assert torch.equal(y2, y)
    assert (cut.h is not None) == (impl != "loop" and n > 0)
    g_x, later = expert_input_grad(xl, wl, y2, cut, gy)
    torch.testing.assert_close(g_x, want[0], atol=0, rtol=0)
    for got, ref, name in zip(later(), want[1:], ("w_gate", "w_up", "w_down")):
        torch.testing.assert_close(got, ref, atol=0, rtol=0, msg=name)
