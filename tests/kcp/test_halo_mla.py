"""ShortConv halo exchange and MLA latent gather under CP = 2 and 4 against a single process (forward + grads)."""
from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed
from kcp_cases import LAYOUTS, T_FULL, doc_ids_from_lengths

from k3train.model.conv import causal_depthwise_conv
from kcp import KCPContext
from parallel.dims import ParallelDims


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


def _body(rank: int, world_size: int) -> None:
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    T = T_FULL // world_size
    for case in ("short_docs", "boundaries"):
        doc_ids = doc_ids_from_lengths(LAYOUTS[case])
        positions = torch.arange(T_FULL).expand(doc_ids.shape[0], T_FULL)
        sl = slice(rank * T, (rank + 1) * T)
        ctx = KCPContext(dims, doc_ids[:, sl], positions[:, sl])
        _check_halo(dims, doc_ids, positions, ctx)
        _check_mla(dims, doc_ids, positions, ctx)


@pytest.mark.parametrize("cp", [2, 4])
def test_halo_and_latent_gather_match_single_process(cp: int) -> None:
    run_distributed(_body, cp)


def test_context_rejects_bad_input() -> None:
    ctx = KCPContext(None, torch.zeros(2, 8, dtype=torch.long))  # CP size 1: no process group needed
    with pytest.raises(ValueError, match="conv_halo"):
        ctx.conv_halo(torch.zeros(2, 8, 3), 9)
    with pytest.raises(ValueError, match="gather_latent"):
        ctx.gather_latent(torch.zeros(2, 7, 3))
    with pytest.raises(ValueError, match="doc_ids"):
        KCPContext(None, torch.zeros(8, dtype=torch.long))
    # CP size 1 degenerates to the plain layer: no halo, keys = queries
    prev, prev_doc = ctx.conv_halo(torch.ones(2, 8, 3), 3)
    assert bool((prev == 0).all()) and bool((prev_doc == -1).all())
    keys, k_doc, k_pos = ctx.gather_latent(torch.ones(2, 8, 3))
    assert keys.shape == (2, 8, 3) and torch.equal(k_pos, torch.arange(8).expand(2, 8))
