"""The hand-written KDA backward (k3train.ops.kda_function) vs the autograd chunked reference (kda_chunk).

Outputs, final states and all six gradients (q, k, v, g, beta, initial_state) at float64 tight tolerance, over
both diagonal sub-tile paths, varlen documents, initial states, and KCP's augmented pass; plus the properties the
Function exists for: what autograd keeps, no host reads of tensor values, no subnormal exp outputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kda import F64, make_inputs, run_with_grads
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.ops import kda_function
from k3train.ops.kda import chunk_kda, chunk_kda_autograd, dense_diagonal_ok
from k3train.ops.kda_naive import compute_dtype
from kcp.pairs import LocalLayout, augmented_pass

torch.set_num_threads(1)
NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


def compare_to_reference(inputs, h0, cu=None, *, atol=1e-10, rtol=1e-10, ref_inputs=None, ref_h0=None, **kw):
    chunk = kw.get("chunk_size", 64)
    o1, s1, g1 = run_with_grads(chunk_kda, inputs, h0, cu, **kw)
    o2, s2, g2 = run_with_grads(chunk_kda_autograd, ref_inputs or inputs, ref_h0 if ref_inputs else h0, cu,
                                chunk_size=chunk)
    assert o1.dtype == inputs[0].dtype and s1.dtype == compute_dtype(inputs[0].dtype)
    torch.testing.assert_close(o1.to(F64), o2.to(F64), atol=atol, rtol=rtol, msg=lambda m: f"o: {m}")
    torch.testing.assert_close(s1.to(F64), s2.to(F64), atol=atol, rtol=rtol, msg=lambda m: f"final: {m}")
    assert len(g1) == len(g2) == len(inputs) + (h0 is not None)
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert a.dtype == (inputs + [h0])[i].dtype
        torch.testing.assert_close(a.to(F64), b.to(F64), atol=atol, rtol=rtol, msg=lambda m: f"d{NAMES[i]}: {m}")


KEEP = pytest.mark.parametrize("keep", [False, True], ids=["rebuild", "keep"])   # the backward's two paths


@KEEP
@pytest.mark.parametrize("lower_bound", [None, -5.0])          # pairwise / dense diagonal sub-tiles
@pytest.mark.parametrize("T,chunk", [(100, 64), (7, 32), (130, 16)])
def test_float64_matches_autograd_reference(T, chunk, lower_bound, keep):
    inputs = make_inputs(2, T, 2, 8, 16, seed=T)
    h0 = torch.randn(2, 2, 8, 16, dtype=F64, requires_grad=True)
    compare_to_reference(inputs, h0, chunk_size=chunk, g_lower_bound=lower_bound, keep_solve=keep)


@KEEP
@pytest.mark.parametrize("lengths,chunk", [([1, 5, 64, 70, 3, 0, 17], 64), ([3, 0, 20, 0, 40], 16), ([0], 64)])
def test_varlen_documents_with_initial_state(lengths, chunk, keep):
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = make_inputs(1, T, 2, 8, 24, seed=len(lengths))       # V != K
    h0 = torch.randn(len(lengths), 2, 8, 24, dtype=F64, requires_grad=True)
    compare_to_reference(inputs, h0, cu, chunk_size=chunk, g_lower_bound=-5.0, keep_solve=keep)


def test_unbounded_gate_and_no_initial_state():
    q, k, v, g, b = make_inputs(1, 140, 2, 8, 8, gate="softplus", seed=9)
    with torch.no_grad():
        g[0, 50] = -1e4                                            # a hard reset inside a chunk
    compare_to_reference([q, k, v, g, b], None, chunk_size=32)


def test_float32_dense_path_against_float64_reference():
    inputs = make_inputs(1, 192, 2, 16, 16, dtype=torch.float32, seed=4)
    with torch.no_grad():
        inputs[3][0, :64] = -5.0                                   # the bound itself: the widest dense span
    h0 = torch.randn(1, 2, 16, 16, requires_grad=True)
    ref = [x.detach().to(F64).requires_grad_() for x in inputs]
    compare_to_reference(inputs, h0, atol=2e-4, rtol=1e-4, ref_inputs=ref, ref_h0=h0.detach().to(F64).requires_grad_(),
                         g_lower_bound=-5.0)


def test_kcp_augmented_pass():
    """KCP's widened pass (values [v | 0], initial states [0 | I], varlen rows) through both ops: all outputs and
    the gradients of a functional of all four."""
    doc_ids = torch.tensor([[0] * 7 + [1] * 33, [2] * 40, [0] * 20 + [1] * 19 + [2]])
    lay = LocalLayout.from_doc_ids(doc_ids)
    q, k, v, g, b = make_inputs(3, 40, 2, 8, 8, seed=21)

    def run(fn):
        outs = augmented_pass(q, k, v, g, b, lay, scale=0.7, kda_fn=fn)
        gen = torch.Generator().manual_seed(3)
        loss = sum((o * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outs)
        return [o.detach() for o in outs], torch.autograd.grad(loss, [q, k, v, g, b])

    def chunk16(fn):
        return lambda *a, **kw: fn(*a, chunk_size=16, **kw)

    bounded = lambda *a, **kw: chunk_kda(*a, chunk_size=16, g_lower_bound=-5.0, **kw)  # noqa: E731
    rebuild = lambda *a, **kw: chunk_kda(*a, chunk_size=16, keep_solve=False, **kw)  # noqa: E731
    for new_fn in (chunk16(chunk_kda), bounded, rebuild):
        o1, g1 = run(new_fn)
        o2, g2 = run(chunk16(chunk_kda_autograd))
        for a, b_ in zip(o1 + list(g1), o2 + list(g2)):
            torch.testing.assert_close(a, b_, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# What the Function is for
def _kept(inputs, **kw):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        o, _ = chunk_kda(*inputs, g_lower_bound=-5.0, **kw)
    assert o.grad_fn.name() == "_ChunkKDABackward"                  # one node: no graph inside the op
    return saved


def test_autograd_keeps_chunked_inputs_entry_states_and_solve():
    """fp32 at K = V = 32, C = 64: the five inputs in the chunk layout, then entry states, P, T^-1, [W | Uw] and M,
    within 3x the input bytes (the issue's bound); the chunk copies replace the inputs, which are not kept."""
    inputs = make_inputs(1, 256, 2, 32, 32, dtype=torch.float32, seed=1)
    saved = _kept(inputs)
    ptrs = {x.untyped_storage().data_ptr() for x in inputs}
    assert not any(x.untyped_storage().data_ptr() in ptrs for x in saved)
    NC, H, C, K = 4, 2, 64, 32
    assert [tuple(x.shape) for x in saved] == [(NC, H, C, K)] * 4 + [(NC, H, C), (NC, H, K, K), (NC, H, C, C),
                                                                     (NC, H, C, C), (NC, H, C, 2 * K), (NC, H, K, K)]
    in_bytes = sum(x.numel() * x.element_size() for x in inputs)
    assert sum(x.untyped_storage().nbytes() for x in saved) <= 3 * in_bytes


def test_autograd_keeps_low_precision_inputs_as_given():
    """bf16: the inputs themselves (fp32 chunk copies would double them) and the fp32 entry states only (keeping
    the solve too would be 4.6x the input bytes here, over ``KEEP_LIMIT``); asked to keep it, it does."""
    inputs = make_inputs(1, 256, 2, 32, 32, dtype=torch.bfloat16, seed=1)
    for keep, n in ((None, 6), (True, 10)):
        saved = _kept(inputs, keep_solve=keep)
        assert [x.untyped_storage().data_ptr() for x in saved[:5]] == [x.untyped_storage().data_ptr() for x in inputs]
        assert len(saved) == n and all(x.dtype == torch.float32 for x in saved[5:])
    in_bytes = sum(x.numel() * x.element_size() for x in inputs)
    assert sum(x.untyped_storage().nbytes() for x in _kept(inputs)) <= 2 * in_bytes


class _Watch(TorchDispatchMode):
    """Counts host reads of floating-point tensor values and subnormal results of exp."""

    def __init__(self):
        super().__init__()
        self.float_reads, self.subnormal_exps = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_floating_point():
            self.float_reads += 1
        if func in (torch.ops.aten.exp.default, torch.ops.aten.exp_.default) and out.dtype == torch.float32:
            tiny = torch.finfo(out.dtype).tiny
            self.subnormal_exps += int(((out != 0) & (out.abs() < tiny)).sum())
        return out


@pytest.mark.parametrize("gate,bound", [("lower_bounded", -5.0), ("softplus", None)])
def test_no_value_reads_and_no_subnormal_exp(gate, bound):
    inputs = make_inputs(1, 192, 2, 16, 16, dtype=torch.float32, gate=gate, seed=2)
    with torch.no_grad():
        inputs[3][0, :128] = -5.0 if gate == "lower_bounded" else -60.0   # deep decays: exp(G) far below 1e-38
    for fn, kw, clean in ((chunk_kda, dict(g_lower_bound=bound), True), (chunk_kda_autograd, {}, False)):
        with _Watch() as w:
            o, _ = fn(*inputs, **kw)
            torch.autograd.grad(o.sum(), inputs)
        if clean:
            assert w.float_reads == 0 and w.subnormal_exps == 0
        else:  # the reference reads the decay span and takes exp of the raw exponents: the checks can fail
            assert w.float_reads >= 1 and w.subnormal_exps > 0


def test_dense_path_choice_and_bad_bound():
    assert dense_diagonal_ok(-5.0, torch.float32) and dense_diagonal_ok(-5.0, torch.bfloat16)
    assert not dense_diagonal_ok(-6.0, torch.float32) and dense_diagonal_ok(-6.0, torch.float64)
    assert not dense_diagonal_ok(None, torch.float64)
    q, k, v, g, b = (x.detach() for x in make_inputs(1, 16, 1, 4, 4))
    with pytest.raises(ValueError, match="g_lower_bound"):
        chunk_kda(q, k, v, g, b, g_lower_bound=1.0)
    assert kda_function._DENSE_SPAN_MAX[torch.float32] >= 15 * 5.0   # K3's gate (-5) takes the dense path
