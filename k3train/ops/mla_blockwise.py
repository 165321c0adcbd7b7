"""Blockwise (flash-attention structured) Gated MLA attention that expands keys and values from the latent per
key block: no ``[Tq, Tk]`` tensor, no dense mask and no all-keys K/V are ever built.

Contract (the dense reference is :func:`k3train.ops.mla_dense.attention_core` on ``MLA.expand_latent(latent)``)::

    q       [B, H, Tq, Dqk]     any float dtype; computed in fp32 (fp64 when q is fp64)
    latent  [B, Tk, L]          L = kv_lora_rank + Dr (the only per-key tensor that exists for all keys)
    expand  latent [1, n, L] -> (k [1, n, H, Dqk], v [1, n, H, Dv])   (``MLA.expand_latent``)
    weights the parameters ``expand`` reads (W_ukv, the c_kv RMSNorm weight): their gradients are returned
    mask    MaskInfo: q_doc / q_pos [B, Tq], k_doc / k_pos [B, Tk]; key j is allowed for query i iff
            k_pos[j] <= q_pos[i] and k_doc[j] == q_doc[i]; every query must be allowed its own key
    ->  o [B, H, Tq, Dv] (fp32 / fp64),  max_logit [H] (no grad: the largest allowed ``scale * q.k`` per head)

Why expand per key block rather than absorb W_ukv's key half into the queries (MLA inference's trick): K3 has
H = 96, Dqk = 128 + 64, Dv = 128, kv_lora_rank = 512. Absorbed, every (query, key, head) pair costs
2 * (576 + 512) FLOPs instead of 2 * (192 + 128): 3.4x the attention work, and the per-query state grows 3-4x
(q 576 instead of 192 per head, the output accumulator 512 instead of 128). Expanding costs
2 * 512 * 96 * 256 = 25 MFLOP per key per pass, which equals the attention of ~400 queries on that key; in
training every key is seen by thousands of queries (causal prefix under CP: 32K-1M), so expansion is cheaper by
two orders of magnitude. In bytes: all keys' K and V are 96 * 320 = 30,720 numbers per key (61 GB bf16 at 1M
keys); here only the 576-number latent exists for all keys (1.2 GB at 1M), plus one key block's K/V at a time.

Structure: the outer loop runs over (batch row, key block) -- the block's K/V are expanded once -- and the inner
loop over the query blocks that may see it, keeping the online-softmax state (row max ``m``, denominator ``l``,
accumulator) for all queries: ``[B, H, Tq]`` and ``[B, H, Tq, Dv]``, the size of the output. Forward saves q, the
latent, the output and the log-sum-exp ``m + log l``; backward recomputes each key block's K/V (under autograd,
through ``expand``) and each block's probabilities ``exp(s - lse)``, with ``D = rowsum(dO * O)``:
``dV += P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ += dS K * scale``, ``dK += dS^T Q * scale``; then the block's
``(dK, dV)`` are pulled back through ``expand`` into the latent block and the weights.

Skipping: a (row, query block, key block) pair is computed only when the per-block ranges allow a pair -- the key
block's smallest position <= the query block's largest, and the document-id ranges overlap -- so packed short
documents cost what their documents cost; pairs whose block ranges say "every pair allowed" skip the mask. The
decisions are made once in forward (:func:`block_plan`) and reused by backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["BlockPlan", "block_plan", "blockwise_mla_attention", "skipped_share"]

ExpandFn = Callable[[Tensor], tuple[Tensor, Tensor]]


@dataclass
class BlockPlan:
    """Which blocks to compute. ``work[b][j]``: the query blocks ``(i, full)`` that key block ``j`` of row ``b``
    reaches (``full``: every pair of the block is allowed, no mask needed); ``total`` = B * nq * nk."""

    block: int
    work: list[list[list[tuple[int, bool]]]]
    total: int

    @property
    def computed(self) -> int:
        return sum(len(q) for row in self.work for q in row)


def _block_ranges(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Per-block min and max of ``x [B, T]`` -> ``[B, ceil(T / block)]`` each (the last block may be short)."""
    B, T = x.shape
    n = -(-T // block)
    idx = torch.arange(n * block, device=x.device).clamp_(max=T - 1)  # repeating the last element keeps min/max
    xb = x[:, idx].view(B, n, block)
    return xb.amin(dim=-1), xb.amax(dim=-1)


def block_plan(mask: Any, block: int) -> BlockPlan:
    """The (row, key block, query block) pairs the causal + document mask does not empty, from per-block
    min/max of positions and document ids (conservative: a kept pair may still have no allowed entry; it is
    then masked to nothing). Kept on ``mask`` (its ``plans`` dict, when it has one): the head chunks of a layer
    and their recomputation share one mask, so the plan -- one host read of the block ranges -- is made once."""
    if block <= 0:
        raise ValueError(f"blockwise MLA: block size must be > 0, got {block}")
    plans = getattr(mask, "plans", None)
    if plans is not None and block in plans:
        return plans[block]
    plan = _make_plan(mask, block)
    if plans is not None:
        plans[block] = plan
    return plan


def _make_plan(mask: Any, block: int) -> BlockPlan:
    qp_lo, qp_hi = _block_ranges(mask.q_pos, block)
    qd_lo, qd_hi = _block_ranges(mask.q_doc, block)
    kp_lo, kp_hi = _block_ranges(mask.k_pos, block)
    kd_lo, kd_hi = _block_ranges(mask.k_doc, block)
    # [B, nq, nk]
    active = ((kp_lo[:, None, :] <= qp_hi[:, :, None]) & (kd_lo[:, None, :] <= qd_hi[:, :, None])
              & (kd_hi[:, None, :] >= qd_lo[:, :, None]))
    one_doc = (qd_lo[:, :, None] == qd_hi[:, :, None]) & (kd_lo[:, None, :] == kd_hi[:, None, :]) \
        & (kd_lo[:, None, :] == qd_lo[:, :, None])
    full = active & one_doc & (kp_hi[:, None, :] <= qp_lo[:, :, None])
    B, nq, nk = active.shape
    act, ful = active.transpose(1, 2).tolist(), full.transpose(1, 2).tolist()  # [B][nk][nq]
    work = [[[(i, ful[b][j][i]) for i in range(nq) if act[b][j][i]] for j in range(nk)] for b in range(B)]
    return BlockPlan(block=block, work=work, total=B * nq * nk)


def skipped_share(mask: Any, block: int) -> float:
    """Share of (row, query block, key block) pairs :func:`block_plan` skips."""
    plan = block_plan(mask, block)
    return 1.0 - plan.computed / max(plan.total, 1)


def _block_mask(mask: Any, b: int, qs: slice, ks: slice) -> Tensor:
    """``[Bq, Bk]`` bool: allowed pairs of one block (shared by all heads)."""
    causal = mask.k_pos[b, None, ks] <= mask.q_pos[b, qs, None]
    return causal & (mask.k_doc[b, None, ks] == mask.q_doc[b, qs, None])


def _expand_block(expand: ExpandFn, latent: Tensor, b: int, ks: slice, cdt: torch.dtype
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Expand one key block of row ``b``: ``(k, v)`` as ``expand`` returns them (``[1, n, H, D]``) and as
    ``[H, n, D]`` in the compute dtype."""
    k, v = expand(latent[b:b + 1, ks])
    return k, v, k[0].transpose(0, 1).to(cdt), v[0].transpose(0, 1).to(cdt)


def _shapes_only(t: Tensor) -> bool:
    """Whether ``t`` has shape and dtype but no data: the memory estimator's trace (FakeTensorMode), which books
    bytes only (k3train/planning/memory/)."""
    return isinstance(t, FakeTensor)


def _work(plan: BlockPlan, Tq: int, Tk: int, shapes_only: bool
          ) -> Iterator[tuple[int, int, list[tuple[int, bool]]]]:
    """``(row, key block, [(query block, full)])`` to compute, in order. With ``shapes_only`` (fake tensors: no
    value is computed, only bytes are booked) one key block of each kind -- its length and the set of its query
    blocks' kinds ``(full, length)`` -- and one query block of each kind within it: every step of the loops
    below starts from the same live tensors and leaves nothing behind (each step is a function whose locals die
    on return; the accumulators are written in place), so a step's bytes depend on its kind alone and the
    kinds' peaks are the whole loop's peak. At K3's 1M context this is what makes a trace of the op cost
    milliseconds instead of minutes (up to ~10^6 block pairs per layer at cp 4)."""
    block, seen = plan.block, set()
    for b, row in enumerate(plan.work):
        for j, qblocks in enumerate(row):
            if not qblocks:
                continue
            if not shapes_only:
                yield b, j, qblocks
                continue
            kinds: dict[tuple[bool, int], tuple[int, bool]] = {}
            for i, full in qblocks:
                kinds.setdefault((full, min(block, Tq - i * block)), (i, full))
            key = (min(block, Tk - j * block), frozenset(kinds))
            if key not in seen:
                seen.add(key)
                yield b, j, list(kinds.values())


def _forward_pair(qc: Tensor, kb: Tensor, vb: Tensor, mask: Any, b: int, qs: slice, ks: slice, full: bool,
                  m: Tensor, lsum: Tensor, acc: Tensor) -> None:
    """One (query block, key block) step of the online softmax, in place on ``m``, ``lsum``, ``acc``."""
    s = qc[b, :, qs] @ kb.transpose(-1, -2)  # [H, bq, n]
    if not full:
        s = s.masked_fill(~_block_mask(mask, b, qs, ks), float("-inf"))
    m_old = m[b, :, qs]
    m_new = torch.maximum(m_old, s.amax(dim=-1))
    m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with nothing allowed yet
    p = torch.exp(s - m_use[..., None])
    alpha = torch.exp(m_old - m_use)
    lsum[b, :, qs] = lsum[b, :, qs] * alpha + p.sum(dim=-1)
    acc[b, :, qs] = acc[b, :, qs] * alpha[..., None] + p @ vb
    m[b, :, qs] = m_new


def _backward_pair(qc: Tensor, do: Tensor, lse: Tensor, delta: Tensor, kb: Tensor, vb: Tensor, mask: Any,
                   b: int, qs: slice, ks: slice, full: bool, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """One (query block, key block) step of the backward, in place on ``dq``, ``dk``, ``dv``."""
    qb, dob = qc[b, :, qs], do[b, :, qs]
    s = qb @ kb.transpose(-1, -2)
    if not full:
        s = s.masked_fill(~_block_mask(mask, b, qs, ks), float("-inf"))
    p = torch.exp(s - lse[b, :, qs, None])  # masked entries: exp(-inf) = 0
    dv += p.transpose(-1, -2) @ dob
    ds = p * (dob @ vb.transpose(-1, -2) - delta[b, :, qs, None])
    dq[b, :, qs] += ds @ kb
    dk += ds.transpose(-1, -2) @ qb  # qb carries the scale


class _BlockwiseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, latent: Tensor, mask: Any, scale: float, block: int, expand: ExpandFn,
                *weights: Tensor) -> tuple[Tensor, Tensor]:
        B, H, Tq, _ = q.shape
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        plan = block_plan(mask, block)
        qc = q.to(cdt) * scale  # [B, H, Tq, Dqk], scale folded in
        m = torch.full((B, H, Tq), float("-inf"), dtype=cdt, device=q.device)
        lsum = torch.zeros((B, H, Tq), dtype=cdt, device=q.device)
        acc: Tensor | None = None
        for b, j, qblocks in _work(plan, Tq, latent.shape[1], _shapes_only(q)):
            ks = slice(j * block, (j + 1) * block)
            _, _, kb, vb = _expand_block(expand, latent, b, ks, cdt)  # [H, n, Dqk], [H, n, Dv]
            if acc is None:
                acc = torch.zeros((B, H, Tq, vb.shape[-1]), dtype=cdt, device=q.device)
            for i, full in qblocks:
                _forward_pair(qc, kb, vb, mask, b, slice(i * block, (i + 1) * block), ks, full, m, lsum, acc)
            del kb, vb  # not held into the next key block's expansion
        if acc is None:
            raise ValueError("blockwise MLA: no (query, key) pair is allowed (every query must see its own key)")
        out = acc / lsum[..., None]
        lse = m + torch.log(lsum)
        max_logit = m.amax(dim=(0, 2))  # [H]: every row's max over its allowed keys
        ctx.mark_non_differentiable(max_logit)
        ctx.save_for_backward(q, latent, out, lse)
        ctx.mask, ctx.scale, ctx.plan, ctx.expand, ctx.weights = mask, scale, plan, expand, weights
        return out, max_logit

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, _d_max: Tensor) -> tuple[Tensor | None, ...]:
        q, latent, out, lse = ctx.saved_tensors
        mask, scale, plan, expand, weights = ctx.mask, ctx.scale, ctx.plan, ctx.expand, ctx.weights
        cdt = out.dtype
        qc = q.to(cdt) * scale
        do = d_out.to(cdt)
        delta = (do * out).sum(dim=-1)  # D = rowsum(dO * O)  [B, H, Tq]
        dq = torch.zeros(qc.shape, dtype=cdt, device=q.device)
        want_lat = ctx.needs_input_grad[1]
        want_w = [w.requires_grad and ctx.needs_input_grad[6 + n] for n, w in enumerate(weights)]
        d_lat = torch.zeros(latent.shape, dtype=cdt, device=latent.device) if want_lat else None
        d_w: list[Tensor | None] = [torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, cdt), device=w.device)
                                    if want else None for w, want in zip(weights, want_w)]
        for b, j, qblocks in _work(plan, q.shape[2], latent.shape[1], _shapes_only(q)):
            _backward_key_block(qc, do, lse, delta, latent, mask, plan.block, expand, weights, want_w, b, j,
                                qblocks, dq, d_lat, d_w)
        d_q = (dq * scale).to(q.dtype)
        d_latent = d_lat.to(latent.dtype) if d_lat is not None else None
        d_weights = [g.to(w.dtype) if g is not None else None for g, w in zip(d_w, weights)]
        return (d_q, d_latent, None, None, None, None, *d_weights)


def _backward_key_block(qc: Tensor, do: Tensor, lse: Tensor, delta: Tensor, latent: Tensor, mask: Any, block: int,
                        expand: ExpandFn, weights: Sequence[Tensor], want_w: list[bool], b: int, j: int,
                        qblocks: list[tuple[int, bool]], dq: Tensor, d_lat: Tensor | None,
                        d_w: list[Tensor | None]) -> None:
    """Key block ``j`` of row ``b``: recompute its K/V under autograd, run its query blocks, then pull its
    ``(dK, dV)`` back through ``expand`` into the latent block and the weights (in place on the accumulators)."""
    cdt, want_lat = dq.dtype, d_lat is not None
    ks = slice(j * block, (j + 1) * block)
    with torch.enable_grad():
        lat = latent[b:b + 1, ks].detach().requires_grad_(want_lat)
        k_raw, v_raw, kb, vb = _expand_block(expand, lat, 0, slice(None), cdt)
    dk = torch.zeros(kb.shape, dtype=cdt, device=qc.device)
    dv = torch.zeros(vb.shape, dtype=cdt, device=qc.device)
    for i, full in qblocks:
        _backward_pair(qc, do, lse, delta, kb.detach(), vb.detach(), mask, b, slice(i * block, (i + 1) * block), ks,
                       full, dq, dk, dv)
    inputs = ([lat] if want_lat else []) + [w for w, want in zip(weights, want_w) if want]
    if not inputs:
        return
    g_k = dk.transpose(0, 1)[None].to(k_raw.dtype)
    g_v = dv.transpose(0, 1)[None].to(v_raw.dtype)
    grads = list(torch.autograd.grad((k_raw, v_raw), inputs, (g_k, g_v), allow_unused=True))
    if want_lat:
        g = grads.pop(0)
        if g is not None:
            d_lat[b:b + 1, ks] += g
    for n, want in enumerate(want_w):
        if want:
            g = grads.pop(0)
            if g is not None:
                d_w[n] += g


def blockwise_mla_attention(q: Tensor, latent: Tensor, mask: Any, scale: float, block: int, expand: ExpandFn,
                            weights: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Causal + document masked MLA attention by blocks (module docstring): ``q [B, H, Tq, Dqk]``, ``latent
    [B, Tk, L]`` -> ``(o [B, H, Tq, Dv] fp32/fp64, max_logit [H])``. ``expand`` maps a latent block
    ``[1, n, L]`` to ``(k [1, n, H, Dqk], v [1, n, H, Dv])`` using only ``weights`` (whose gradients it
    accumulates) and must act on each key independently."""
    if q.dim() != 4 or latent.dim() != 3 or q.shape[0] != latent.shape[0]:
        raise ValueError(f"blockwise MLA: expected q [B, H, Tq, D] and latent [B, Tk, L], got {tuple(q.shape)} "
                         f"and {tuple(latent.shape)}")
    B, _, Tq, _ = q.shape
    Tk = latent.shape[1]
    for name, t, n in (("q_doc", mask.q_doc, Tq), ("q_pos", mask.q_pos, Tq), ("k_doc", mask.k_doc, Tk),
                       ("k_pos", mask.k_pos, Tk)):
        if tuple(t.shape) != (B, n):
            raise ValueError(f"blockwise MLA: mask.{name} must be [{B}, {n}], got {tuple(t.shape)}")
    return _BlockwiseMLA.apply(q, latent, mask, scale, int(block), expand, *weights)
