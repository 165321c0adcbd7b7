"""SiTU-GLU activation and the dense gated FFN (K3's first layer and the shared experts).

SiTU-GLU (Sigmoid Tanh Unit GLU, seed 001 section 5.5) caps both multiplicative factors of SwiGLU with a scaled
tanh, which is ~linear near 0 and bounded for large inputs:

    h = [b1 tanh(g / b1) * sigmoid(g)] * [b2 tanh(u / b2)],   g = W_g x,  u = W_u x
    y = W_down h

with b1 = ``activation_situ_beta`` (4) and b2 = ``activation_situ_linear_beta`` (25), so |h| < b1 * b2 = 100.
Every FFN of the model (dense, shared experts, routed experts) uses the one activation ``model.hidden_act`` names
(:func:`glu`): ``situ`` (K3) or ``silu`` -- SwiGLU, ``h = silu(g) * u``, the FFN of Kimi Linear and DeepSeek-V3.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of the pre-activations ``gate = W_g x`` and ``up = W_u x`` (same shape, any shape).

    The gate factor ``beta * tanh(gate / beta) * sigmoid(gate)`` lies in (-beta, beta) (it is a Swish whose
    linear part is capped), the linear factor ``linear_beta * tanh(up / linear_beta)`` in (-linear_beta,
    linear_beta). Elementwise, computed in the input dtype.
    """
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"situ_glu: activation_situ_beta={beta} and activation_situ_linear_beta={linear_beta}"
                         " must be > 0")
    gate_factor = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    linear_factor = linear_beta * torch.tanh(up / linear_beta)
    return gate_factor * linear_factor


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "situ", beta: float = 4.0,
        linear_beta: float = 25.0) -> torch.Tensor:
    """The gated activation ``model.hidden_act`` names, of ``gate = W_g x`` and ``up = W_u x``: ``"situ"`` ->
    :func:`situ_glu` (``beta``, ``linear_beta``), ``"silu"`` -> SwiGLU ``silu(gate) * up`` (the betas unused).
    Elementwise, in the input dtype."""
    if act == "situ":
        return situ_glu(gate, up, beta, linear_beta)
    if act == "silu":
        return F.silu(gate) * up
    raise ValueError(f"glu: model.hidden_act must be 'situ' or 'silu', got {act!r}")


class DenseFFN(nn.Module):
    """Bias-free gated FFN: ``x[..., d] -> w_down(glu(w_gate x, w_up x))[..., d]`` (``act``: SiTU-GLU or SwiGLU).

    Parameters ``w_gate.weight[inter, d]``, ``w_up.weight[inter, d]``, ``w_down.weight[d, inter]``: 3 * d * inter.
    Default (nn.Linear) init; the model's name-seeded ``init_weights`` overwrites it. No communication.
    """

    def __init__(self, d: int, inter: int, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                 act: str = "situ") -> None:
        super().__init__()
        if d <= 0 or inter <= 0:
            raise ValueError(f"DenseFFN: hidden size d={d} and intermediate size inter={inter} must be > 0")
        if situ_beta <= 0 or situ_linear_beta <= 0:
            raise ValueError(f"DenseFFN: activation_situ_beta={situ_beta} and activation_situ_linear_beta="
                             f"{situ_linear_beta} must be > 0")
        glu(torch.zeros(1), torch.zeros(1), act)  # validate the activation name
        self.d, self.inter, self.act = d, inter, act
        self.situ_beta, self.situ_linear_beta = float(situ_beta), float(situ_linear_beta)
        self.w_gate = nn.Linear(d, inter, bias=False)
        self.w_up = nn.Linear(d, inter, bias=False)
        self.w_down = nn.Linear(inter, d, bias=False)

    @classmethod
    def from_config(cls, cfg: Any) -> "DenseFFN":
        """The dense FFN of the first ``first_k_dense_replace`` layers (width ``intermediate_size``)."""
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.activation_situ_beta, cfg.activation_situ_linear_beta,
                   cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = glu(self.w_gate(x), self.w_up(x), self.act, self.situ_beta, self.situ_linear_beta)
        return self.w_down(h)

    def extra_repr(self) -> str:
        if self.act != "situ":
            return f"d={self.d}, inter={self.inter}, act={self.act}"
        return f"d={self.d}, inter={self.inter}, beta={self.situ_beta}, linear_beta={self.situ_linear_beta}"
