"""Block AttnRes against literal formulas: the aggregation, a whole model with blocks of 3 layers, and block size 1
== full AttnRes (every layer's output its own source). Outputs and gradients, float64."""
import torch

from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.attnres import AttnRes, AttnResState, attn_res_aggregate
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from helpers import assert_grads_close, packed_batch

torch.set_num_threads(1)


def literal_aggregate(sources, res: AttnRes):
    """alpha_i = exp(w . RMSNorm(s_i)) / sum_j exp(w . RMSNorm(s_j));  h = sum_i alpha_i s_i (per token)."""
    scores = [torch.exp((res.key_norm(s) * res.query).sum(-1, keepdim=True)) for s in sources]
    total = sum(scores)
    return sum(sc / total * s for sc, s in zip(scores, sources))


def _randomise(model):
    """Non-zero pseudo-queries and key-norm gains (zero queries would make every aggregation a plain mean)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query") or "key_norm" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if "key_norm" in name else 0))


def test_aggregate_matches_literal_and_recompute():
    torch.manual_seed(0)
    res = AttnRes(16, 1e-5).double()
    with torch.no_grad():
        res.query.normal_()
        res.key_norm.weight.normal_()
    srcs = [torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    params = [res.query, res.key_norm.weight]
    names = [f"src{i}" for i in range(4)] + ["query", "key_norm.weight"]
    for recompute in (False, True):
        out = res(srcs, None, recompute)
        ref = literal_aggregate(srcs, res)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        gy = torch.randn_like(out)
        g = torch.autograd.grad((out * gy).sum(), [*srcs, *params])
        g_ref = torch.autograd.grad((ref * gy).sum(), [*srcs, *params])
        assert_grads_close(zip(names, g), zip(names, g_ref), tight=1e-12)
    # zero query -> uniform average; one source -> the source itself
    res0 = AttnRes(16, 1e-5).double()
    torch.testing.assert_close(res0(srcs), sum(srcs) / 4, atol=1e-12, rtol=0)
    assert torch.equal(attn_res_aggregate(srcs[:1], res.query, res.key_norm), srcs[0])


def literal_block_model(model: K3Model, tokens, seq, block_size):
    """Block AttnRes from the formulas, recomputing every source from the list of per-layer outputs:
    b_0 = embedding, b_n = sum of the outputs of the layers of block n, partial = sum of the outputs of the
    current block's earlier layers (absent for a block's first layer); the FFN sublayer also sees the partial sum
    that includes its own layer's attention output. Returns the final aggregation (before the final norm)."""
    emb = model.embed_tokens(tokens)
    outs = []  # o_l = attn_l + ffn_l, the output of layer l
    L = model.cfg.num_hidden_layers
    for l in range(L):
        layer = model.layers[str(l)]
        n, first = l // block_size, (l // block_size) * block_size
        blocks = [emb] + [sum(outs[j * block_size:(j + 1) * block_size]) for j in range(n)]
        partial = [sum(outs[first:l])] if l > first else []
        a = layer.attn(layer.attn_norm(literal_aggregate(blocks + partial, layer.attn_res)), seq)
        partial_f = (partial[0] + a) if partial else a
        f = layer.ffn(layer.ffn_norm(literal_aggregate(blocks + [partial_f], layer.ffn_res)))
        outs.append(a + f)
    n_full = L // block_size
    final = [emb] + [sum(outs[j * block_size:(j + 1) * block_size]) for j in range(n_full)]
    if L % block_size:
        final.append(sum(outs[n_full * block_size:]))
    return literal_aggregate(final, model.final_attnres)


def literal_full_attnres(model: K3Model, tokens, seq):
    """Full AttnRes: every layer's output is its own source, h_l = sum_{i<l} alpha_{i->l} v_i with v_0 = embedding
    (the FFN sublayer additionally sees its own layer's attention output as the newest source)."""
    v = [model.embed_tokens(tokens)]
    for l in range(model.cfg.num_hidden_layers):
        layer = model.layers[str(l)]
        a = layer.attn(layer.attn_norm(literal_aggregate(v, layer.attn_res)), seq)
        f = layer.ffn(layer.ffn_norm(literal_aggregate(v + [a], layer.ffn_res)))
        v.append(a + f)
    return literal_aggregate(v, model.final_attnres)


