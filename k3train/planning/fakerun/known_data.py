"""Run the project's real forward/backward on fake weights and activations, with the integer data kept real.

``FakeTensorMode`` gives every float tensor shape, dtype and device but no memory -- what the estimator needs at
K3 scale. The model, however, takes data-dependent decisions on *integer* tensors: the sequence layout
(``cu_seqlens.tolist()`` plans the chunked KDA), the router's top-k (``bincount`` -> grouped-FFN offsets), the
QB histogram. :class:`KnownData`, entered *inside* a ``FakeTensorMode``, keeps those real:

* an op whose tensor inputs are all real runs for real, if its result (seen first on fake tensors) is at most
  ``SMALL_REAL`` elements (the batch's ``doc_ids``/``positions``/labels and
  everything derived from them: index tensors, ``cu_seqlens``, the chunk layout) -- these are a few bytes per
  token, allocated for real and booked by :class:`~k3train.planning.fakerun.live_bytes.LiveBytes` like any other;
* a factory op (``arange``, ``zeros`` with no tensor input) runs for real when its result is integer/bool and
  small, else fake;
* ``topk`` on fake scores returns fake values and REAL indices of a perfectly balanced routing (row ``n``, slot
  ``j`` -> expert ``(n * K + j) mod E``): the expected load Quantile Balancing drives the router to, which
  fixes every per-expert row count and so every grouped-FFN shape;
* ``bincount`` of fake data (the QB score histogram) returns fake zeros of ``minlength`` (statistics only);
* ``torch._grouped_mm`` on fake operands gets its result shape here (torch's fake kernel is bf16-only);
* a Python scalar read from fake data (``.item()``) is 0: in a training step only statistics read one (the KDA
  op chooses its sub-tile path from the gate's parameterisation, never from values, so fake and real runs take
  the same path).

Everything else is the real code running on fake tensors; nothing the size of the model is allocated.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
SMALL_REAL = 1 << 24  # elements: real-data results up to this size are made real (index tensors)


def _real_ok(out: Any, allow_float: bool) -> bool:
    ts = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return all((allow_float or not (t.is_floating_point() or t.is_complex())) and t.numel() <= SMALL_REAL
               for t in ts)


def balanced_topk_indices(n: int, k_sel: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """``[n, k_sel]`` int64: row ``n`` picks experts ``(n*k_sel + j) mod E`` -- distinct per row, every expert
    gets the same number of routes (within one)."""
    rows = torch.arange(n, dtype=torch.int64, device=device)[:, None] * k_sel
    return (rows + torch.arange(k_sel, dtype=torch.int64, device=device)) % num_experts


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: Any = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake result of ``torch._grouped_mm`` (its fake kernel accepts bf16 only; the CPU kernel the model runs
    in fp32 takes fp32 too): 2d x 3d -> [M, N] (forward, grad of the input), 2d x 2d -> [G, M, N] (grad of
    the weights), 3d x 3d -> [G, M, N]."""
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    else:  # 3d x 2d: [G, M, K] x [K, N*G] grouped over columns
        shape = (a.shape[1], b.shape[1])
    return a.new_empty(shape, dtype=out_dtype or a.dtype)


# views whose result never holds more elements than their input (no expand)
_SHRINKING_VIEWS = {aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim, aten.view.default,
                    aten._unsafe_view.default, aten.alias.default, aten.t.default, aten.transpose.int,
                    aten.permute.default}


def _known_small(func: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether an op on real tensors certainly makes a result of at most ``SMALL_REAL`` elements, from the
    inputs' shapes alone: a pointwise op (its result has the broadcast shape of its inputs) or a view that never
    grows -- so the fake probe (a conversion of every input, the slow part of a trace's many small index ops, e.g.
    the blockwise MLA's per-block masks) can be skipped."""
    if func in _SHRINKING_VIEWS:
        return all(t.numel() <= SMALL_REAL for t in tensors)
    if torch.Tag.pointwise not in func.tags or not tensors:
        return False
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return False
    n = 1
    for x in shape:
        n *= x
    return n <= SMALL_REAL


class KnownData(TorchDispatchMode):
    """See the module docstring. Enter as ``with fake_mode, KnownData(): ...``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fake = any(isinstance(t, FakeTensor) for t in tensors)
        if not fake and _known_small(func, tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if not fake:
            # fake first, to see what it makes: a real-data op whose result is big (a [T, T] mask at 1M tokens,
            # a float factory) stays fake
            try:
                probe = func(*args, **kwargs)
            except Exception:  # noqa: BLE001 - data-dependent shape (nonzero) or a real in-place op: run it
                probe = None
            if probe is None or _real_ok(probe, allow_float=bool(tensors)):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return probe
        if func is aten.topk.default:
            values, idx = func(*args, **kwargs)
            x, k_sel = args[0], args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if x.dim() == 2 and dim in (-1, 1):
                with unset_fake_temporarily():
                    idx = balanced_topk_indices(x.shape[0], k_sel, x.shape[1], torch.device("cpu"))
            return values, idx
        if func is aten.bincount.default:
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            return torch.zeros(int(minlength), dtype=torch.int64, device=args[0].device)
        if func is aten._grouped_mm.default:
            return _grouped_mm_shape(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            # a scalar read from fake data reads 0 (statistics); see the module docstring
            return False if args[0].dtype == torch.bool else (0.0 if args[0].is_floating_point() else 0)
        # a real operand of an op on fake data: the fake mode converts it (allow_non_fake_inputs)
        return func(*args, **kwargs)

