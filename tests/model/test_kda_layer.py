"""KDA layer: chunked op vs token-loop reference (outputs + all gradients), document isolation, decay range."""
import pytest
import torch

from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.kda import KDALayer, kda_decay
from k3train.model.seq import SeqInfo
from k3train.ops.kda import naive_recurrent_kda

torch.set_num_threads(1)


def _layer(form="lower_bounded", seed=0):
    cfg = tiny_cfg(f"kda_decay_form={form}", "kda_chunk_size=16")
    torch.manual_seed(seed)
    layer = KDALayer(cfg).double()
    with torch.no_grad():  # non-trivial decay scale and bias
        layer.A_log.normal_(0, 0.5)
        layer.dt_bias.normal_(0, 1.0)
    return layer


def _docs(T, starts, B=1):
    d = torch.zeros(B, T, dtype=torch.long)
    for s in starts:
        d[:, s:] += 1
    return d


@pytest.mark.parametrize("form", ["lower_bounded", "softplus"])
def test_kda_layer_chunk_matches_naive(form):
    layer = _layer(form)
    B, T = 2, 40
    doc = _docs(T, [13, 30], B)
    doc[1] = _docs(T, [25])[0]
    seq = SeqInfo.from_doc_ids(doc)
    x = torch.randn(B, T, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    y = layer(x, seq)
    params = [p for p in layer.parameters()]
    gy = torch.randn_like(y)
    grads = torch.autograd.grad((y * gy).sum(), [x, *params])
    layer.kda_op = naive_recurrent_kda
    y_ref = layer(x, seq)
    grads_ref = torch.autograd.grad((y_ref * gy).sum(), [x, *params])
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-10)
    for (name, _), g, gr in zip([("x", None), *layer.named_parameters()], grads, grads_ref):
        torch.testing.assert_close(g, gr, atol=1e-10, rtol=1e-10, msg=lambda m: f"grad of {name}: {m}")


def test_kda_layer_documents_are_independent():
    """A packed row [A | B] gives the same outputs as A and B run as separate rows (state and conv reset)."""
    layer = _layer()
    Ta, Tb = 19, 21
    x = torch.randn(1, Ta + Tb, layer.hidden_size, dtype=torch.float64)
    packed = layer(x, SeqInfo.from_doc_ids(_docs(Ta + Tb, [Ta])))
    ya = layer(x[:, :Ta], SeqInfo.from_doc_ids(torch.zeros(1, Ta, dtype=torch.long)))
    yb = layer(x[:, Ta:], SeqInfo.from_doc_ids(torch.zeros(1, Tb, dtype=torch.long)))
    torch.testing.assert_close(packed, torch.cat([ya, yb], 1), atol=1e-12, rtol=0)


def test_kda_layer_is_causal():
    layer = _layer()
    T = 24
    x = torch.randn(1, T, layer.hidden_size, dtype=torch.float64)
    seq = SeqInfo.from_doc_ids(torch.zeros(1, T, dtype=torch.long))
    y = layer(x, seq)
    x2 = x.clone()
    x2[:, 15:] += 1.0
    y2 = layer(x2, seq)
    torch.testing.assert_close(y[:, :15], y2[:, :15], atol=1e-12, rtol=0)
    assert not torch.allclose(y[:, 15:], y2[:, 15:])


def test_decay_forms():
    z = torch.linspace(-50, 50, 101).view(1, 101).expand(2, 101)
    A = torch.tensor([0.0, 1.5])
    g = kda_decay(z, A, "lower_bounded", -5.0)
    assert (g <= 0).all() and (g >= -5.0).all()  # (fp32 sigmoid saturates at |z| ~ 17: closed bounds)
    assert (g[0, 40:61] < 0).all() and (g[0, 40:61] > -5.0).all()  # open interval for |z| <= 10
    torch.testing.assert_close(g[0], -5.0 * torch.sigmoid(z[0]))
    torch.testing.assert_close(g[1], -5.0 * torch.sigmoid(torch.exp(torch.tensor(1.5)) * z[1]))
    gs = kda_decay(z, A, "softplus", -5.0)
    torch.testing.assert_close(gs[1], -torch.exp(torch.tensor(1.5)) * torch.nn.functional.softplus(z[1]))
    assert gs.min() < -5.0  # the softplus form is not bounded below
    with pytest.raises(ValueError, match="kda_decay_form"):
        kda_decay(z, A, "exp", -5.0)


def test_kda_layer_per_head_marks():
    layer = _layer()
    for w in (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight):
        assert getattr(w, "_k3_head_split") == (layer.num_heads, layer.head_dim)


class _TwoSegmentCP:
    """Single-process stand-in for the KCP context of the SECOND of two CP ranks (batch of one row): the halo is
    the first segment's last q/k/v projections, and the entry state of a document continuing across the boundary
    is the first segment's final state -- what KCP's all-gather and fold deliver."""

    def __init__(self, layer, x_early, doc_early):
        self.layer, self.x_early, self.doc_early = layer, x_early, doc_early
        states = []
        layer.kda_op = lambda *a, **kw: self._record(states, *a, **kw)
        layer(x_early, SeqInfo.from_doc_ids(doc_early))
        layer.kda_op = self._unused
        self.final_state = states[0][-1:]  # state of the early segment's last document

    @staticmethod
    def _record(states, *args, **kw):
        from k3train.ops.kda import chunk_kda
        o, st = chunk_kda(*args, output_final_state=True, chunk_size=16, **kw)
        states.append(st)
        return o, st

    @staticmethod
    def _unused(*a, **kw):
        raise AssertionError("under CP the layer must call seq.cp.kda, not its own op")

    def conv_halo(self, x, n):
        lay = self.layer
        early = torch.cat([lay.q_proj(self.x_early), lay.k_proj(self.x_early), lay.v_proj(self.x_early)], -1)
        assert early.shape[-1] == x.shape[-1]
        return early[:, -n:], self.doc_early[:, -n:]

    def kda(self, q, k, v, g, beta, scale, seq):
        from k3train.ops.kda import chunk_kda
        cu = seq.cu_seqlens
        init = torch.zeros(cu.numel() - 1, *self.final_state.shape[1:], dtype=self.final_state.dtype)
        if seq.doc_ids[0, 0] == self.doc_early[0, -1]:
            init[0] = self.final_state[0]
        o, _ = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=init, cu_seqlens=cu, chunk_size=16)
        return o


def test_kda_layer_cp_seam():
    layer = _layer()
    T, s = 36, 20
    doc = _docs(T, [9, 27])  # the middle document crosses the split at 20
    x = torch.randn(1, T, layer.hidden_size, dtype=torch.float64, requires_grad=True)
    full = layer(x, SeqInfo.from_doc_ids(doc))
    cp = _TwoSegmentCP(layer, x[:, :s], doc[:, :s])
    part = layer(x[:, s:], SeqInfo.from_doc_ids(doc[:, s:], torch.arange(s, T)[None], cp=cp))
    torch.testing.assert_close(part, full[:, s:], atol=1e-10, rtol=1e-10)
    gy = torch.randn_like(part)
    g_part = torch.autograd.grad((part * gy).sum(), x)[0]
    g_full = torch.autograd.grad((full[:, s:] * gy).sum(), x)[0]
    torch.testing.assert_close(g_part, g_full, atol=1e-10, rtol=1e-10)
