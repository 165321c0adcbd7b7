"""Blockwise MLA attention (k3train.ops.mla_blockwise) vs the dense reference (attention_core on the fully
expanded K/V, masked_logit_max): outputs, QK-Clip maxima and every gradient (q, latent, the expansion weights, and
through the MLA module the gate and all projections); block skipping; live bytes linear in T."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import ConfigError, load_config
from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model.mla import MLA
from k3train.ops.mla_dense import MaskInfo, attention_core, masked_logit_max
from k3train.model.seq import SeqInfo
from k3train.ops.mla_blockwise import _work, block_plan, blockwise_mla_attention, skipped_share
from k3train.planning.fakerun.known_data import KnownData
from k3train.planning.fakerun.live_bytes import LiveBytes

torch.set_num_threads(1)
F64 = torch.float64


def _mla(dtype=F64, *over: str) -> MLA:
    torch.manual_seed(0)
    m = MLA(tiny_cfg(*over)).to(dtype)
    with torch.no_grad():
        for p in m.parameters():  # bigger weights -> peaky softmax, so masking mistakes show
            if p.ndim == 2:
                p.normal_(0, 0.3)
            else:
                p.uniform_(0.5, 1.5)
    return m


def _docs(B: int, T: int, starts: list[list[int]]) -> torch.Tensor:
    d = torch.zeros(B, T, dtype=torch.long)
    for b, ss in enumerate(starts):
        for s in ss:
            d[b, s:] += 1
    return d


def _case(name: str) -> tuple[MaskInfo, int]:
    """(mask, number of queries) of the named layout; queries are the last Tq keys."""
    if name == "packed":  # documents of many lengths (1, 2, 3, ... tokens), row 1 a different packing
        T = 45
        doc = _docs(2, T, [[1, 3, 6, 10, 15, 21, 28, 36], [2, 9, 30, 31, 44]])
        pos = torch.arange(T).expand(2, T)
        return MaskInfo(doc, pos, doc, pos), T
    if name == "single":  # one document, length not a multiple of the block
        T = 37
        doc = torch.zeros(1, T, dtype=torch.long)
        pos = torch.arange(T)[None]
        return MaskInfo(doc, pos, doc, pos), T
    if name == "cp_prefix":  # CP rank 2 of 3: 13 local queries at positions 26..38 against the 39-key prefix;
        # earlier ranks' keys outside the document this rank opens with carry doc id -1 (kcp.edges)
        T, Tq = 39, 13
        doc = _docs(2, T, [[5, 20, 31], [33]])
        pos = torch.arange(T).expand(2, T)
        k_doc = doc.clone()
        for b in range(2):
            first = doc[b, T - Tq]
            early = k_doc[b, : T - Tq]
            early[early != first] = -1
        return MaskInfo(doc[:, T - Tq:], pos[:, T - Tq:], k_doc, pos), Tq
    raise KeyError(name)


def _inputs(m: MLA, mask: MaskInfo, Tq: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    B, Tk = mask.k_doc.shape
    q = torch.randn(B, Tq, m.num_heads, m.qk_dim, generator=g, dtype=F64).to(dtype).transpose(1, 2)
    lat = torch.randn(B, Tk, m.kv_lora_rank + m.rope_dim, generator=g, dtype=F64).to(dtype)
    gy = torch.randn(B, m.num_heads, Tq, m.v_dim, generator=g, dtype=F64)
    return q.requires_grad_(), lat.requires_grad_(), gy


def _dense(m: MLA, q, lat, mask):
    k, v = m.expand_latent(lat)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    return attention_core(q, kh, vh, mask, m.scale), masked_logit_max(q, kh, mask, m.scale)


def _grads(out, gy, leaves):
    return torch.autograd.grad((out * gy.to(out.dtype)).sum(), leaves)


@pytest.mark.parametrize("block", [8, 16, 64])
@pytest.mark.parametrize("case", ["packed", "single", "cp_prefix"])
def test_blockwise_matches_dense_fp64(case, block):
    m = _mla()
    mask, Tq = _case(case)
    q, lat, gy = _inputs(m, mask, Tq, F64)
    leaves = (q, lat, *m.expand_weights())
    o, mx = blockwise_mla_attention(q, lat, mask, m.scale, block, m.expand_latent, m.expand_weights())
    o_ref, mx_ref = _dense(m, q, lat, mask)
    assert o.dtype == F64 and mx.dtype == F64 and not mx.requires_grad
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(mx, mx_ref, atol=1e-12, rtol=0)
    for name, a, b in zip(("q", "latent", "norm", "kv_b"), _grads(o, gy, leaves), _grads(o_ref, gy, leaves)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda s: f"grad of {name}: {s}")


@pytest.mark.parametrize("case", ["packed", "cp_prefix"])
def test_blockwise_matches_dense_fp32(case):
    m = _mla(torch.float32)
    mask, Tq = _case(case)
    q, lat, gy = _inputs(m, mask, Tq, torch.float32)
    leaves = (q, lat, *m.expand_weights())
    o, mx = blockwise_mla_attention(q, lat, mask, m.scale, 16, m.expand_latent, m.expand_weights())
    o_ref, mx_ref = _dense(m, q, lat, mask)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mx, mx_ref, atol=1e-5, rtol=1e-6)
    for name, a, b in zip(("q", "latent", "norm", "kv_b"), _grads(o, gy, leaves), _grads(o_ref, gy, leaves)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda s: f"grad of {name}: {s}")


def test_bf16_inputs_compute_in_fp32():
    """bf16 q/latent/weights (train.dtype=bfloat16): fp32 output, bf16 gradients, close to the dense path."""
    m = _mla(torch.bfloat16)
    mask, Tq = _case("packed")
    q, lat, gy = _inputs(m, mask, Tq, torch.bfloat16)
    leaves = (q, lat, *m.expand_weights())
    o, _ = blockwise_mla_attention(q, lat, mask, m.scale, 16, m.expand_latent, m.expand_weights())
    o_ref, _ = _dense(m, q, lat, mask)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    for a, b, leaf in zip(_grads(o, gy, leaves), _grads(o_ref, gy, leaves), leaves):
        assert a.dtype == leaf.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("case", ["packed", "cp_prefix"])
def test_mla_module_blockwise_equals_dense_reference(case):
    """Through the whole layer (q projections, gate, output): blockwise (default) vs attention_op=attention_core --
    outputs, qk_max and the gradient of x and of every parameter within 1e-12 in fp64."""
    mask, Tq = _case(case)
    B, Tk = mask.k_doc.shape
    runs = []
    for op in (None, attention_core):
        m = _mla(F64, "mla_block_size=8")
        m.train()
        m.attention_op = op
        g = torch.Generator().manual_seed(3)
        x = torch.randn(B, Tk, m.q_a_proj.in_features, generator=g, dtype=F64, requires_grad=True)

        class _CP:  # single-process prefix gather: keys = the latents of all Tk tokens, with mask's key ids
            def gather_latent(self, latent):
                early = m.kv_a_proj_with_mqa(x[:, : Tk - Tq])
                return torch.cat([early, latent], 1), mask.k_doc, mask.k_pos

            def mla_queries(self, xq):  # this rank's own queries (no causal balance in one process)
                return xq, mask.q_doc, mask.q_pos

            def mla_outputs(self, y):
                return y

        seq = SeqInfo.from_doc_ids(mask.q_doc, mask.q_pos, cp=_CP() if Tq < Tk else None)
        y = m(x[:, Tk - Tq:], seq)
        gy = torch.randn(y.shape, generator=g, dtype=F64)
        (y * gy).sum().backward()
        runs.append((y.detach(), m.qk_max.clone(), x.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y, mx, gx, gp), (y_ref, mx_ref, gx_ref, gp_ref) = runs
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(mx, mx_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(gx, gx_ref, atol=1e-12, rtol=0)
    assert set(gp) == set(gp_ref) and "g_proj.weight" in gp
    for n in gp:
        torch.testing.assert_close(gp[n], gp_ref[n], atol=1e-12, rtol=0, msg=lambda s: f"grad of {n}: {s}")


def _nonempty_blocks(mask: MaskInfo, block: int) -> tuple[set, set]:
    dense = mask.dense()[:, 0]
    B, Tq, Tk = dense.shape
    some, full = set(), set()
    for b in range(B):
        for i in range(-(-Tq // block)):
            for j in range(-(-Tk // block)):
                blk = dense[b, i * block:(i + 1) * block, j * block:(j + 1) * block]
                if blk.any():
                    some.add((b, i, j))
                if blk.all():
                    full.add((b, i, j))
    return some, full


@pytest.mark.parametrize("block", [4, 8])
def test_block_plan_skips_exactly_the_empty_blocks(block):
    """Packed documents with increasing ids: the per-block range test keeps exactly the blocks with an allowed
    pair, and marks 'full' exactly the blocks whose every pair is allowed."""
    mask, _ = _case("packed")
    plan = block_plan(mask, block)
    kept = {(b, i, j) for b, row in enumerate(plan.work) for j, qs in enumerate(row) for i, _ in qs}
    marked_full = {(b, i, j) for b, row in enumerate(plan.work) for j, qs in enumerate(row) for i, f in qs if f}
    some, full = _nonempty_blocks(mask, block)
    assert kept == some
    assert marked_full == full  # exact too (a block inside one document, keys before queries)
    assert full or block > 4
    nq, nk = -(-45 // block), -(-45 // block)
    assert plan.total == 2 * nq * nk
    assert skipped_share(mask, block) == pytest.approx(1 - len(some) / plan.total)
    assert skipped_share(mask, block) > 0.5  # more than the causal half: the documents cut most blocks


def test_block_plan_cp_prefix_is_conservative():
    mask, _ = _case("cp_prefix")
    plan = block_plan(mask, 4)
    kept = {(b, i, j) for b, row in enumerate(plan.work) for j, qs in enumerate(row) for i, _ in qs}
    some, _ = _nonempty_blocks(mask, 4)
    assert some <= kept


def test_mla_block_size_validated():
    cfg = load_config("configs/tiny.yaml", ["--model.mla_block_size=256"])
    assert cfg.model.mla_block_size == 256
    for bad in ("0", "-8"):
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny.yaml", [f"--model.mla_block_size={bad}"])
        msg = str(e.value)
        assert "model.mla_block_size" in msg and len(msg.strip().splitlines()) == 1


def _layer_peak(T: int, op) -> int:
    """Peak live bytes above the start of one MLA layer's forward + backward on one T-token document."""
    m = MLA(tiny_cfg("mla_block_size=512", "num_attention_heads=1"))
    m.attention_op = op
    m.train()
    x = torch.randn(1, T, m.q_a_proj.in_features, requires_grad=True)
    seq = SeqInfo.from_doc_ids(torch.zeros(1, T, dtype=torch.long))
    with LiveBytes() as lb:
        base = lb.live
        m(x, seq).sum().backward()
    return lb.peak - base


