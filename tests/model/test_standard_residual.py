"""``model.residual: standard`` (the PreNorm ablation of Block AttnRes): the model equals a literal PreNorm
reference (loss and every gradient), and a pp=2 x vpp=2 pipeline with full recomputation equals the single
process, each boundary carrying exactly one hidden state."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3train.config import ConfigError
from k3train.config.presets import tiny_config, tiny_pipeline_config
from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from helpers import assert_grads_close, packed_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from pipeline_harness import assert_grads_match, in_process_pipeline, make_batches, reference  # noqa: E402

torch.set_num_threads(1)


def _masked_mean_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def prenorm_reference_loss(model: K3Model, batch) -> torch.Tensor:
    """The textbook PreNorm transformer on the model's own modules: ``h = emb``; per layer
    ``h = h + attn(attn_norm(h)); h = h + ffn(ffn_norm(h))``; logits = lm_head(norm(h)); MTP from ``h``."""
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    h = model.embed_tokens(batch.tokens)
    for i in range(model.cfg.num_hidden_layers):
        layer = model.layers[str(i)]
        h = h + layer.attn(layer.attn_norm(h), seq)
        h = h + layer.ffn(layer.ffn_norm(h))
    loss = _masked_mean_ce(model.lm_head(model.norm(h)), batch.labels, batch.loss_mask)
    mtp_h = model.mtp(h, model.embed_tokens(batch.labels), seq)
    return loss + model.cfg.mtp_loss_weight * _masked_mean_ce(model.lm_head(mtp_h), batch.mtp_labels,
                                                              batch.mtp_loss_mask)


def test_standard_residual_equals_prenorm_reference() -> None:
    cfg = tiny_cfg("residual=standard", "num_nextn_predict_layers=1")
    model = K3Model(cfg).to(torch.float64)
    model.init_weights(0)
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "attn_res" in n or "ffn_res" in n or n.startswith("final_attnres")]
    attnres = K3Model(tiny_cfg("num_nextn_predict_layers=1"))
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    assert sum(p.numel() for p in attnres.parameters()) - sum(p.numel() for p in model.parameters()) \
        == (4 * L + 2) * d  # two (query, key-norm) pairs per layer + the final aggregation's

    batch = packed_batch(2, 24, cfg.vocab_size, n_eos=3)
    params = list(model.parameters())
    loss = model(batch)["loss"]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    ref = prenorm_reference_loss(model, batch)
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    torch.testing.assert_close(loss, ref, atol=1e-12, rtol=1e-12)
    zero = [torch.zeros_like(p) for p in params]
    assert_grads_close([(n, g if g is not None else z) for n, g, z in zip(names, grads, zero)],
                       [(n, g if g is not None else z) for n, g, z in zip(names, ref_grads, zero)])
    assert all(g is not None for g in grads), "every parameter takes part in the loss"


def test_residual_value_is_checked() -> None:
    with pytest.raises(ConfigError, match="model.residual"):
        tiny_config("--model.residual=plain")


def test_pipeline_pp2_vpp2_recompute_equals_single_process() -> None:
    M = 4
    cfg = tiny_pipeline_config(2, 2, recompute=True, micro_batches=M, extra=["--model.residual=standard"])
    batches = make_batches(cfg, M)
    ref, rstats = reference(cfg, batches)
    runners, stats = in_process_pipeline(cfg, batches)
    for r in runners:
        assert_grads_match(r.model, ref)
    assert {n for r in runners for n, _ in r.model.named_parameters()} == set(ref)
    assert sum(s["loss"] for s in stats) == pytest.approx(rstats["loss"], rel=1e-6)
    assert stats[-1]["mtp_loss_sum"] == pytest.approx(rstats["mtp_loss_sum"], rel=1e-6)
    # every boundary sends the one hidden state forward and its gradient back; no block cache
    plan = runners[0].plan
    n_bound = plan.part.num_stages - 1
    assert all(plan.payload(b).items() == ["partial"] for b in range(n_bound))
    per = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.model.hidden_size * 4
    assert sum(s["p2p_bytes_block_cache"] for s in stats) == 0
    assert sum(s["p2p_bytes_hidden"] for s in stats) == n_bound * M * per
    assert sum(s["p2p_bytes"] for s in stats) == plan.step_bytes(M, per // (cfg.model.hidden_size * 4),
                                                                 cfg.model.hidden_size, 4)["total"]
