"""QK-Clip brings the max pre-softmax logit under the threshold, per head, following K2's MLA rule."""
import copy
import math

import pytest
import torch
from torch import nn

from k3train.config import OptimConfig
from k3train.optim import build_optimizer, qk_clip_targets
from k3train.optim.qk_clip import reference_qk_clip_
from parallel.dims import ParallelDims

from optim_testing_models import CausalAttention


class TinyMLA(nn.Module):
    """DeepSeek-style MLA logits: per-head q = [q_nope | q_pe]; k_nope per head from the latent via kv_b (rows
    [k_nope | v] per head); k_pe SHARED by all heads (part of kv_a's output)."""

    def __init__(self, d=12, heads=3, dn=4, dr=2, dv=5, rank=6):
        super().__init__()
        self.h, self.dn, self.dr, self.dv, self.r = heads, dn, dr, dv, rank
        self.q_proj = nn.Linear(d, heads * (dn + dr), bias=False)
        self.kv_a_proj = nn.Linear(d, rank + dr, bias=False)
        self.kv_b_proj = nn.Linear(rank, heads * (dn + dv), bias=False)
        self.register_buffer("qk_max", torch.zeros(heads), persistent=False)

    def logits(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.dn + self.dr)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        lat, k_pe = self.kv_a_proj(x).split([self.r, self.dr], dim=-1)
        k_nope = self.kv_b_proj(lat).view(b, t, self.h, self.dn + self.dv)[..., :self.dn]
        s = torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope) + torch.einsum("bqhd,bkd->bhqk", q_pe, k_pe)
        s = s / math.sqrt(self.dn + self.dr)
        return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))

    def forward(self, x):
        s = self.logits(x)
        with torch.no_grad():
            self.qk_max.copy_(torch.maximum(self.qk_max, s.amax(dim=(0, 2, 3))))
        return s

    def qk_clip_params(self):
        h, dn, dr, dv = self.h, self.dn, self.dr, self.dv
        return [(self.q_proj.weight, h, dn + dr, 0, dn, "q"),
                (self.q_proj.weight, h, dn + dr, dn, dr, "q_rope"),
                (self.kv_b_proj.weight, h, dn + dv, 0, dn, "k")]


def _head_max(mod, x):
    return mod.logits(x).detach().amax(dim=(0, 2, 3))


def _scaled_up(mod, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    return mod


@pytest.mark.parametrize("kind", ["softmax", "mla"])
def test_clip_brings_max_logit_to_threshold(kind):
    mod = _scaled_up(CausalAttention(12, 3, 4) if kind == "softmax" else TinyMLA(), 0)
    x = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(1))
    mod(x)
    before = _head_max(mod, x)
    torch.testing.assert_close(mod.qk_max, before)
    tau = float(before.sort().values[1]) * 0.9  # at least two heads above, maybe one below
    above = before > tau
    assert above.sum() >= 2
    ref = copy.deepcopy(mod)
    logits_before = mod.logits(x).detach()
    cfg = OptimConfig(lr=1e-3, qk_clip_threshold=tau, weight_decay=0.0)
    opt = build_optimizer(mod, cfg, ParallelDims(), zero=0)
    out = opt.step(lr=0.0)  # lr 0: the only change is the clip
    assert out["qk_clipped_heads"] == float(above.sum()) and out["qk_max"] == pytest.approx(float(before.max()))
    after = _head_max(mod, x)
    assert (after <= tau * (1 + 1e-5)).all()
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau), rtol=1e-5, atol=0)
    # every logit of a clipped head scales by exactly gamma; unclipped heads are bit-identical
    gamma = torch.where(above, tau / before, torch.ones_like(before)).view(1, -1, 1, 1)
    lb, la = logits_before, mod.logits(x).detach()
    fin = torch.isfinite(lb)
    torch.testing.assert_close(la[fin], (lb * gamma)[fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(la[:, ~above], lb[:, ~above])
    assert torch.equal(mod.qk_max, torch.zeros_like(mod.qk_max))  # reset for the next step
    # the single-process reference function does the same
    reference_qk_clip_([ref], tau)
    for (n, p), (_, q) in zip(mod.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    if kind == "mla":
        # K2's rule: shared k_pe (kv_a_proj) untouched; v rows of kv_b untouched
        fresh = _scaled_up(TinyMLA(), 0)
        assert torch.equal(mod.kv_a_proj.weight, fresh.kv_a_proj.weight)
        vb = mod.kv_b_proj.weight.view(3, 9, 6)[:, 4:]
        assert torch.equal(vb, fresh.kv_b_proj.weight.view(3, 9, 6)[:, 4:])


def test_threshold_zero_disables():
    mod = _scaled_up(CausalAttention(12, 3, 4), 0)
    mod(torch.randn(1, 5, 12))
    w = mod.q_proj.weight.detach().clone()
    out = build_optimizer(mod, OptimConfig(qk_clip_threshold=0.0), ParallelDims(), zero=0).step(0.0)
    assert out["qk_clipped_heads"] == 0 and torch.equal(mod.q_proj.weight, w)


def test_protocol_validation():
    class Bad(TinyMLA):
        def qk_clip_params(self):
            return [(self.q_proj.weight, self.h, self.dn + self.dr, 0, self.dn, "k_rope")]

    class WrongHeads(TinyMLA):
        def qk_clip_params(self):
            return [(self.q_proj.weight, 2, 9, 0, 4, "q")]

    with pytest.raises(ValueError, match="kind"):
        qk_clip_targets(Bad())
    with pytest.raises(ValueError, match="num_heads"):
        qk_clip_targets(WrongHeads())
    assert len(qk_clip_targets(TinyMLA())) == 3
