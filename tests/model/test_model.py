"""K3Model seams: split at any layer == whole (outputs + grads, state handed over detached), recompute on/off,
MTP loss, name-seeded init (determinism, pruning and meta-build independence), and that it learns."""
import gzip
from pathlib import Path

import pytest
import torch

from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.data.batch import Batch
from k3train.model.attnres import AttnResState
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from helpers import assert_grads_close, packed_batch

torch.set_num_threads(1)
ASSETS = Path(__file__).resolve().parents[2] / "k3train" / "data" / "assets"


def _model(*over, seed=0, dtype=torch.float64):
    cfg = tiny_cfg(*over)
    model = K3Model(cfg).to(dtype)
    model.init_weights(seed)
    with torch.no_grad():  # make AttnRes non-trivial
        g = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if n.endswith("query"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return model


def _loss(model, out):
    return out["lm_loss_sum"] / out["lm_tokens"] + model.cfg.mtp_loss_weight * out["mtp_loss_sum"] / out["mtp_tokens"]


def _whole(model, batch):
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    state = model.forward_layers(model.embed(batch.tokens), 0, model.cfg.num_hidden_layers, seq)
    out = model.loss_sums(state, batch, seq)
    loss = _loss(model, out)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return loss.detach(), grads


def _split(model, batch, cut):
    """Two 'stages': [0, cut) and [cut, L). The state crosses as detached leaves and its gradient is sent back."""
    seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    params = list(model.parameters())
    s1 = model.forward_layers(model.embed(batch.tokens), 0, cut, seq)
    sent = s1.blocks + ([s1.partial] if s1.partial is not None else [])
    recv = [t.detach().requires_grad_(True) for t in sent]
    s2_in = AttnResState(blocks=recv[:len(s1.blocks)], partial=recv[-1] if s1.partial is not None else None)
    s2 = model.forward_layers(s2_in, cut, model.cfg.num_hidden_layers, seq)
    loss = _loss(model, model.loss_sums(s2, batch, seq))
    g2 = torch.autograd.grad(loss, params + recv, allow_unused=True)
    grad_recv = g2[len(params):]
    # stage 1 backward with the received gradients (blocks a stage never touched get no gradient)
    pairs = [(t, g) for t, g in zip(sent, grad_recv) if g is not None and t.requires_grad]
    g1 = torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs], allow_unused=True)
    grads = [None if a is None and b is None else (0 if a is None else a) + (0 if b is None else b)
             for a, b in zip(g1, g2[:len(params)])]
    return loss.detach(), grads


def test_split_at_every_layer_equals_whole():
    model = _model("num_hidden_layers=6", "attn_res_block_size=2")
    model.train()
    batch = packed_batch(2, 24, model.cfg.vocab_size)
    loss, grads = _whole(model, batch)
    names = [n for n, _ in model.named_parameters()]
    for cut in range(0, 7):
        loss_c, grads_c = _split(model, batch, cut)
        torch.testing.assert_close(loss_c, loss, atol=1e-12, rtol=1e-12)
        both = [(n, a, b) for n, a, b in zip(names, grads, grads_c) if a is not None or b is not None]
        assert all(a is not None and b is not None for _, a, b in both), f"cut {cut}: gradient missing"
        assert_grads_close([(n, b) for n, _, b in both], [(n, a) for n, a, _ in both])


def test_recompute_changes_nothing():
    batch = packed_batch(2, 16, 4096)
    m1 = _model("attn_res_recompute=true")
    m2 = _model("attn_res_recompute=false")
    m1.train(), m2.train()
    l1, g1 = _whole(m1, batch)
    l2, g2 = _whole(m2, batch)
    # the fused aggregation (attnres_fused.py) reorders the reference's arithmetic: equal to fp64 rounding
    torch.testing.assert_close(l1, l2, atol=1e-12, rtol=1e-12)
    names = [n for n, _ in m1.named_parameters()]
    assert_grads_close([(n, a) for n, a in zip(names, g1) if a is not None],
                       [(n, b) for n, b in zip(names, g2) if b is not None], tight=1e-12, norm_tol=1e-12)


