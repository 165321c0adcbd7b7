"""RMSNorm used everywhere in the K3 backbone (eps = ``ModelConfig.rms_norm_eps``, 1e-5 in K3)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    Computed in fp32 whatever the input dtype (the mean of squares of bf16 activations loses too much; fp64 inputs,
    the references, stay fp64), returned in the input dtype. ``weight`` starts at ones (a freshly built norm is the
    identity up to scale).

    Shapes: ``x[..., dim] -> [..., dim]``. No communication.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm: dim must be > 0, got {dim}")
        if eps <= 0:
            raise ValueError(f"RMSNorm: eps (rms_norm_eps) must be > 0, got {eps}")
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Weight back to ones (for models built on the meta device and materialised with ``to_empty``)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: expected last dimension {self.dim}, got shape {tuple(x.shape)}")
        acc = torch.promote_types(x.dtype, torch.float32)  # fp64 runs (the references) stay fp64
        xf = x.to(acc)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.to(acc)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
