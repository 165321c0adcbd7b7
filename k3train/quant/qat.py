"""Quantization-aware training of the routed experts: MXFP4 weights, optionally MXFP8 inputs (spec section 8.5).

The routed experts hold most of K3's parameters and are served in MXFP4, so training sees exactly the numbers
that will be served: in every forward each expert matmul uses ``fake_quant(W)`` (E2M1 elements, one E8M0 scale per
32 along the matmul's reduction dimension) instead of ``W``, and -- with ``train.qat_activations=mxfp8`` -- its
activation operand ``fake_quant(x)`` (E4M3, 32 per scale along the same dimension). The backward is the
straight-through estimator: the gradient w.r.t. the fp32/bf16 master weight (and the activation) is the gradient
w.r.t. its quantized value, passed through unchanged. Attention, the latent MoE projections, the shared experts
and the router are untouched.

Where it applies: :func:`k3train.model.moe.grouped_expert_ffn`, the one function every expert matmul goes through
(the single-device dispatcher, and the expert-parallel dispatcher for both a rank's own experts and the MoonEP
replicas it hosts), reads the :class:`ExpertQuant` of the :class:`~k3train.model.moe.GroupedExperts` it runs.
A replica is a copy of its owner's expert slice ``[l, f]``, and quantization works per expert and per column,
so a replica quantizes to exactly what its owner computes with. :func:`apply_qat` sets it on a built model.

Expert weight layout: ``w_gate[E, l, f]`` and ``w_up[E, l, f]`` are applied as ``x[N, l] @ w`` (reduction over
``l``), ``w_down[E, f, l]`` as ``h[N, f] @ w`` (reduction over ``f``): the blocks run along dim -2 of every
expert weight, and along the last dim of the activations. Both ``l`` and ``f`` must be multiples of 32
(checked by the config validator: ``model.routed_expert_hidden_size``, ``model.moe_intermediate_size``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from k3train.quant.mx import BLOCK, dequantize, fake_quant, pack_e2m1, quantize, unpack_e2m1

QAT_WEIGHT_FORMATS = ("none", "mxfp4")
QAT_INPUT_FORMATS = ("none", "mxfp8")


class _FakeQuantSTE(torch.autograd.Function):
    """``fake_quant`` along ``dim`` in forward, identity in backward (the straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
        return fake_quant_along(x, fmt, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def fake_quant_along(x: torch.Tensor, fmt: str, dim: int = -1) -> torch.Tensor:
    """:func:`k3train.quant.mx.fake_quant` with the 32-element blocks along ``dim`` (no gradient rule); the result
    is contiguous in ``x``'s shape."""
    if dim in (-1, x.dim() - 1):
        return fake_quant(x, fmt)
    return fake_quant(x.movedim(dim, -1), fmt).movedim(-1, dim).contiguous()


def fake_quant_ste(x: torch.Tensor, fmt: str, dim: int = -1) -> torch.Tensor:
    """Differentiable fake-quant: forward ``fake_quant_along(x, fmt, dim)``, backward passes the gradient through."""
    return _FakeQuantSTE.apply(x, fmt, dim)


@dataclass(frozen=True)
class ExpertQuant:
    """What the routed-expert matmuls quantize: ``weights`` (``"none"`` | ``"mxfp4"``, blocks along each weight's
    reduction dim -2) and ``inputs`` (``"none"`` | ``"mxfp8"``, the activation operand of each matmul, blocks along
    its last dim)."""

    weights: str = "none"
    inputs: str = "none"

    def __post_init__(self) -> None:
        if self.weights not in QAT_WEIGHT_FORMATS:
            raise ValueError(f"ExpertQuant: weights must be one of {QAT_WEIGHT_FORMATS}, got {self.weights!r}")
        if self.inputs not in QAT_INPUT_FORMATS:
            raise ValueError(f"ExpertQuant: inputs must be one of {QAT_INPUT_FORMATS}, got {self.inputs!r}")

    @property
    def active(self) -> bool:
        return self.weights != "none" or self.inputs != "none"

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """An expert weight ``[E, in, out]`` as the matmul uses it (STE fake-quant over ``in``, or ``w`` itself)."""
        return w if self.weights == "none" else fake_quant_ste(w, self.weights, dim=-2)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """A matmul's activation operand ``[..., in]`` as the matmul uses it."""
        return x if self.inputs == "none" else fake_quant_ste(x, self.inputs, dim=-1)


NO_QUANT = ExpertQuant()


def expert_weight_to_mxfp4(w: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight stack ``w[E, in, out]`` (k3train's layout, applied as ``x @ w[e]``) -> the published MXFP4
    layout per expert, ``nn.Linear``-shaped ``[out, in]``: ``(packed[E, out, in/2] uint8, scales[E, out, in/32]
    uint8)`` (E2M1 nibbles, element 2j low; E8M0 scales). The same numbers the QAT forward computes with.

    ``like = (packed, scales)`` of the same shapes (an imported checkpoint's): every block of 32 whose values are
    still exactly what those bytes decode to keeps those bytes -- scale and codes -- so an unchanged weight is
    written back bit for bit even where its source chose another (valid) scale than the OCP rule would; changed
    blocks are quantized afresh (the OCP rule, :func:`k3train.quant.mx.quantize`)."""
    wt = w.detach().transpose(-1, -2)
    codes, scales = quantize(wt, "mxfp4")
    if like is not None:
        old_packed, old_scales = like
        old = expert_weight_from_mxfp4(old_packed, old_scales, torch.float32).transpose(-1, -2)  # [E, out, in]
        same = (old.reshape(*old.shape[:-1], -1, BLOCK) == wt.float().reshape(old.shape[:-1] + (-1, BLOCK))).all(-1)
        scales = torch.where(same, old_scales, scales)
        keep = same.repeat_interleave(BLOCK, dim=-1)
        codes = torch.where(keep, unpack_e2m1(old_packed), codes)
    return pack_e2m1(codes), scales


def expert_weight_from_mxfp4(packed: torch.Tensor, scales: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`expert_weight_to_mxfp4`: ``[E, out, in/2]`` + ``[E, out, in/32]`` -> ``w[E, in, out]`` in
    ``dtype`` (contiguous); equal bit for bit to ``fake_quant_along(w, "mxfp4", -2)`` of the exported weight."""
    return dequantize(unpack_e2m1(packed), scales, "mxfp4", dtype).transpose(-1, -2).contiguous()


def apply_qat(modules: Iterable[nn.Module], weights: str = "none", inputs: str = "none") -> int:
    """Set ``ExpertQuant(weights, inputs)`` on every routed-expert module in ``modules`` (a model, or a pipeline
    rank's model chunks; before or after expert parallelism): the modules that carry an :class:`ExpertQuant` as
    ``quant`` (``k3train.model.moe.GroupedExperts``, which the model layer defines above this one). Returns how
    many it set."""
    quant = ExpertQuant(weights, inputs)
    n = 0
    for mod in modules:
        for m in mod.modules():
            if isinstance(getattr(m, "quant", None), ExpertQuant):
                m.quant = quant
                n += 1
    return n


__all__ = ["ExpertQuant", "NO_QUANT", "QAT_INPUT_FORMATS", "QAT_WEIGHT_FORMATS", "apply_qat",
           "expert_weight_from_mxfp4", "expert_weight_to_mxfp4", "fake_quant_along", "fake_quant_ste"]