def test_forward_layers_rejects_wrong_state():
    model = _model("attn_res_block_size=3", dtype=torch.float32)
    batch = packed_batch(1, 8, 4096)
    seq = SeqInfo.from_doc_ids(batch.doc_ids)
    with pytest.raises(ValueError, match="before layer 2"):
        model.forward_layers(model.embed(batch.tokens), 2, 4, seq)


def test_mtp_loss_finite_and_masked():
    model = _model(dtype=torch.float32)
    batch = packed_batch(2, 32, model.cfg.vocab_size, n_eos=3)
    out = model(batch)
    assert torch.isfinite(out["mtp_loss_sum"]) and out["mtp_loss_sum"] > 0
    assert out["mtp_tokens"] == batch.mtp_loss_mask.sum() and out["lm_tokens"] == batch.loss_mask.sum()
    # change the MTP targets only where the MTP mask is 0: nothing moves
    masked = batch.mtp_loss_mask == 0
    assert masked.any()
    labels = batch.mtp_labels.clone()
    labels[masked] = (labels[masked] + 17) % model.cfg.vocab_size
    out2 = model(Batch(batch.tokens, batch.labels, batch.loss_mask, batch.doc_ids, batch.positions, labels,
                       batch.mtp_loss_mask))
    assert torch.equal(out2["mtp_loss_sum"], out["mtp_loss_sum"])
    # ... and where it is 1, the MTP loss moves
    labels[~masked] = (labels[~masked] + 17) % model.cfg.vocab_size
    out3 = model(Batch(batch.tokens, batch.labels, batch.loss_mask, batch.doc_ids, batch.positions, labels,
                       batch.mtp_loss_mask))
    assert not torch.equal(out3["mtp_loss_sum"], out["mtp_loss_sum"])
    torch.testing.assert_close(out3["lm_loss_sum"], out["lm_loss_sum"])
    # the reference loss composition
    want = out["lm_loss_sum"] / out["lm_tokens"] + model.cfg.mtp_loss_weight * out["mtp_loss_sum"] / out["mtp_tokens"]
    torch.testing.assert_close(out["loss"], want)
    # without MTP: zero sums
    out_nomtp = _model("num_nextn_predict_layers=0", dtype=torch.float32)(batch)
    assert out_nomtp["mtp_loss_sum"] == 0 and out_nomtp["mtp_tokens"] == 0


