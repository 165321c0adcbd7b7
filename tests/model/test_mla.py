"""Gated MLA: literal per-head softmax reference (outputs + grads), causality and document isolation by
perturbation, qk_max, the CP latent-gather seam, QK-Clip and per-head protocols."""
import math

import pytest
import torch

from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.mla import MLA
from k3train.model.seq import SeqInfo
from k3train.optim.qk_clip import qk_clip_targets, reference_qk_clip_

torch.set_num_threads(1)


def _mla(*over, seed=0):
    torch.manual_seed(seed)
    m = MLA(tiny_cfg(*over)).double()
    with torch.no_grad():
        for p in m.parameters():  # bigger weights -> peaky softmax, so masking mistakes show
            if p.ndim == 2:
                p.normal_(0, 0.3)
    return m


def reference_mla(m: MLA, x, doc):
    """Literal per-token, per-head softmax attention written from the formulas (no SDPA, no masks tensor)."""
    B, T, _ = x.shape
    H, dn, dr, dv, r = m.num_heads, m.nope_dim, m.rope_dim, m.v_dim, m.kv_lora_rank

    # (the RMSNorm modules themselves are tested with the norm; using them keeps their fp32 rounding identical)
    if m.q_lora_rank > 0:
        cq = m.q_a_layernorm(x @ m.q_a_proj.weight.T)
        q = (cq @ m.q_b_proj.weight.T).view(B, T, H, dn + dr)
    else:
        q = (x @ m.q_proj.weight.T).view(B, T, H, dn + dr)
    lat = x @ m.kv_a_proj_with_mqa.weight.T
    c, k_pe = lat[..., :r], lat[..., r:]
    kv = (m.kv_a_layernorm(c) @ m.kv_b_proj.weight.T).view(B, T, H, dn + dv)
    rows = []
    for b in range(B):
        toks = []
        for t in range(T):
            heads = []
            for h in range(H):
                logits, vals = [], []
                for s in range(t + 1):
                    if doc[b, s] != doc[b, t]:
                        continue
                    key = torch.cat([kv[b, s, h, :dn], k_pe[b, s]])
                    logits.append((q[b, t, h] * key).sum() / math.sqrt(dn + dr))
                    vals.append(kv[b, s, h, dn:])
                w = torch.softmax(torch.stack(logits), 0)
                heads.append((w[:, None] * torch.stack(vals)).sum(0))
            toks.append(torch.cat(heads))
        rows.append(torch.stack(toks))
    o = torch.stack(rows)
    if m.use_output_gate:
        o = torch.sigmoid(x @ m.g_proj.weight.T) * o
    return o @ m.o_proj.weight.T


def _docs(B, T, starts):
    d = torch.zeros(B, T, dtype=torch.long)
    for b, ss in enumerate(starts):
        for s in ss:
            d[b, s:] += 1
    return d


@pytest.mark.parametrize("over", [(), ("q_lora_rank=0",), ("mla_use_output_gate=false",)])
def test_mla_matches_literal_reference(over):
    m = _mla(*over)
    B, T = 2, 9
    doc = _docs(B, T, [[3, 7], [5]])
    x = torch.randn(B, T, 64, dtype=torch.float64, requires_grad=True)
    params = list(m.parameters())
    y = m(x, SeqInfo.from_doc_ids(doc))
    y_ref = reference_mla(m, x, doc)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    gy = torch.randn_like(y)
    g = torch.autograd.grad((y * gy).sum(), [x, *params])
    g_ref = torch.autograd.grad((y_ref * gy).sum(), [x, *params])
    for (name, _), a, b in zip([("x", None), *m.named_parameters()], g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda s: f"grad {name}: {s}")


def test_mla_causal_and_document_isolated():
    m = _mla()
    T = 16
    doc = _docs(1, T, [[6]])
    seq = SeqInfo.from_doc_ids(doc)
    x = torch.randn(1, T, 64, dtype=torch.float64)
    y = m(x, seq)
    x2 = x.clone()
    x2[:, 10:] += torch.randn(1, T - 10, 64, dtype=torch.float64)  # future tokens of document 1
    torch.testing.assert_close(m(x2, seq)[:, :10], y[:, :10], atol=0, rtol=0)
    x3 = x.clone()
    x3[:, :6] += torch.randn(1, 6, 64, dtype=torch.float64)  # all of document 0
    torch.testing.assert_close(m(x3, seq)[:, 6:], y[:, 6:], atol=0, rtol=0)
    assert not torch.allclose(m(x3, seq)[:, :6], y[:, :6])


