"""QK-Clip (the "Clip" of Kimi K2's MuonClip): keep softmax-attention logits bounded by rescaling weights.

Rule (K2). After the optimizer step, for every softmax-attention head h whose largest pre-softmax logit seen in
this step's forward passes ``S_max^h`` exceeds ``tau = optim.qk_clip_threshold``, let ``gamma_h = tau / S_max^h``
and rescale that head's query and key weights so that every logit of the head is multiplied by ``gamma_h``:

* MLA head-specific query/key parts: ``W_q^{nope,h}`` (rows of ``q_b_proj`` / ``q_proj``) and the head's key
  up-projection rows ``W_k^{nope,h}`` (the k_nope rows of ``kv_b_proj``) are each scaled by ``sqrt(gamma_h)``,
  so ``q_nope . k_nope`` scales by ``gamma_h``.
* The rope slot: the key part ``k_pe`` comes from ``kv_a_proj`` and is SHARED by all heads, so scaling it would
  also shrink heads that did not overflow. K2 therefore leaves ``W_k^{rope}`` alone and scales the head-specific
  ``W_q^{rope,h}`` by the full ``gamma_h``, so ``q_pe . k_pe`` also scales by ``gamma_h``. (K3's MLA is NoPE:
  the slot carries no rotation, but it still contributes ``q_pe . k_pe`` to the logit, so the same rule holds.)
* Shared low-rank parts (``q_a_proj``, ``kv_a_proj``, their norms) are never touched, and values are never
  touched; heads with ``S_max^h <= tau`` are not changed at all.
Afterwards every logit of head h is exactly ``gamma_h`` times what the same input gave before, so the head's max
logit becomes ``tau`` (tested in ``tests/optim/test_qk_clip.py``).

Why KDA needs none: KDA's q and k go through L2Norm, so ``|q . k| <= 1`` (times the fixed scale); there is no
softmax over an unbounded logit and nothing for the weights' growth to blow up. Only MLA layers expose targets.

Distributed: ``S_max`` must be the max over the WHOLE global batch, so the per-head maxima are MAX-all-reduced
over the data/context-parallel group (``dp_cp``: data ranks see other sequences, CP ranks other query positions)
before ``gamma`` is computed; all ranks then agree on gamma and, in ZeRO, the owner of each weight scales it
before the parameter broadcast. The optimizer resets ``qk_max`` to 0 after each step (0 is as good as -inf
because only values > tau > 0 matter).

Protocol the model's attention module must satisfy (MLA; any module with both attributes is picked up):

    module.qk_max: Tensor[H]          buffer, running max of pre-softmax logits per head (AFTER the softmax
                                      scale, i.e. the values fed to softmax), updated under no_grad in training
    module.qk_clip_params() -> list of QKClipTarget (or plain tuples in the same field order):
        (param, num_heads, rows_per_head, row_offset, row_count, kind)
        param        the weight (2-D ``[num_heads*rows_per_head, in]``; a 1-D bias of the same rows also works)
        num_heads    H, must equal qk_max.numel()
        rows_per_head  stride of one head's row block (e.g. qk_nope+qk_rope for q_b_proj, qk_nope+v for kv_b_proj)
        row_offset, row_count  the rows inside each head block to scale
        kind         "q" or "k" -> scaled by sqrt(gamma); "q_rope" -> scaled by gamma

Example for K3's MLA (q_lora_rank > 0, heads of dn = qk_nope, dr = qk_rope, dv = v_head_dim rows)::

    def qk_clip_params(self):
        H, dn, dr, dv = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        return [(self.q_b_proj.weight, H, dn + dr, 0, dn, "q"),
                (self.q_b_proj.weight, H, dn + dr, dn, dr, "q_rope"),
                (self.kv_b_proj.weight, H, dn + dv, 0, dn, "k")]
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

QK_KINDS = {"q": 0.5, "k": 0.5, "q_rope": 1.0}


class QKClipTarget(NamedTuple):
    param: nn.Parameter
    num_heads: int
    rows_per_head: int
    row_offset: int
    row_count: int
    kind: str

    @property
    def exponent(self) -> float:
        """The power of gamma applied to these rows."""
        return QK_KINDS[self.kind]


def qk_clip_targets(module: nn.Module) -> list[QKClipTarget]:
    """The validated QK-Clip targets of one attention module (see the protocol in the module docstring)."""
    qk_max = getattr(module, "qk_max", None)
    if not isinstance(qk_max, torch.Tensor) or qk_max.ndim != 1:
        raise ValueError(f"{type(module).__name__}: QK-Clip needs a 1-D `qk_max` buffer [num_heads]")
    out = []
    for raw in module.qk_clip_params():
        t = QKClipTarget(*raw)
        where = f"{type(module).__name__}.qk_clip_params() entry kind={t.kind!r}"
        if t.kind not in QK_KINDS:
            raise ValueError(f"{where}: kind must be one of {sorted(QK_KINDS)}")
        if t.num_heads != qk_max.numel():
            raise ValueError(f"{where}: num_heads={t.num_heads} but qk_max has {qk_max.numel()} heads")
        if t.param.shape[0] != t.num_heads * t.rows_per_head:
            raise ValueError(f"{where}: param rows {t.param.shape[0]} != num_heads*rows_per_head "
                             f"= {t.num_heads}*{t.rows_per_head}")
        if t.row_offset < 0 or t.row_count < 1 or t.row_offset + t.row_count > t.rows_per_head:
            raise ValueError(f"{where}: rows [{t.row_offset}, +{t.row_count}) outside a head block of "
                             f"{t.rows_per_head} rows")
        out.append(t)
    return out


def find_qk_clip_modules(modules: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every submodule (by FQN, each once) that has both ``qk_max`` and ``qk_clip_params``."""
    seen: set[int] = set()
    out = []
    for mod in modules:
        for name, sub in mod.named_modules():
            if id(sub) in seen:
                continue
            if hasattr(sub, "qk_clip_params") and isinstance(getattr(sub, "qk_max", None), torch.Tensor):
                seen.add(id(sub))
                out.append((name, sub))
    return out


