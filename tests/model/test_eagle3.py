"""The EAGLE-3 draft (k3train/model/eagle3.py) against readable references: W_E3 at init gives exactly the feature
the MTP layer reads; the LK / KL losses and the LK gradient against direct formulas in fp64; the unrolled
training-time test against a literal inference-style loop (per start position, the draft re-run step by step on
the sequence it would hold as its KV cache: prefix + its own drafted tokens) -- losses, acceptances and every
draft gradient, fp64."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from k3train.config import ConfigError, load_config
from k3train.config.presets import tiny_pipeline_config as tiny_cfg
from k3train.data.batch import Batch
from k3train.model.eagle3 import (Eagle3Fusion, accepted_length, chain_masks, divergence_sum, draft_features,
                                  draft_loss_sums, token_divergence, unrolled_draft)
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # pipeline_harness
from pipeline_harness import EOS, make_batches  # noqa: E402

EAGLE = ["--train.objective=eagle3", "--checkpoint.target=unused", "--train.draft_feature_blocks=[1,2]"]


def _model(dtype=torch.float32, seed=3) -> tuple[K3Model, object]:
    cfg = tiny_cfg(1, 1, micro_batches=2, extra=EAGLE)
    model = K3Model(cfg.model, cfg.vision, eagle3=True)
    model.init_weights(seed)
    return model.to(dtype), cfg


def _batch(cfg, T: int = 16, seed: int = 4) -> Batch:
    """Two rows of ``T`` random tokens, documents ending at a few EOS (one row starts inside a document)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, cfg.model.vocab_size, (2, T + 1), generator=g)
    s[0, [5, 13]] = EOS
    s[1, 9] = EOS
    return Batch.from_samples(s, eos_id=EOS)


def _target_state(model, batch):
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    with torch.no_grad():
        state = model.forward_layers(model.embed(batch.tokens), 0, model.cfg.num_hidden_layers, seq)
    return state, seq


def test_w_e3_init_is_0_0_I_and_the_fused_feature_is_exactly_what_the_mtp_layer_reads():
    model, cfg = _model()
    d = cfg.model.hidden_size
    assert torch.equal(model.eagle3.weight, torch.cat([torch.zeros(d, 2 * d), torch.eye(d)], dim=1))
    batch = make_batches(cfg, 1)[0]
    state, seq = _target_state(model, batch)
    low, mid, high = draft_features(model, state, (1, 2))
    assert low is state.blocks[1] and mid is state.blocks[2]
    fused = model.eagle3(low, mid, high)
    assert torch.equal(fused, high) and torch.equal(high, model.final_aggregate(state))  # bit for bit
    assert not torch.equal(low, high) and not torch.equal(mid, high)
    # so the draft's first step at init is the pre-trained MTP layer (h_main = the final aggregation)
    with torch.no_grad():
        step0 = model.mtp.norm(unrolled_draft(model.mtp, fused, model.embed_tokens, batch.labels, seq, 1)[0])
        mtp = model.mtp(model.final_aggregate(state), model.embed_tokens(batch.labels), seq)
    torch.testing.assert_close(step0, mtp, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="not a completed AttnRes block"):
        draft_features(model, state, (1, 3))