def test_live_bytes_linear_in_T():
    """Measured: one layer's forward + backward peak grows ~linearly in T blockwise (2K -> 4K -> 8K), while
    the dense reference grows ~quadratically (1K -> 2K); at 2K blockwise already holds less than dense."""
    bw = {T: _layer_peak(T, None) for T in (2048, 4096, 8192)}
    dense = {T: _layer_peak(T, attention_core) for T in (1024, 2048)}
    assert bw[8192] / bw[4096] < 2.5 and bw[4096] / bw[2048] < 2.5, bw
    assert dense[2048] / dense[1024] > 3.0, dense
    assert bw[2048] < dense[2048] / 4, (bw, dense)


def _traced_bytes(case: str, block: int, fake: bool) -> tuple[int, int, int]:
    """(peak, saved after forward, left after backward) live bytes of the op's forward + backward, real or on
    fake tensors under the estimator's modes (FakeTensorMode + KnownData)."""
    m = _mla(torch.float32)
    mask, Tq = _case(case)
    q, lat, gy = (t.detach() for t in _inputs(m, mask, Tq, torch.float32))
    with contextlib.ExitStack() as modes:
        if fake:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            q, lat, gy = (mode.from_tensor(t) for t in (q, lat, gy))
            modes.enter_context(mode)
            modes.enter_context(KnownData())
        q.requires_grad_()
        lat.requires_grad_()
        with LiveBytes() as lb:
            base = lb.live
            o, _ = blockwise_mla_attention(q, lat, mask, m.scale, block, m.expand_latent, m.expand_weights())
            saved = lb.live - base
            (o * gy).sum().backward()
            return lb.peak - base, saved, lb.live - base


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("case", ["packed", "single", "cp_prefix"])
def test_fake_trace_books_what_the_real_run_holds(case, block):
    """The estimator's trace computes one block step of each kind (``_work`` with shapes only), yet books exactly
    the live bytes of the real run, which computes every step: peak, saved and left-over bytes equal."""
    mask, Tq = _case(case)
    plan = block_plan(mask, block)
    Tk = mask.k_doc.shape[1]
    every = sum(len(q) for *_, q in _work(plan, Tq, Tk, shapes_only=False))
    kinds = sum(len(q) for *_, q in _work(plan, Tq, Tk, shapes_only=True))
    assert every == plan.computed and kinds <= every and (block > 4 or kinds < every / 2), (kinds, every)
    assert _traced_bytes(case, block, fake=True) == _traced_bytes(case, block, fake=False)