# ---------------------------------------------------------------------------------------------------------------
# init
def _state(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_init_deterministic_and_seed_dependent():
    cfg = tiny_cfg()
    torch.manual_seed(1)
    a = K3Model(cfg)
    torch.manual_seed(2)
    b = K3Model(cfg)
    a.init_weights(7)
    b.init_weights(7)
    for n, t in _state(a).items():
        assert torch.equal(t, _state(b)[n]), n
    b.init_weights(8)
    assert not torch.equal(a.layers["1"].attn.q_proj.weight, b.layers["1"].attn.q_proj.weight)


def test_init_independent_of_pruning_and_meta_build():
    cfg = tiny_cfg()
    full = K3Model(cfg)
    full.init_weights(7)
    ref = _state(full)
    # a pipeline chunk: layers [2, L) removed, no head / final parts
    pruned = K3Model(cfg)
    for i in range(2, cfg.num_hidden_layers):
        del pruned.layers[str(i)]
    pruned.lm_head = pruned.final_attnres = pruned.norm = pruned.mtp = None
    pruned.init_weights(7)
    st = _state(pruned)
    assert len(st) > 10
    for n, t in st.items():
        assert torch.equal(t, ref[n]), n
    # built on the meta device, materialised with to_empty (garbage), then initialised
    with torch.device("meta"):
        meta = K3Model(cfg)
    with pytest.raises(ValueError, match="meta device"):
        meta.init_weights(7)
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    # the optimizer's per-head marks survive (to_empty replaces Parameter objects; init_weights re-marks them)
    assert getattr(meta.layers["0"].attn.q_proj.weight, "_k3_head_split") == (4, 16)
    assert getattr(meta.layers["3"].attn.kv_b_proj.weight, "_k3_head_segments") == (16, 16)
    st = _state(meta)
    assert st.keys() == ref.keys()
    for n, t in st.items():
        assert torch.equal(t, ref[n]), n


def test_init_rules():
    cfg = tiny_cfg("hidden_size=256", "num_hidden_layers=4", "kda_num_heads=8", "kda_head_dim=32")
    m = K3Model(cfg)
    m.init_weights(0)
    std, L = cfg.init_std, cfg.num_hidden_layers
    kda = m.layers["0"].attn
    assert abs(kda.q_proj.weight.std().item() - std) < 0.05 * std
    assert abs(kda.o_proj.weight.std().item() - std / (2 * L) ** 0.5) < 0.05 * std / (2 * L) ** 0.5
    assert torch.equal(kda.A_log, torch.zeros_like(kda.A_log))
    assert torch.equal(m.layers["0"].attn_res.query, torch.zeros(cfg.hidden_size))
    assert torch.equal(m.layers["0"].attn_norm.weight, torch.ones(cfg.hidden_size))
    assert torch.equal(m.layers["1"].ffn.router.bias, torch.zeros(cfg.num_experts))
    # decay bias: initial log decay -dt with dt in [1e-3, 1e-1]
    g0 = cfg.gate_lower_bound * torch.sigmoid(kda.dt_bias)
    assert (g0 <= -1e-3 * 0.999).all() and (g0 >= -0.1 * 1.001).all()
    # routed experts: per-expert seeds, so expert e's slice depends only on (seed, fqn, e)
    ex = m.layers["1"].ffn.experts
    assert not torch.equal(ex.w_gate[0], ex.w_gate[1])
    ex.expert_offset = 3  # an expert-parallel shard holding experts 3.. gets the full model's slices
    full = ex.w_gate.detach().clone()
    m.init_weights(0)
    assert torch.equal(ex.w_gate[0], full[3])


# ---------------------------------------------------------------------------------------------------------------
def _real_text_batch(B, T, vocab):
    """Real text tokens when the corpus is present (the shipped tokenizer if it exists, else bytes), else a
    repeated pattern."""
    text_path = next(iter(sorted(ASSETS.glob("*.txt.gz"))), None)
    tok_path = ASSETS / "tokenizer.json"
    if text_path is not None:
        text = gzip.open(text_path, "rt", encoding="utf-8").read(20000)
        if tok_path.exists():
            from k3train.data.tokenizer import load_tokenizer
            ids = load_tokenizer(tok_path).encode(text)
        else:
            ids = [3 + b for b in text.encode("utf-8")]
    else:
        ids = [3 + (i * 7) % 50 for i in range(B * (T + 1))]
    samples = torch.tensor(ids[:B * (T + 1)], dtype=torch.long).view(B, T + 1)
    assert samples.max() < vocab
    return Batch.from_samples(samples, eos_id=1)


def test_tiny_model_learns():
    torch.manual_seed(0)
    model = K3Model(tiny_cfg())
    model.init_weights(0)
    model.train()
    batch = _real_text_batch(1, 64, model.cfg.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        out = model(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["lm_loss_sum"].item() / out["lm_tokens"].item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_chunked_lm_head_ce_equals_direct():
    from k3train.model.loss import lm_head_ce_sum, masked_ce_sum
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    h = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, 0] = -100  # masked garbage label
    mask = (torch.rand(3, 7) > 0.3).double()
    mask[0, 0] = 0
    direct = masked_ce_sum(head(h), labels, mask)
    chunked = lm_head_ce_sum(h, head, labels, mask, chunk_tokens=4)
    torch.testing.assert_close(chunked, direct, atol=1e-12, rtol=1e-12)
    params = [h, head.weight]
    for a, b in zip(torch.autograd.grad(direct, params), torch.autograd.grad(chunked, params)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
