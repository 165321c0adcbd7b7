"""Shared helpers for the model tests: batches and gradient comparison (tiny configs: k3train/config/presets.py)."""
from __future__ import annotations

import torch

from k3train.data.batch import Batch

def packed_batch(B: int, T: int, vocab: int, eos: int = 1, seed: int = 0, n_eos: int = 2) -> Batch:
    """Random tokens with a few EOS per row (so rows hold several documents)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, vocab, (B, T + 1), generator=g)
    for b in range(B):
        pos = torch.randperm(T - 2, generator=g)[:n_eos] + 1
        s[b, pos] = eos
    return Batch.from_samples(s, eos_id=eos)


def assert_grads_close(named_grads_a, named_grads_b, tight: float = 1e-10, norm_tol: float = 1e-6) -> None:
    """Compare gradients by name. RMSNorm (k3train/model/norm.py) computes in fp32 even for float64 inputs, so the
    gradients of norm gains only agree to fp32 rounding; everything else is compared at float64 tightness."""
    for (name, a), (name_b, b) in zip(named_grads_a, named_grads_b):
        assert name == name_b
        tol = norm_tol if "norm" in name else tight
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda s: f"grad of {name}: {s}")
