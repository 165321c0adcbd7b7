"""Chunked token mixers and FFNs for long sequences: head chunks, token chunks, and recomputation one chunk at a time.

At a 64K-token CP slice of K3 one KDA token mixer holds ~60 GiB of activations for backward and ~190 GiB at the
peak of its backward, a LatentMoE ~75 / ~100 GiB (``tools/memory.py``'s traces, bf16): no single sublayer fits an
H200 whole. Heads of a token mixer are independent until the output projection, and tokens of an FFN are
independent, so both are computed in chunks (``model.mixer_head_chunk`` heads, ``model.moe_token_chunk`` tokens),
and under ``parallel.recompute_granularity: sublayer`` each chunk is recomputed on its own in the backward
(:func:`maybe_checkpoint`): only the chunk's input is kept, and one chunk's activations live at a time.

The output projection sums over all heads, so a head chunk ends with its share of it, accumulated in fp32 across
chunks and rounded once (:func:`linear_fp32_out`): the sum one matmul over all heads forms in its fp32 accumulator
(bf16 partial sums rounded per chunk would not be). The chunks' results equal the unchunked layer's up to the order
of fp32 sums.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def head_ranges(num_heads: int, chunk: int) -> list[tuple[int, int]]:
    """``[(h0, h1), ...]`` covering ``0..num_heads`` in chunks of ``chunk`` heads (``chunk <= 0``: one chunk)."""
    if chunk <= 0 or chunk >= num_heads:
        return [(0, num_heads)]
    return [(h, min(h + chunk, num_heads)) for h in range(0, num_heads, chunk)]


def token_ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(s, e), ...]`` covering ``0..n`` tokens in chunks of ``chunk`` (one range when ``n <= chunk``)."""
    if chunk <= 0 or n <= chunk:
        return [(0, n)]
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def in_backward_pass() -> bool:
    """Whether autograd is running a backward on this thread: a forward running now is a recomputation (activation
    checkpointing), whose running statistics must not count twice (thread-local: under F/B pairing,
    parallel/pairing.py, another thread's forward may run at the same time)."""
    return torch._C._current_graph_task_id() != -1


def maybe_checkpoint(fn: Callable[..., Any], *args: Any, enabled: bool) -> Any:
    """``fn(*args)``, under non-reentrant activation checkpointing when ``enabled`` and autograd records: only the
    inputs are kept, and the backward re-runs ``fn`` (collectives inside it included, on every rank alike)."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args)

    return checkpoint(fn, *args, use_reentrant=False)


def _mm_fp32_out(x: Tensor, w: Tensor) -> Tensor:
    """``x [n, k] @ w[m, k]^T`` accumulated and returned in fp32 for low-precision inputs (cuBLAS: the bf16 GEMM
    with an fp32 output; elsewhere on fp32 copies)."""
    if x.is_cuda:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm's out_dtype for this device / dtype
            pass
    return x.float() @ w.float().t()


class _LinearFP32Out(torch.autograd.Function):
    """``F.linear(x, w)`` in fp32 for bf16 / fp16 ``x`` and ``w``; the backward takes the gradient in the inputs'
    dtype, as a linear whose output is the rounded sum of the chunks would receive it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        flat = x.reshape(-1, x.shape[-1])
        return _mm_fp32_out(flat, w).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        g = grad.to(x.dtype).reshape(-1, w.shape[0])
        gx = (g @ w).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear_fp32_out(x: Tensor, w: Tensor) -> Tensor:
    """``F.linear(x, w)`` returned in at least fp32 (fp64 stays fp64): one head chunk's share of an output
    projection, to be summed over the chunks and rounded to the activation dtype once."""
    if x.dtype in (torch.float32, torch.float64):
        return F.linear(x, w.to(x.dtype))
    return _LinearFP32Out.apply(x, w.to(x.dtype))


def chunked_output(parts: Callable[[int, int], Tensor], ranges: list[tuple[int, int]], recompute: bool,
                   dtype: torch.dtype) -> Tensor:
    """``sum_c parts(h0_c, h1_c)`` over the head ``ranges`` (each part fp32, recomputed on its own under
    ``recompute``), rounded to ``dtype`` once."""
    total: Tensor | None = None
    for h0, h1 in ranges:
        y = maybe_checkpoint(parts, h0, h1, enabled=recompute)
        total = y if total is None else total + y
    assert total is not None
    return total.to(dtype)