def test_lk_and_kl_losses_and_the_lk_gradient_against_direct_formulas_fp64():
    g = torch.Generator().manual_seed(0)
    zq = (3 * torch.randn(6, 50, generator=g, dtype=torch.float64)).requires_grad_()
    zp = 3 * torch.randn(6, 50, generator=g, dtype=torch.float64)
    p, q = torch.softmax(zp, -1), torch.softmax(zq.detach(), -1)
    alpha = torch.where(q < p, q, p).sum(-1)  # sum_x min(p, q), by hand
    loss, accept = token_divergence(zq, zp, "lk")
    torch.testing.assert_close(accept, alpha, atol=1e-15, rtol=1e-13)
    torch.testing.assert_close(loss, -alpha.log(), atol=1e-15, rtol=1e-13)
    w = torch.randn(6, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((loss * w).sum(), zq)
    # d(-log alpha)/dz_k = -(1/alpha) sum_{x: q_x < p_x} q_x (delta_xk - q_k)
    below = (q < p).to(q.dtype)
    want = -(below * q - q * (below * q).sum(-1, keepdim=True)) / alpha[:, None] * w[:, None]
    torch.testing.assert_close(grad, want, atol=1e-14, rtol=1e-12)
    kl, _ = token_divergence(zq, zp, "kl")
    torch.testing.assert_close(kl, (p * (p.log() - q.log())).sum(-1), atol=1e-14, rtol=1e-12)
    (gkl,) = torch.autograd.grad(kl.sum(), zq)
    torch.testing.assert_close(gkl, q - p, atol=1e-14, rtol=1e-12)  # the soft-label cross-entropy gradient
    with pytest.raises(ValueError, match="draft loss"):
        token_divergence(zq, zp, "ce")
    # the LM-head chunks (under activation checkpointing) sum to the same loss and gradient
    head = torch.nn.Linear(8, 50, bias=False).double()
    hq = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    hp, mask = torch.randn(2, 5, 8, generator=g, dtype=torch.float64), (torch.rand(2, 5, generator=g) > 0.3).double()
    outs = []
    for chunk in (4, 100):
        s, a = divergence_sum(hq, hp, head, mask, "lk", chunk_tokens=chunk)
        outs.append((s, a, torch.autograd.grad(s, hq)[0]))
    for x, y in zip(outs[0], outs[1]):
        torch.testing.assert_close(x, y, atol=1e-14, rtol=1e-12)
    assert accepted_length(torch.tensor([[0.5], [0.5], [1.0]])).item() == pytest.approx(0.5 + 0.25 + 0.25)


def _literal_loop(model, batch, seq, state, steps, kind):
    """Per start position t: the draft's KV cache is the step-0 inputs of positions <= t (its document) followed
    by the tokens it drafted; each step re-runs the plain MTP layer (its own causal, document-masked MLA) on that
    whole sequence and takes the last position. Returns per-step loss sums and acceptance sums (differentiable)."""
    low, mid, high = draft_features(model, state, (1, 2))
    fused = model.eagle3(low, mid, high)
    with torch.no_grad():
        target_hidden = model.norm(high)
    masks = chain_masks(batch.loss_mask, steps)
    B, T = batch.tokens.shape
    loss = [fused.new_zeros(()) for _ in range(steps)]
    accept = [0.0] * steps
    lengths = []
    for b in range(B):
        for t in range(T):
            if not masks[0][b, t]:
                continue
            inputs, toks = list(fused[b, :t + 1]), list(batch.labels[b, :t + 1])
            docs, pos = list(batch.doc_ids[b, :t + 1]), list(batch.positions[b, :t + 1])
            alphas = []
            for j in range(steps):
                if not masks[j][b, t]:
                    break
                sq = SeqInfo.from_doc_ids(torch.stack(docs)[None], torch.stack(pos)[None])
                h = model.mtp.hidden(torch.stack(inputs)[None], model.embed_tokens(torch.stack(toks))[None], sq)
                out = h[0, -1]
                zq = model.lm_head(model.mtp.norm(out))[None]
                zp = model.lm_head(target_hidden[b, t + 1 + j])[None]
                ell, a = token_divergence(zq, zp, kind)
                loss[j] = loss[j] + ell[0]
                accept[j] += float(a[0].detach())
                alphas.append(float(a[0].detach()))
                inputs.append(out)
                toks.append(batch.labels[b, t + 1 + j])
                docs.append(batch.doc_ids[b, t])
                pos.append(batch.positions[b, t] + 1 + j)
            if len(alphas) == steps:
                lengths.append(float(accepted_length(torch.tensor(alphas, dtype=torch.float64)[:, None])))
    return torch.stack(loss), torch.tensor(accept, dtype=torch.float64), sum(lengths)


@pytest.mark.parametrize("kind", ["lk", "kl"])
def test_unrolled_training_time_test_equals_a_literal_step_by_step_loop(kind):
    torch.manual_seed(0)
    model, cfg = _model(torch.float64)
    model.eval()  # no router statistics / QK maxima (they do not enter the outputs)
    with torch.no_grad():  # a W_E3 away from its init, so low and mid features count (and get a gradient)
        model.eagle3.weight.add_(0.05 * torch.randn_like(model.eagle3.weight))
    batch = _batch(cfg)
    steps = 4
    state, seq = _target_state(model, batch)
    draft = [(n, p) for n, p in model.named_parameters() if n.split(".")[0] in ("mtp", "eagle3")]
    sums = draft_loss_sums(model, state, batch, seq, steps=steps, kind=kind, blocks=(1, 2))
    got = torch.autograd.grad(sums["draft_loss_sum"].sum(), [p for _, p in draft], allow_unused=True)
    ref_loss, ref_accept, ref_len = _literal_loop(model, batch, seq, state, steps, kind)
    want = torch.autograd.grad(ref_loss.sum(), [p for _, p in draft], allow_unused=True)
    masks = chain_masks(batch.loss_mask, steps)
    assert [float(m.sum()) for m in masks] == sums["draft_tokens"].tolist() and float(masks[-1].sum()) > 3
    torch.testing.assert_close(sums["draft_loss_sum"], ref_loss.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(sums["draft_accept_sum"], ref_accept, atol=1e-12, rtol=1e-10)
    assert float(sums["draft_accept_len_sum"]) == pytest.approx(ref_len, rel=1e-10)
    n = 0
    for (name, _), a, b in zip(draft, got, want):
        if b is None:
            assert a is None or not a.abs().max(), name
            continue
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
        n += 1
    assert n >= 10 and any(name == "eagle3.weight" for name, _ in draft)


def test_config_rejects_eagle3_without_target_and_other_misfits():
    cfg = tiny_cfg(1, 1, micro_batches=2, extra=EAGLE)
    assert cfg.train.objective == "eagle3" and cfg.train.draft_steps == 7
    base = [a for a in EAGLE if not a.startswith("--checkpoint.target")]
    cases = [(base, "checkpoint.target: train.objective=eagle3 needs the frozen target"),
             (EAGLE + ["--model.num_nextn_predict_layers=0"], "model.num_nextn_predict_layers"),
             (EAGLE + ["--train.draft_feature_blocks=[1,3]"], "two completed AttnRes blocks in 1..2"),
             (EAGLE + ["--train.draft_loss=ce"], "train.draft_loss"),
             (["--checkpoint.target=x"], "checkpoint.target: is read only by train.objective=eagle3")]
    for extra, needle in cases:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
            tiny_cfg(1, 1, micro_batches=2, extra=extra)
    assert load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml").train.objective == "lm"
    assert isinstance(K3Model(cfg.model).eagle3, type(None)) and Eagle3Fusion(4).weight.shape == (4, 12)
