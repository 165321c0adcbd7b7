"""SiTU-GLU, DenseFFN and RMSNorm against float64 references written out from the formulas."""
from __future__ import annotations

import pytest
import torch

from k3train.config import ModelConfig
from k3train.model.ffn import DenseFFN, situ_glu
from k3train.model.norm import RMSNorm

torch.set_num_threads(1)


def _situ_ref(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def test_situ_bounds_and_gradients() -> None:
    b1, b2 = 4.0, 25.0
    g = torch.cat([torch.linspace(-1e4, 1e4, 2001), torch.tensor([-30.0, -1.28, 0.0, 1e-3, 50.0, 1e30, -1e30])])
    g = g.double().requires_grad_()
    u = torch.linspace(-1e5, 1e5, g.numel(), dtype=torch.float64).requires_grad_()
    gate = b1 * torch.tanh(g / b1) * torch.sigmoid(g)
    lin = b2 * torch.tanh(u / b2)
    assert (gate > -b1).all() and (gate < b1 + 1e-12).all() and (gate.min() > -1.0)
    assert (lin.abs() <= b2).all()
    h = situ_glu(g, u, b1, b2)
    assert (h.abs() <= b1 * b2).all()
    assert h.max().item() == pytest.approx(b1 * b2, rel=1e-6)  # saturates at the cap b1 * b2 = 100
    gg, gu = torch.autograd.grad(h.sum(), (g, u))
    assert torch.isfinite(gg).all() and torch.isfinite(gu).all()
    # fp32 with huge inputs stays finite too
    g32 = torch.tensor([-1e30, -100.0, 0.0, 100.0, 1e30], requires_grad=True)
    u32 = torch.tensor([1e30, -1e30, 3.0, 1e4, -7.0], requires_grad=True)
    h32 = situ_glu(g32, u32)
    grads = torch.autograd.grad(h32.sum(), (g32, u32))
    assert torch.isfinite(h32).all() and all(torch.isfinite(t).all() for t in grads)


def test_situ_close_to_swiglu_near_origin() -> None:
    # scaled tanh ~ identity near 0: SiTU-GLU ~ Swish(g) * u
    g = torch.linspace(-0.1, 0.1, 21, dtype=torch.float64)
    u = torch.linspace(0.1, -0.1, 21, dtype=torch.float64)
    swiglu = g * torch.sigmoid(g) * u
    assert torch.allclose(situ_glu(g, u), swiglu, atol=1e-5)
    assert not torch.allclose(situ_glu(g, u, 0.05, 0.05), swiglu, atol=1e-5)


def test_dense_ffn_matches_reference() -> None:
    torch.manual_seed(0)
    d, inter = 16, 24
    ffn = DenseFFN(d, inter, 4.0, 25.0).double()
    assert sum(p.numel() for p in ffn.parameters()) == 3 * d * inter
    assert [n for n, _ in ffn.named_parameters()] == ["w_gate.weight", "w_up.weight", "w_down.weight"]
    with torch.no_grad():
        for p in ffn.parameters():
            p.mul_(20.0)  # push pre-activations into the saturating range
    x = torch.randn(3, 5, d, dtype=torch.float64, requires_grad=True)
    y = ffn(x)
    wg, wu, wd = ffn.w_gate.weight, ffn.w_up.weight, ffn.w_down.weight
    ref = _situ_ref(x @ wg.T, x @ wu.T, 4.0, 25.0) @ wd.T
    assert torch.allclose(y, ref, atol=1e-10, rtol=0)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, wg, wu, wd), gy)
    exp = torch.autograd.grad(ref, (x, wg, wu, wd), gy)
    for a, b in zip(got, exp):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_dense_ffn_from_config_and_errors() -> None:
    cfg = ModelConfig(hidden_size=8, intermediate_size=12, activation_situ_beta=2.0, activation_situ_linear_beta=5.0)
    ffn = DenseFFN.from_config(cfg)
    assert (ffn.d, ffn.inter, ffn.situ_beta, ffn.situ_linear_beta) == (8, 12, 2.0, 5.0)
    with pytest.raises(ValueError, match="activation_situ_beta"):
        DenseFFN(8, 12, 0.0, 5.0)
    with pytest.raises(ValueError, match="inter"):
        DenseFFN(8, 0)


def test_rmsnorm() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-5)
    assert torch.equal(norm.weight.data, torch.ones(16))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    # fp32 compute on a bf16 input, returned as bf16
    xb = x.to(torch.bfloat16)
    yb = norm(xb)
    assert yb.dtype == torch.bfloat16
    refb = (xb.double() / torch.sqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double())
    assert torch.allclose(yb.double(), refb, atol=2e-2, rtol=1e-2)
    # fp32 input: tight, with gradients
    x32 = x.float().requires_grad_()
    y = norm(x32)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    xr = x.clone().requires_grad_()
    wr = norm.weight.detach().double().requires_grad_()
    refg = xr / torch.sqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr
    gy = torch.randn_like(refg)
    gx, gw = torch.autograd.grad(y, (x32, norm.weight), gy.float())
    rx, rw = torch.autograd.grad(refg, (xr, wr), gy)
    assert torch.allclose(gx.double(), rx, atol=1e-5) and torch.allclose(gw.double(), rw, atol=1e-4)
    with pytest.raises(ValueError, match="last dimension"):
        norm(torch.randn(2, 8))
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(4, eps=0.0)
