"""Newton-Schulz orthogonalisation for Muon, batched over leading dimensions.

Muon replaces a momentum matrix ``G = U S V^T`` by (approximately) ``U V^T``. The quintic iteration

    X <- a X + (b A + c A^2) X,   A = X X^T,   (a, b, c) = (3.4445, -4.7750, 2.0315)

maps every singular value through ``p(s) = a s + b s^3 + c s^5`` and leaves the singular vectors alone. The
coefficients are deliberately not a convergent iteration: they push small singular values up fast and accept that
the result oscillates around 1 instead of converging to it (Muon's design; exact orthogonality buys nothing for
an optimizer update and would need many more steps).

Stated tolerance (5 steps, checked by ``tests/optim/test_newton_schulz.py``):
    after normalising ``X = G / ||G||_F`` every singular value is <= 1. Singular values with
    ``s / ||G||_F >= 3e-3`` come out in ``[0.68, 1.21]`` in float64 arithmetic (the scalar map above iterated
    5 times); float32 adds ~1e-6, bfloat16 ~1e-2 (we test ``[0.6, 1.3]`` for bf16). Smaller singular values are
    only partially lifted (``s / ||G||_F = 1e-3`` -> ~0.47); exactly-zero directions stay zero.

Batching: ``G`` may be ``[..., m, n]``; every trailing matrix is normalised by its own Frobenius norm and
iterated independently, in ONE sequence of batched matmuls -- this is how Per-Head Muon orthogonalises all heads
of a projection (``[H, rows_per_head, in]``) and how stacked expert weights ``[E, a, b]`` are handled.

Tall matrices (m > n) are transposed first so the Gram matrix ``X X^T`` is the small ``min(m,n)^2`` one.
"""
from __future__ import annotations

import torch

NS_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# the band promised in the module docstring (float32, 5 steps, s/||G||_F >= NS_MIN_RELATIVE_SV)
NS_SV_BAND_FP32: tuple[float, float] = (0.68, 1.21)
NS_SV_BAND_BF16: tuple[float, float] = (0.6, 1.3)
NS_MIN_RELATIVE_SV: float = 3e-3

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def ns_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``'float32'|'bfloat16'|'float64'`` (``optim.ns_dtype``) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"optim.ns_dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: str | torch.dtype = torch.float32,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise every trailing matrix of ``g``.

    Args:
        g: ``[..., m, n]`` (at least 2-D), any float dtype.
        steps: number of quintic iterations (``optim.ns_steps``).
        dtype: arithmetic dtype (``optim.ns_dtype``); the Frobenius norm is always taken in float32 or better.
        eps: added to the norm so an all-zero matrix maps to zero instead of NaN.
    Returns:
        a tensor of ``g``'s shape, in ``dtype`` (callers cast as they need). No process group is used.
    """
    if g.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    dt = ns_torch_dtype(dtype)
    lead, (m, n) = g.shape[:-2], g.shape[-2:]
    x = g.reshape(-1, m, n)
    transposed = m > n
    if transposed:
        x = x.mT
    norm_dtype = torch.float64 if dt == torch.float64 else torch.float32
    xn = x.to(norm_dtype)
    x = (xn / (torch.linalg.matrix_norm(xn, keepdim=True) + eps)).to(dt)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)                                   # [B, k, k], k = min(m, n)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)     # b*A + c*A@A
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)            # a*X + poly@X
    if transposed:
        x = x.mT
    return x.reshape(*lead, m, n)


def newton_schulz_reference(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Plain single-matrix reference in float64: ``g`` is ``[m, n]``; returns ``[m, n]`` float64."""
    a, b, c = NS_COEFFS
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return newton_schulz_reference(x.T, steps, eps).T
    x = x / (torch.linalg.norm(x) + eps)
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on a ``[..., m, n]`` input (used to balance ZeRO ownership)."""
    *lead, m, n = shape
    k, big = min(m, n), max(m, n)
    batch = 1
    for d in lead:
        batch *= d
    # per step: X X^T (2 k^2 big) + A@A (2 k^3) + poly@X (2 k^2 big)
    return batch * steps * (4 * k * k * big + 2 * k ** 3)
