"""Which optimizer updates which parameter, and how a matrix is cut into Newton-Schulz blocks.

Grouping rule (applied in this order, the first that matches wins; printed at start-up by ``describe()``):
    1. ``requires_grad=False`` -> excluded. Buffers (e.g. router biases set by Quantile Balancing) are never
       parameters, so they are excluded automatically.
    2. ``optim.name == 'adamw'`` -> AdamW for everything.
    3. the FQN contains any substring of ``optim.adamw_param_patterns`` (default ``embed``, ``lm_head``) -> AdamW.
    4. 2-D ``[m, n]`` with ``min(m, n) >= 2`` -> Muon. If the parameter is marked with :func:`mark_per_head` and
       ``optim.per_head_muon`` is true -> Per-Head Muon (one Newton-Schulz block per head, batched).
    5. 3-D ``[E, a, b]`` with ``min(a, b) >= 2`` -> stacked matrices (routed experts): batched Muon over E.
    6. anything else (vectors: norms, biases, AttnRes pseudo-queries, per-head decay parameters; degenerate
       matrices such as a depthwise conv kernel ``[C, 1, K]``; >3-D tensors) -> AdamW.
Weight decay: Muon parameters and AdamW parameters with ``ndim >= 2`` (embedding, LM head) are decayed; 1-D
AdamW parameters (norm gains, biases, pseudo-queries) are not -- decaying a norm gain or a zero-initialised
pseudo-query towards 0 only fights the parametrisation.

Per-head protocol (the model sets it; this module has no torch.distributed import so model code may use it)::

    from k3train.optim.param_groups import mark_per_head
    mark_per_head(self.q_proj.weight, num_heads)                       # [H*dk, d]: H blocks of dk rows
    mark_per_head(self.kv_b_proj.weight, num_heads, segments=(dn, dv))  # [H*(dn+dv), r]: per head, the k_nope
                                                                         # rows and the v rows are separate blocks

It sets ``param._k3_head_split = (num_heads, head_rows)`` (weight ``[num_heads*head_rows, in]`` split along
dim 0 into ``num_heads`` consecutive blocks of ``head_rows`` rows) and optionally
``param._k3_head_segments = (s_1, ..., s_j)`` (each head block further cut into consecutive row segments, each
orthogonalised on its own; ``sum(s) == head_rows``). Rows must be head-major (all rows of head 0, then head 1...).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

HEAD_SPLIT_ATTR = "_k3_head_split"
HEAD_SEGMENTS_ATTR = "_k3_head_segments"


def mark_per_head(param: torch.Tensor, num_heads: int, segments: Sequence[int] | None = None) -> torch.Tensor:
    """Mark a 2-D projection weight ``[num_heads * head_rows, in]`` for Per-Head Muon. Returns ``param``.

    ``segments`` (optional) cuts each head's ``head_rows`` rows into consecutive blocks orthogonalised separately
    (use it for fused projections such as MLA's ``kv_b_proj`` holding k_nope and v rows per head).
    """
    if param.ndim != 2:
        raise ValueError(f"mark_per_head: expected a 2-D weight [num_heads*head_rows, in], got {tuple(param.shape)}")
    if num_heads < 1 or param.shape[0] % num_heads != 0:
        raise ValueError(f"mark_per_head: {param.shape[0]} rows are not divisible by num_heads={num_heads}")
    head_rows = param.shape[0] // num_heads
    setattr(param, HEAD_SPLIT_ATTR, (int(num_heads), int(head_rows)))
    if segments is not None:
        segs = tuple(int(s) for s in segments)
        if any(s < 1 for s in segs) or sum(segs) != head_rows:
            raise ValueError(f"mark_per_head: segments {segs} must be positive and sum to head_rows={head_rows}")
        setattr(param, HEAD_SEGMENTS_ATTR, segs)
    elif hasattr(param, HEAD_SEGMENTS_ATTR):
        delattr(param, HEAD_SEGMENTS_ATTR)
    return param


def head_split_of(param: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    """``(num_heads, head_rows, segments)`` for a marked parameter, else None (segments default ``(head_rows,)``)."""
    split = getattr(param, HEAD_SPLIT_ATTR, None)
    if split is None:
        return None
    h, r = split
    if param.ndim != 2 or h * r != param.shape[0]:
        raise ValueError(f"{HEAD_SPLIT_ATTR}={split} does not match parameter shape {tuple(param.shape)}")
    return h, r, tuple(getattr(param, HEAD_SEGMENTS_ATTR, (r,)))


@dataclass
class ParamInfo:
    """One optimised parameter and everything the optimizer decided about it.

    ``ns_blocks``: for Muon, list of ``(row_offset_in_head, rows)`` segments; a segment is the ``[H, rows, in]``
    slice of the ``[H, head_rows, in]`` view (H = 1 for whole-matrix Muon). Stacked 3-D weights use
    ``[E, a, b]`` directly. ``group``: name of the ``ParallelDims`` group the gradient is reduced over;
    ``group_ranks``: its global ranks; ``owner``: the global rank that updates the parameter (ZeRO).
    """
    fqn: str
    param: nn.Parameter
    index: int
    kind: str            # "muon" | "adamw"
    layout: str          # "matrix" | "per_head" | "stacked" | "vector" | "dense"
    decay: bool
    reason: str
    heads: int = 1
    head_rows: int = 0
    segments: tuple[int, ...] = ()
    group: str = "dp_cp"
    group_ranks: list[int] = field(default_factory=list)
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.param.numel()

    def ns_shapes(self) -> list[tuple[int, ...]]:
        """Batched Newton-Schulz input shapes for this parameter (empty for AdamW)."""
        if self.kind != "muon":
            return []
        if self.layout == "stacked":
            return [tuple(self.param.shape)]
        n_in = self.param.shape[1]
        return [(self.heads, s, n_in) for s in self.segments]

    def state_numel(self) -> int:
        """Elements of optimizer state (momentum or two Adam moments), excluding any master copy."""
        return self.numel * (1 if self.kind == "muon" else 2)


def classify(fqn: str, p: torch.Tensor, ocfg: Any) -> tuple[str, str, bool, str]:
    """``(kind, layout, decay, reason)`` for one trainable parameter under the rule in the module docstring."""
    pats = [s for s in ocfg.adamw_param_patterns if s and s in fqn]
    if ocfg.name == "adamw":
        return "adamw", "dense" if p.ndim >= 2 else "vector", p.ndim >= 2, "optim.name=adamw"
    if pats:
        return "adamw", "dense" if p.ndim >= 2 else "vector", p.ndim >= 2, f"pattern {pats[0]!r}"
    if p.ndim == 2 and min(p.shape) >= 2:
        split = head_split_of(p)
        if split is not None and ocfg.per_head_muon:
            return "muon", "per_head", True, f"marked per-head ({split[0]} heads)"
        return "muon", "matrix", True, "2-D"
    if p.ndim == 3 and min(p.shape[1:]) >= 2:
        if head_split_of(p) is not None:
            raise ValueError(f"{fqn}: per-head marking is only supported on 2-D weights, got {tuple(p.shape)}")
        return "muon", "stacked", True, f"3-D stacked ({p.shape[0]} matrices)"
    why = "vector" if p.ndim <= 1 else f"degenerate/{p.ndim}-D"
    return "adamw", "vector" if p.ndim <= 1 else "dense", p.ndim >= 2, why


def collect_params(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters of ``modules`` by FQN, each tensor once (first FQN wins), in a deterministic order.

    Modules share the full model's FQNs (pipeline chunks); the same FQN naming two different tensors is an error.
    """
    seen_ids: set[int] = set()
    by_name: dict[str, nn.Parameter] = {}
    out: list[tuple[str, nn.Parameter]] = []
    for mod in modules:
        for name, p in mod.named_parameters():
            if not p.requires_grad or id(p) in seen_ids:
                continue
            if name in by_name:
                raise ValueError(f"parameter FQN {name!r} names two different tensors in the given modules")
            seen_ids.add(id(p))
            by_name[name] = p
            out.append((name, p))
    return out


def build_param_infos(modules: Iterable[nn.Module], ocfg: Any,
                      group_fn: Callable[[str, nn.Parameter], str] | None = None) -> list[ParamInfo]:
    """Classify every trainable parameter; ``group_fn(fqn, param) -> group name`` (default ``'dp_cp'``)."""
    infos = []
    for i, (fqn, p) in enumerate(collect_params(modules)):
        kind, layout, decay, reason = classify(fqn, p, ocfg)
        info = ParamInfo(fqn=fqn, param=p, index=i, kind=kind, layout=layout, decay=decay, reason=reason,
                         group=group_fn(fqn, p) if group_fn is not None else "dp_cp")
        if kind == "muon" and layout == "per_head":
            info.heads, info.head_rows, info.segments = head_split_of(p)
        elif kind == "muon" and layout == "matrix":
            info.heads, info.head_rows, info.segments = 1, p.shape[0], (p.shape[0],)
        infos.append(info)
    return infos


def describe_params(infos: Sequence[ParamInfo], rank: int, state_bytes: dict[int, int] | None = None,
                    detail: bool = False) -> str:
    """A table of parameter counts per optimizer group (and what this ``rank`` owns)."""
    rows: dict[str, list[int]] = {}
    for inf in infos:
        key = f"{inf.kind}/{inf.layout}" + ("" if inf.decay or inf.kind == "muon" else " (no wd)")
        r = rows.setdefault(key, [0, 0, 0, 0, 0])
        r[0] += 1
        r[1] += inf.numel
        if inf.owner == rank:
            r[2] += 1
            r[3] += inf.numel
            r[4] += (state_bytes or {}).get(inf.index, 0)
    head = f"{'group':<28}{'tensors':>8}{'params':>16}{'owned':>7}{'owned params':>15}{'state MiB':>11}"
    lines = [head, "-" * len(head)]
    tot = [0, 0, 0, 0, 0]
    for key in sorted(rows):
        r = rows[key]
        tot = [a + b for a, b in zip(tot, r)]
        lines.append(f"{key:<28}{r[0]:>8}{r[1]:>16,}{r[2]:>7}{r[3]:>15,}{r[4] / 2**20:>11.2f}")
    lines.append(f"{'total':<28}{tot[0]:>8}{tot[1]:>16,}{tot[2]:>7}{tot[3]:>15,}{tot[4] / 2**20:>11.2f}")
    if detail:
        lines.append("")
        for inf in infos:
            lines.append(f"  {inf.fqn:<48} {str(tuple(inf.param.shape)):<20} {inf.kind:<6} {inf.reason:<28}"
                         f" group={inf.group} owner={inf.owner}")
    return "\n".join(lines)
