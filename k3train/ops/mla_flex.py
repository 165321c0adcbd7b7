"""MLA attention through torch FlexAttention with a document + causal ``BlockMask`` (the CUDA flash path).

Same contract as the dense reference :func:`k3train.ops.mla_dense.attention_core` (``q [B, H, Tq, Dqk]``,
``k [B, H, Tk, Dqk]``, ``v [B, H, Tk, Dv]``, :class:`~k3train.model.mla.MaskInfo` -> ``[B, H, Tq, Dv]`` fp32;
K3: Dqk = 128 + 64 = 192, Dv = 128), so it can be ``MLA.attention_op``
(k3train/model/kernels.py picks).

The mask is ``key_pos <= query_pos and key_doc == query_doc`` from the batch's document ids and positions -- the
same predicate as ``MaskInfo.dense`` -- evaluated per 128 x 128 block by ``create_block_mask``, so fully masked
blocks (other documents, the future) are skipped and the dense ``[B, Tq, Tk]`` mask is never materialised in the
kernel. The kernel computes in the inputs' dtype with fp32 accumulation and writes its output in that dtype; the
result is returned as fp32 (K3 keeps attention outputs in fp32). With bf16 inputs the output therefore carries
bf16 rounding, unlike the dense reference, which upcasts q, k, v first.

On CUDA the kernel is ``torch.compile(flex_attention)`` (Triton) and the per-head max logit comes from the same
kernel (``AuxRequest(max_scores=True)``); on CPU FlexAttention runs its unfused eager implementation, forward only
(torch has no CPU backward, nor max scores: the max logit is then the dense ``masked_logit_max``) -- enough to test
the mask and the numbers here.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from k3train.ops.mla_dense import masked_logit_max

__all__ = ["document_block_mask", "flex_attention_core", "flex_attention_with_max"]

_COMPILED: dict[str, Callable[..., Any]] = {}


def _kernel(device: torch.device) -> Callable[..., Any]:
    """The compiled FlexAttention on CUDA (built once per process), the eager one elsewhere."""
    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["cuda"]


def kernel_options(dtype: torch.dtype, qk_dim: int) -> dict[str, Any] | None:
    """Forward tile sizes where inductor's default does not fit a Hopper SM's shared memory: fp32 inputs with
    K3's qk width 192 default to a 64 x 64 tile in 3 stages (~281 KiB of the 227 KiB an H200 SM has, found by
    tools/gpu_check.py on a lent H200 with torch 2.11); a 32 x 64 tile in one stage needs ~104 KiB. bf16/fp16
    (the training dtypes) keep inductor's choice; the backward's fp32 default (16 x 16 tiles) fits."""
    if dtype == torch.float32 and qk_dim > 128:
        return {"fwd_BLOCK_M": 32, "fwd_BLOCK_N": 64, "fwd_num_stages": 1}
    return None


def document_block_mask(mask_info: Any, block_size: int = 128) -> Any:
    """``BlockMask`` of the causal + same-document predicate for ``mask_info`` (``q_doc``/``q_pos`` ``[B, Tq]``,
    ``k_doc``/``k_pos`` ``[B, Tk]``), shared by all heads."""
    q_doc, q_pos, k_doc, k_pos = mask_info.q_doc, mask_info.q_pos, mask_info.k_doc, mask_info.k_pos
    B, Tq = q_doc.shape
    Tk = k_doc.shape[1]

    def doc_causal(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return (k_pos[b, ki] <= q_pos[b, qi]) & (k_doc[b, ki] == q_doc[b, qi])

    return create_block_mask(doc_causal, B, None, Tq, Tk, device=q_doc.device, BLOCK_SIZE=block_size,
                             _compile=q_doc.device.type == "cuda")


def _run(q: Tensor, k: Tensor, v: Tensor, mask_info: Any, scale: float, want_max: bool,
         block_mask: Any = None) -> tuple[Tensor, Tensor | None]:
    if q.dim() != 4 or k.shape[:3] != (q.shape[0], q.shape[1], k.shape[2]) or k.shape[-1] != q.shape[-1] \
            or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"flex MLA: expected q[B,H,Tq,D], k[B,H,Tk,D], v[B,H,Tk,Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    q, k, v = (t.to(dtype) for t in (q, k, v))
    bm = block_mask if block_mask is not None else document_block_mask(mask_info)
    fn = _kernel(q.device)
    if q.device.type == "cuda":
        opts = kernel_options(q.dtype, q.shape[-1])
        if opts:
            fn = functools.partial(fn, kernel_options=opts)
    if want_max and q.device.type != "cuda":  # FlexAttention returns max scores only from its CUDA kernel
        return fn(q, k, v, block_mask=bm, scale=scale).float(), masked_logit_max(q, k, mask_info, scale)
    if want_max:
        o, aux = fn(q, k, v, block_mask=bm, scale=scale, return_aux=AuxRequest(max_scores=True))
        # max_scores [B, H, Tq]: the row max of the scaled, masked logits (natural-log units); every query sees
        # itself, so no row is -inf
        return o.float(), aux.max_scores.detach().float().amax(dim=(0, 2))
    return fn(q, k, v, block_mask=bm, scale=scale).float(), None


def flex_attention_core(q: Tensor, k: Tensor, v: Tensor, mask_info: Any, scale: float,
                        block_mask: Any = None) -> Tensor:
    """Document + causal masked attention ``[B, H, Tq, Dv]`` in fp32 (contract of ``attention_core``)."""
    return _run(q, k, v, mask_info, scale, want_max=False, block_mask=block_mask)[0]


def flex_attention_with_max(q: Tensor, k: Tensor, v: Tensor, mask_info: Any, scale: float,
                            block_mask: Any = None) -> tuple[Tensor, Tensor]:
    """``(o [B, H, Tq, Dv] fp32, max_logit [H] fp32)``: the attention and, from the same kernel, the largest
    allowed pre-softmax logit ``scale * q.k`` per head (QK-Clip's statistic; the dense path computes it with a
    separate matmul, ``k3train.model.mla.masked_logit_max``). ``block_mask``: a prebuilt
    :func:`document_block_mask` to reuse across layers of one micro-batch."""
    o, mx = _run(q, k, v, mask_info, scale, want_max=True, block_mask=block_mask)
    assert mx is not None
    return o, mx