def all_reduce_qk_max(qk_maxes: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """MAX-all-reduce all modules' ``qk_max`` over ``group`` in ONE collective; returns float32 copies."""
    if not qk_maxes:
        return []
    flat = torch.cat([q.detach().float().reshape(-1) for q in qk_maxes])
    if group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return list(flat.split([q.numel() for q in qk_maxes]))


def clip_factors(qk_max: torch.Tensor, tau: float) -> torch.Tensor:
    """``gamma[H] = tau / qk_max`` where ``qk_max > tau``, else 1 (float32)."""
    qk_max = qk_max.float()
    return torch.where(qk_max > tau, tau / qk_max.clamp_min(1e-30), torch.ones_like(qk_max))


@torch.no_grad()
def scale_target_(w: torch.Tensor, target: QKClipTarget, gamma: torch.Tensor) -> None:
    """Multiply the target rows of ``w`` (the parameter or its float32 master, ``target.param``'s shape) by
    ``gamma[h] ** exponent`` per head h."""
    h, r = target.num_heads, target.rows_per_head
    view = w.view(h, r, -1)
    factor = gamma.to(device=w.device, dtype=torch.float32).pow(target.exponent).view(h, 1, 1)
    rows = view[:, target.row_offset:target.row_offset + target.row_count]
    rows.copy_((rows.float() * factor).to(w.dtype))


@torch.no_grad()
def reference_qk_clip_(modules: Iterable[nn.Module], tau: float) -> int:
    """Single-process reference: clip every target in place from the local ``qk_max``; returns #clipped heads."""
    n = 0
    for _, mod in find_qk_clip_modules(modules):
        gamma = clip_factors(mod.qk_max, tau)
        n += int((gamma < 1).sum())
        for t in qk_clip_targets(mod):
            scale_target_(t.param.data, t, gamma)
    return n