def _check_model_vs(literal_fn, *over):
    cfg = tiny_cfg("num_hidden_layers=5", "num_nextn_predict_layers=0", *over)
    torch.manual_seed(0)
    model = K3Model(cfg).double()
    model.init_weights(3)
    _randomise(model)
    batch = packed_batch(2, 12, cfg.vocab_size)
    seq = SeqInfo.from_doc_ids(batch.doc_ids)
    params = list(model.parameters())
    state = model.forward_layers(model.embed(batch.tokens), 0, cfg.num_hidden_layers, seq)
    out = model.final_aggregate(state)
    ref = literal_fn(model, batch.tokens, seq)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    gy = torch.randn_like(out)
    g = torch.autograd.grad((out * gy).sum(), params, allow_unused=True)
    g_ref = torch.autograd.grad((ref * gy).sum(), params, allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    used = [i for i, b in enumerate(g_ref) if b is not None]
    for i in set(range(len(names))) - set(used):  # unused by the formula (e.g. the LM head) -> unused by the model
        assert g[i] is None or not g[i].any(), names[i]
    assert_grads_close([(names[i], g[i]) for i in used], [(names[i], g_ref[i]) for i in used])


def test_block_attnres_model_matches_literal():
    # 5 layers in blocks of 2: blocks end after layers 2 and 4, the last block is partial (1 layer)
    _check_model_vs(lambda m, t, s: literal_block_model(m, t, s, 2), "attn_res_block_size=2")


def test_block_size_one_is_full_attnres():
    _check_model_vs(literal_full_attnres, "attn_res_block_size=1")


def test_state_canonical_check():
    st = AttnResState(blocks=[torch.zeros(1)], partial=None)
    st.check_canonical(0, 3)
    try:
        st.check_canonical(1, 3)
    except ValueError as e:
        assert "partial" in str(e)
    else:
        raise AssertionError("non-canonical state accepted")


def _saved_bytes(fn, keep):
    """Bytes of the tensors autograd saves while running ``fn`` that are not storages of ``keep``."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in kept:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_recompute_saves_nothing_but_the_output():
    """With recompute (the fused aggregation), an aggregation + pre-norm keeps no activations of its own besides
    3N + 1 scalars per token (the sources are resident anyway; the parameters are saved by reference); without
    it, it keeps the stacked sources, normalised keys and weights."""
    from k3train.model.norm import RMSNorm
    torch.manual_seed(0)
    res, pre = AttnRes(32, 1e-5), RMSNorm(32)
    srcs = [torch.randn(2, 8, 32, requires_grad=True) for _ in range(5)]
    keep = [*srcs, *res.parameters(), *pre.parameters()]
    out_rc, saved_rc = _saved_bytes(lambda: res(srcs, pre, recompute=True), keep)
    out_plain, saved_plain = _saved_bytes(lambda: res(srcs, pre, recompute=False), keep)
    torch.testing.assert_close(out_rc, out_plain, atol=1e-6, rtol=1e-6)
    assert saved_rc <= (3 * 5 + 1) * 2 * 8 * 4
    assert saved_plain >= 5 * 2 * 8 * 32 * 4  # at least the stacked sources


def test_fused_aggregate_norm_matches_the_autograd_reference():
    """k3train/model/attnres_fused.py against the reference (attn_res_aggregate, then RMSNorm, through autograd):
    output and the gradients of every source, the query, the key-norm and pre-norm gains -- fp64 tight, with and
    without a pre-norm, one source and several; fp32 tight and bf16 loose; and rms_norm against RMSNorm."""
    from k3train.model.attnres_fused import aggregate_norm, rms_norm
    from k3train.model.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float64, 1e-11), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for n, with_pre in ((1, True), (4, True), (4, False)):
            res, pre = AttnRes(24, 1e-5).to(dtype), RMSNorm(24).to(dtype)
            with torch.no_grad():
                for p in (res.query, res.key_norm.weight, pre.weight):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.7 + (0 if p is res.query else 1))
            # sources of different scales (as block sums grow with depth)
            srcs = [(torch.randn(2, 7, 24, generator=g) * (1 + i)).to(dtype).requires_grad_() for i in range(n)]
            pn = pre if with_pre else None
            params = [res.query, res.key_norm.weight] + ([pre.weight] if with_pre else [])
            names = [f"src{i}" for i in range(n)] + ["query", "key_norm", "pre_norm"][:len(params)]
            out = aggregate_norm(srcs, res.query, res.key_norm, pn)
            h = attn_res_aggregate(srcs, res.query, res.key_norm)
            ref = pre(h) if with_pre else h
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
            gy = torch.randn(out.shape, generator=g).to(dtype)
            got = torch.autograd.grad((out.float() * gy.float()).sum(), [*srcs, *params])
            want = torch.autograd.grad((ref.float() * gy.float()).sum(), [*srcs, *params])
            for nm, a, b in zip(names, got, want):
                scale = b.abs().max().item() + 1e-30
                assert a.dtype == b.dtype and (a - b).abs().max().item() <= tol * scale, (dtype, n, nm)
        x = (torch.randn(3, 5, 24, generator=g) * 3).to(dtype).requires_grad_()
        out, ref = rms_norm(x, pre), pre(x)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        got = torch.autograd.grad((out.float() * ref.detach().float()).sum(), [x, pre.weight])
        want = torch.autograd.grad((ref.float() * ref.detach().float()).sum(), [x, pre.weight])
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() <= tol * (b.abs().max().item() + 1e-30), dtype
