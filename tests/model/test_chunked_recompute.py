"""Long-context chunking and recomputation (k3train/model/chunking.py, K3Model.set_recompute) equal the plain model:
head chunks of the KDA and MLA token mixers (their output projections summed in fp32), token chunks of the
LatentMoE (and of the MTP layer's), each recomputed on its own under ``sublayer``, whole layers under ``layer`` --
loss, every parameter gradient and the routers' statistics within 1e-12 in fp64; and what ``sublayer`` keeps:
one hidden state per sublayer, with one chunk's activations live in a backward."""
from __future__ import annotations

import pytest
import torch
from helpers import packed_batch
from model_variants import VARIANTS

from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from k3train.planning.fakerun.live_bytes import LiveBytes

torch.set_num_threads(1)
F64 = torch.float64


def _run(unit, *over, dtype=F64, batch=None):
    cfg = tiny_cfg(*over)
    model = K3Model(cfg).to(dtype)
    model.init_weights(0)
    model.train()
    model.set_recompute(unit)
    batch = batch or packed_batch(2, 96, cfg.vocab_size, cfg.eos_token_id, seed=3)
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    out = model.loss_sums(model.forward_layers(model.embed(batch.tokens), 0, cfg.num_hidden_layers, seq), batch, seq)
    loss = out["lm_loss_sum"] / out["lm_tokens"] + cfg.mtp_loss_weight * out["mtp_loss_sum"] / out["mtp_tokens"]
    loss.backward()
    loads = {n: r.expert_loads.clone() for n, r in model.routers()}
    qk = {n: m.qk_max.clone() for n, m in model.named_modules() if hasattr(m, "qk_max")}
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, loads, qk


@pytest.mark.parametrize("unit,over", [
    ("sublayer", ("mixer_head_chunk=1", "moe_token_chunk=40")),  # 4 head chunks of 1, 5 token chunks (last short)
    ("sublayer", ("mixer_head_chunk=3",)),                       # chunks of 3 + 1 heads; MoE whole: one region
    ("layer", ("mixer_head_chunk=2", "moe_token_chunk=64")),     # chunks without recomputation inside a layer
    (None, ("mixer_head_chunk=1", "moe_token_chunk=40")),
    # the published Kimi Linear variant (tests/model_variants.py): each KDA head chunk reads its rows of the low-rank
    # output gate; MLA without query compression or output gate; MoE without the latent projection
    ("sublayer", ("mixer_head_chunk=3", "moe_token_chunk=40", *(v.removeprefix("--model.")
                                                                  for v in VARIANTS["kimi_linear"]))),
])
def test_chunked_and_recomputed_equal_plain_fp64(unit, over):
    variant = tuple(o for o in over if not o.startswith(("mixer_head_chunk=", "moe_token_chunk=")))
    loss_ref, g_ref, loads_ref, qk_ref = _run(None, *variant)
    loss, g, loads, qk = _run(unit, *over)
    torch.testing.assert_close(loss, loss_ref, atol=1e-12, rtol=0)
    assert set(g) == set(g_ref)
    for n in g:
        assert g[n] is not None and g_ref[n] is not None, n
        torch.testing.assert_close(g[n], g_ref[n], atol=1e-12, rtol=1e-10, msg=lambda s: f"grad of {n}: {s}")
    for n in loads_ref:  # routing counted once per token (not again in the recomputation)
        assert torch.equal(loads[n], loads_ref[n]), n
    for n in qk_ref:
        torch.testing.assert_close(qk[n], qk_ref[n], atol=1e-12, rtol=0)


def test_bf16_head_chunks_sum_in_fp32():
    """bf16: the chunks' output projections summed in fp32 and rounded once stay as close to the unchunked layer
    as the bf16 matmul itself."""
    loss_ref, g_ref, _, _ = _run(None, dtype=torch.bfloat16)
    loss, g, _, _ = _run("sublayer", "mixer_head_chunk=1", "moe_token_chunk=40", dtype=torch.bfloat16)
    torch.testing.assert_close(loss.float(), loss_ref.float(), atol=0.02, rtol=0.0)


def _saved_bytes(unit, *over) -> tuple[int, int]:
    cfg = tiny_cfg("hidden_size=64", *over)
    model = K3Model(cfg)
    model.init_weights(0)
    model.train()
    model.set_recompute(unit)
    batch = packed_batch(1, 512, cfg.vocab_size, cfg.eos_token_id, seed=3)
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    state = model.embed(batch.tokens)
    leaves = [t.detach().requires_grad_() for t in state.blocks]
    state.blocks = leaves
    with LiveBytes() as lb:
        lb.track([*model.parameters(), *model.buffers(), *leaves])  # existing storages (weight views are not new)
        base = lb.live
        out = model.forward_layers(state, 0, cfg.num_hidden_layers, seq)
        saved = lb.live - base
        lb.reset_peak()
        out.blocks[-1].sum().backward() if out.partial is None else out.partial.sum().backward()
        peak = lb.peak - base
    return saved, peak


def test_sublayer_keeps_one_hidden_per_sublayer():
    """Measured (live tensor bytes, 512 tokens, d = 64 fp32 = 128 KiB per hidden state): without recomputation the
    8 layers keep many hidden-sized tensors each; ``sublayer`` keeps about one per sublayer (the partial sums and
    the chunked modules' inputs) and its backward holds one chunk at a time."""
    hidden = 512 * 64 * 4
    plain, plain_peak = _saved_bytes(None)
    sub, sub_peak = _saved_bytes("sublayer", "mixer_head_chunk=1", "moe_token_chunk=128")
    assert sub < plain / 4, (sub, plain)
    # per sublayer of the 8 layers: its partial sum, and a chunked module's input (the mixers' and MoE's); plus
    # per-token scalars (AttnRes weights, norms) and the MLA latents: 2.25 hidden states per sublayer here
    assert sub <= 2.5 * 8 * 2 * hidden, (sub / hidden)
    assert sub_peak < plain_peak, (sub_peak, plain_peak)
