"""ShortConv: literal reference, document masking (perturbation) and CP halo equivalence."""
import torch

from k3train.model.conv import ShortConv, causal_depthwise_conv

torch.set_num_threads(1)


def reference_conv(x, weight, doc_ids):
    """Literal per-token sum: y[b,t,c] = sum_j w[c,0,K-1-j] x[b,t-j,c] over t-j >= 0 in the same document."""
    B, T, C = x.shape
    K = weight.shape[-1]
    rows = []
    for b in range(B):
        outs = []
        for t in range(T):
            acc = torch.zeros(C, dtype=x.dtype)
            for j in range(K):
                if t - j >= 0 and doc_ids[b, t - j] == doc_ids[b, t]:
                    acc = acc + weight[:, 0, K - 1 - j] * x[b, t - j]
            outs.append(acc)
        rows.append(torch.stack(outs))
    return torch.stack(rows)


def _docs(B, T, starts):
    d = torch.zeros(B, T, dtype=torch.long)
    for b, ss in enumerate(starts):
        for s in ss:
            d[b, s:] += 1
    return d


def test_conv_matches_literal_reference_outputs_and_grads():
    torch.manual_seed(0)
    B, T, C, K = 2, 11, 5, 4
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    conv = ShortConv(C, K).double()
    doc = _docs(B, T, [[3, 4, 9], [6]])  # includes a 1-token document
    y = conv(x, doc)
    x2 = x.detach().clone().requires_grad_(True)
    w2 = conv.weight.detach().clone().requires_grad_(True)
    y_ref = reference_conv(x2, w2, doc)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    (y_ref * gy).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(conv.weight.grad, w2.grad, atol=1e-12, rtol=0)


def test_conv_does_not_mix_documents():
    torch.manual_seed(1)
    B, T, C, K = 1, 16, 3, 4
    doc = _docs(B, T, [[7]])
    conv = ShortConv(C, K)
    x = torch.randn(B, T, C)
    y = conv(x, doc)
    x_pert = x.clone()
    x_pert[:, :7] += torch.randn(B, 7, C)  # change only document 0
    y_pert = conv(x_pert, doc)
    assert torch.equal(y[:, 7:], y_pert[:, 7:]), "document 1 depends on document 0"
    assert not torch.allclose(y[:, 4:7], y_pert[:, 4:7])  # (the perturbation does reach document 0 itself)


def test_conv_halo_equals_whole_sequence():
    torch.manual_seed(2)
    B, T, C, K = 2, 12, 4, 4
    doc = _docs(B, T, [[5], [6]])  # row 1: a document starts exactly at the split point
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 1, K, dtype=torch.float64, requires_grad=True)
    whole = causal_depthwise_conv(x, w, doc)
    s = 6
    left = causal_depthwise_conv(x[:, :s], w, doc[:, :s])
    right = causal_depthwise_conv(x[:, s:], w, doc[:, s:], prev=x[:, s - (K - 1):s], prev_doc=doc[:, s - (K - 1):s])
    split = torch.cat([left, right], 1)
    torch.testing.assert_close(split, whole, atol=1e-12, rtol=0)
    gy = torch.randn_like(whole)
    gx_whole, gw_whole = torch.autograd.grad((whole * gy).sum(), (x, w))
    gx_split, gw_split = torch.autograd.grad((split * gy).sum(), (x, w))
    torch.testing.assert_close(gx_split, gx_whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(gw_split, gw_whole, atol=1e-12, rtol=0)
    # a halo longer than K-1 is fine (only the last K-1 tokens matter); doc -1 means "no previous token"
    right_long = causal_depthwise_conv(x[:, s:], w, doc[:, s:], prev=x[:, :s], prev_doc=doc[:, :s])
    torch.testing.assert_close(right_long, whole[:, s:], atol=1e-12, rtol=0)
    no_prev = causal_depthwise_conv(x[:, s:], w, doc[:, s:], prev=torch.randn(B, K - 1, C, dtype=torch.float64),
                                    prev_doc=torch.full((B, K - 1), -1))
    torch.testing.assert_close(no_prev, causal_depthwise_conv(x[:, s:], w, doc[:, s:]), atol=0, rtol=0)