def test_qk_max_tracks_max_allowed_logit():
    m = _mla()
    m.train()
    T = 8
    doc = _docs(1, T, [[4]])
    x = torch.randn(1, T, 64, dtype=torch.float64)
    m(x, SeqInfo.from_doc_ids(doc))
    q = m.project_q(x)
    k, _ = m.expand_latent(m.kv_a_proj_with_mqa(x))
    want = torch.full((m.num_heads,), -float("inf"), dtype=torch.float64)
    for t in range(T):
        for s in range(t + 1):
            if doc[0, s] == doc[0, t]:
                want = torch.maximum(want, (q[0, t] * k[0, s]).sum(-1) * m.scale)
    torch.testing.assert_close(m.qk_max.double(), want.clamp_min(0), atol=1e-6, rtol=1e-6)
    m.eval()
    before = m.qk_max.clone()
    m(x * 3, SeqInfo.from_doc_ids(doc))
    assert torch.equal(m.qk_max, before)  # only tracked in training


class _LatentGatherCP:
    """Single-process stand-in for the KCP context of the LAST rank: prepends the latents the earlier ranks of the
    same rows would contribute (computed by the same layer), exactly as the all-gather would."""

    def __init__(self, earlier_latent, earlier_doc, earlier_pos):
        self.lat, self.doc, self.pos = earlier_latent, earlier_doc, earlier_pos

    def gather_latent(self, latent):
        return (torch.cat([self.lat, latent], 1), torch.cat([self.doc, self.seq.doc_ids], 1),
                torch.cat([self.pos, self.seq.positions], 1))

    def mla_queries(self, x):  # the last rank's own queries (no causal balance in one process)
        return x, self.seq.doc_ids, self.seq.positions

    def mla_outputs(self, y):
        return y


def test_mla_cp_gather_latent_seam():
    m = _mla()
    B, T, s = 2, 12, 7
    doc = _docs(B, T, [[4], [9]])
    x = torch.randn(B, T, 64, dtype=torch.float64, requires_grad=True)
    full = m(x, SeqInfo.from_doc_ids(doc))
    pos = torch.arange(T).expand(B, T)
    early_lat = m.kv_a_proj_with_mqa(x[:, :s])
    cp = _LatentGatherCP(early_lat, doc[:, :s], pos[:, :s])
    seq = SeqInfo.from_doc_ids(doc[:, s:], pos[:, s:], cp=cp)
    cp.seq = seq
    part = m(x[:, s:], seq)
    torch.testing.assert_close(part, full[:, s:], atol=1e-12, rtol=0)
    gy = torch.randn_like(part)
    g_part = torch.autograd.grad((part * gy).sum(), x)[0]
    g_full = torch.autograd.grad((full[:, s:] * gy).sum(), x)[0]
    torch.testing.assert_close(g_part, g_full, atol=1e-12, rtol=0)


def test_qk_clip_protocol_and_per_head_marks():
    m = _mla()
    targets = qk_clip_targets(m)
    assert {t.kind for t in targets} == {"q", "q_rope", "k"}
    assert getattr(m.q_b_proj.weight, "_k3_head_split") == (4, 24)
    assert getattr(m.kv_b_proj.weight, "_k3_head_segments") == (16, 16)
    # after clipping with tau below the observed max, every head's max logit is <= tau
    m.train()
    doc = _docs(1, 10, [[]])
    x = torch.randn(1, 10, 64, dtype=torch.float64)
    m(x, SeqInfo.from_doc_ids(doc))
    tau = float(m.qk_max.min()) * 0.5
    assert reference_qk_clip_([m], tau) == m.num_heads
    m.qk_max.zero_()
    m(x, SeqInfo.from_doc_ids(doc))
    assert float(m.qk_max.max()) <= tau * (1 + 1e-5)
