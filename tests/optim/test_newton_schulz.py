"""Batched Newton-Schulz vs the plain float64 reference, and the stated singular-value band."""
import pytest
import torch

from k3train.optim.newton_schulz import (NS_MIN_RELATIVE_SV, NS_SV_BAND_BF16, NS_SV_BAND_FP32, newton_schulz,
                                         newton_schulz_reference, ns_flops)


@pytest.mark.parametrize("shape", [(3, 8, 24), (4, 24, 8), (2, 5, 7, 11), (16, 16)])
def test_batched_matches_reference(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, steps=5, dtype=torch.float32)
    assert out.shape == g.shape and out.dtype == torch.float32
    flat_in, flat_out = g.reshape(-1, *shape[-2:]), out.reshape(-1, *shape[-2:])
    for i in range(flat_in.shape[0]):
        ref = newton_schulz_reference(flat_in[i], steps=5)
        torch.testing.assert_close(flat_out[i].double(), ref, atol=2e-5, rtol=1e-5)
    # float64 arithmetic through the batched path matches to ~1e-12
    out64 = newton_schulz(g.double(), steps=5, dtype="float64")
    for i in range(flat_in.shape[0]):
        torch.testing.assert_close(out64.reshape(-1, *shape[-2:])[i],
                                   newton_schulz_reference(flat_in[i], steps=5), atol=1e-12, rtol=1e-10)


def _rel_svals(g):
    return torch.linalg.svdvals(g.double()) / torch.linalg.matrix_norm(g.double(), keepdim=True).squeeze(-1)


@pytest.mark.parametrize("dtype,band", [("float32", NS_SV_BAND_FP32), ("bfloat16", NS_SV_BAND_BF16)])
def test_singular_values_in_band(dtype, band):
    gen = torch.Generator().manual_seed(1)
    # heads of a per-head projection: wide blocks, plus tall ones (transposed path) and ill-scaled ones
    g = torch.cat([torch.randn(6, 16, 48, generator=gen),
                   torch.randn(6, 48, 16, generator=gen).mT * torch.logspace(-3, 3, 6).view(6, 1, 1)])
    assert (_rel_svals(g) >= NS_MIN_RELATIVE_SV).all()  # the band's precondition holds for these inputs
    out = newton_schulz(g, steps=5, dtype=dtype).double()
    sv = torch.linalg.svdvals(out)
    lo, hi = band
    assert sv.min() >= lo and sv.max() <= hi, (sv.min().item(), sv.max().item())
    # NS acts on singular values only: out = U diag(p^5(s / ||g||_F)) V^T with p(x) = a x + b x^3 + c x^5
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = s / torch.linalg.matrix_norm(g.double()).unsqueeze(-1)
    for _ in range(5):
        x = 3.4445 * x - 4.7750 * x ** 3 + 2.0315 * x ** 5
    expect = u @ torch.diag_embed(x) @ vh
    tol = 1e-4 if dtype == "float32" else 5e-2
    assert (out - expect).abs().max() < tol


def test_zero_matrix_and_transposition():
    assert torch.equal(newton_schulz(torch.zeros(2, 4, 6)), torch.zeros(2, 4, 6))
    g = torch.randn(5, 9, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(newton_schulz(g.T), newton_schulz(g).T, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="ns_dtype"):
        newton_schulz(g, dtype="float16")
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(3))


def test_flops_per_head_cheaper_than_whole():
    # K3 attention projection: 96 heads x 128 rows, input 7168
    whole = ns_flops((96 * 128, 7168), 5)
    per_head = ns_flops((96, 128, 7168), 5)
    assert per_head < whole / 10
