"""Chunked KDA as one ``torch.autograd.Function`` with a hand-written chunked backward (the training path).

Same math and layout as the autograd reference :mod:`k3train.ops.kda_chunk` (read its docstring for the chunk
form); per chunk of C tokens entered with state S (all batched over chunks and heads)::

    A = strict_tril(gram(b*K, K)),  T = (I + A)^-1,  [W | Uw] = T [b*Gamma*K | b*V],  U = Uw - W S
    P = tril(gram(Q, K)),  O = P U + (Gamma*Q) S,  S' = Diag(Gamma_C) S + Kd^T U     (Kd = K * Gamma_C / Gamma)
    gram(X, Y)_ij = sum_c X_ic Y_jc exp(G_ic - G_jc)

Why a Function: autograd of the reference keeps ~10x the input bytes and, in the state fold, creates one
index-backward node per chunk step whose zero-filled ``[NC,H,K,K]`` buffers make the backward quadratic in the
chunk count. Here the forward keeps the inputs (in the chunk layout when they are already in the compute dtype), the
per-chunk entry states and, where the total stays within ``KEEP_LIMIT`` = 3x the input bytes, what is costly to
rebuild: P, the UT inverse T, [W | Uw] and the transition M (2.75x in all for fp32 at K = V = 2C; bf16 inputs would
reach 4.5x, so they keep only inputs and entry states, 2x; the reference keeps 9.9x). The backward then rebuilds
only the decay factors and sub-tile operands (elementwise work that costs more bytes to keep than time to redo)
and the effective query (else everything but the two value products), runs
the reverse fold ``dS_c = M_c^T dS_{c+1} + (Gamma*Q - P W)_c^T dO_c`` (one K x K x V matmul per step, on contiguous
step-major slices: no indexing, no autograd), and then gets every intra-chunk gradient from a few batched matmuls
over all chunks. The log-decay gradient uses ``dG = X * dX - Y * dY`` for each Gram (exact: the Grams depend on G
only through differences), then ``dg = reverse cumsum(dG)``. The UT inverse T is formed explicitly (one batched
triangular solve against I), so W, U and their gradients are GEMMs, reassociated through the pseudo-values
``U = Uw - W S``: ``d(bV) = T^T dU``, ``-d(b Gamma K) = d(bV) S^T``, ``dA = -d(bV) U^T``.
The only host reads are of the document lengths (``cu_seqlens``, to plan the chunk layout), never of tensor values.

Sub-tiling (16 tokens) as in the reference; both Grams share Y = K, so their rows are stacked and each tile
product is ONE matmul for A and P together. The diagonal-tile path is chosen from the decay parameterisation,
never from tensor values (no host synchronisation): ``g_lower_bound`` (every g >= it, as K3's lower-bounded gate
guarantees) bounds a sub-tile's log-decay span by ``15 * |g_lower_bound|``; within ``_DENSE_SPAN_MAX`` the diagonal
tiles are dense midpoint-factored matmuls, otherwise (or with no bound, e.g. the softplus gate) an explicit masked
pair product, exact for any g <= 0. Every exponent is clamped at ``-_EXP_FLOOR`` before ``exp`` (e^-25 in fp32), so
neither ``exp`` nor the GEMMs and the triangular inverse built from its factors meet subnormals (a slow CPU path).

Chunks are stored step-major (all documents' first chunks, then all second chunks, ...; documents sorted by chunk
count) so each fold step reads one contiguous slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .kda_chunk import SUB_TILE, doc_lengths
from .kda_naive import check_kda_inputs, compute_dtype

__all__ = ["chunk_kda_function", "dense_diagonal_ok", "KEEP_LIMIT", "SUB_TILE"]

# Largest sub-tile log-decay span for the dense diagonal tiles (factors within exp(+-span/2)); as the reference.
_DENSE_SPAN_MAX = {torch.float32: 80.0, torch.float64: 600.0}
# Exponent floor: every decay factor is exp(max(x, -floor)). exp never returns a subnormal (a slow path on CPUs),
# and the Gram entries built from up to three factors -- hence the UT inverse's entries and every GEMM operand --
# stay away from the subnormal range (flushing small factors to 0 instead fills the inverse with subnormals:
# measured 2.5x slower). The error is below e^-25 ~ 1e-11 relative (fp32), e^-200 (fp64).
_EXP_FLOOR = {torch.float32: 25.0, torch.float64: 200.0}


def dense_diagonal_ok(g_lower_bound: float | None, dtype: torch.dtype) -> bool:
    """Whether the diagonal sub-tiles may use the dense factorisation, from the gate's lower bound alone."""
    if g_lower_bound is None:
        return False
    return (SUB_TILE - 1) * -float(g_lower_bound) <= _DENSE_SPAN_MAX[compute_dtype(dtype)]


# ----------------------------------------------------------------------------------------------------------------
# Step-major layout
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class _StepLayout:
    rows: Tensor         # [NC*H*C] (token, head) row feeding each chunk slot, in [NC,H,C] order (pads: row 0)
    pads: Tensor | None  # [n_pad] chunk-slot rows that are padding (zeroed after the gather), None if none
    inv: Tensor          # [n_tokens*H] chunk-slot row of every (token, head), in [T,H] order
    n_chunks: int
    counts: list[int]    # documents active at each step (descending)
    offsets: list[int]   # first chunk of each step
    order: Tensor        # [N] documents sorted by chunk count, descending
    inv_order: Tensor


def _step_layout(lengths: list[int], chunk: int, heads: int, device: torch.device) -> _StepLayout:
    """Chunk c = offsets[j] + i is chunk j of sorted document i. Host work is over documents/steps only."""
    lens = torch.tensor(lengths, dtype=torch.long)
    n_docs = len(lengths)
    starts = torch.cumsum(lens, 0) - lens
    n_ch = (lens + chunk - 1) // chunk
    order = torch.sort(n_ch, descending=True, stable=True).indices
    rank = torch.argsort(order)                                          # sorted position of each document
    n_steps = int(n_ch.max()) if n_docs else 0
    steps = torch.arange(n_steps)
    counts_t = (n_ch[None, :] > steps[:, None]).sum(1)                   # [n_steps]
    offs_t = torch.cumsum(counts_t, 0) - counts_t
    nc, n_tok = int(counts_t.sum()), int(lens.sum())
    step_of = torch.repeat_interleave(steps, counts_t)                    # [NC]
    doc_of = order[torch.arange(nc) - offs_t[step_of]]                    # [NC] original document id
    off = step_of[:, None] * chunk + torch.arange(chunk)                  # [NC, C] offset inside the document
    real = off < lens[doc_of][:, None]
    tok = torch.where(real, starts[doc_of][:, None] + off, 0)             # [NC, C]
    h = torch.arange(heads)
    rows = (tok[:, None, :] * heads + h[None, :, None]).reshape(-1)       # [NC, H, C]
    pad_rows = torch.nonzero((~real)[:, None, :].expand(nc, heads, chunk).reshape(-1)).flatten()
    doc_of_tok = torch.repeat_interleave(torch.arange(n_docs), lens)
    pos = torch.arange(n_tok) - starts[doc_of_tok]
    c_tok = offs_t[pos // chunk] + rank[doc_of_tok] if n_tok else pos     # chunk of every token
    inv = ((c_tok[:, None] * heads + h[None, :]) * chunk + (pos % chunk)[:, None]).reshape(-1)
    to = dict(device=device)
    return _StepLayout(rows.to(**to), pad_rows.to(**to) if pad_rows.numel() else None, inv.to(**to), nc,
                       counts_t.tolist(), offs_t.tolist(), order.to(**to), rank.to(**to))


def _to_chunks(x: Tensor, lay: _StepLayout, chunk: int, cd: torch.dtype) -> Tensor:
    """[B,T,H,*] -> contiguous [NC,H,C,*] in ``cd`` in one gather (padding slots are zero: identity transition)."""
    tail = x.shape[3:]
    out = x.reshape(-1, *tail).index_select(0, lay.rows).to(cd)
    if lay.pads is not None:
        out[lay.pads] = 0
    return out.reshape(lay.n_chunks, x.shape[2], chunk, *tail)


def _from_chunks(x: Tensor, lay: _StepLayout, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """[NC,H,C,*] -> [B,T,H,*] (real tokens only), one gather."""
    return x.reshape(-1, *x.shape[3:]).index_select(0, lay.inv).reshape(shape).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Intra-chunk quantities (recomputed in backward)
# ----------------------------------------------------------------------------------------------------------------
def _const(name: str, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Small constant 0/1 matrices (built per call: a few hundred elements; no cache, so a fake-tensor trace such as
    the memory estimator's can never leave a fake constant behind for a real run)."""
    i = torch.arange(n, device=device)
    if name == "suffix":        # [i, t] = 1 for t > i: exclusive suffix sums as one matmul
        m = i[None, :] > i[:, None]
    elif name == "revcum":      # [t, i] = 1 for i >= t: inclusive reverse cumsum
        m = i[None, :] >= i[:, None]
    elif name == "between":     # [s*n + t, u] = 1 for t < u < s
        m = ((i[None, None, :] < i[:, None, None]) & (i[None, :, None] < i[None, None, :])).reshape(n * n, n)
    elif name == "span":        # [i*16 + j, t] = 1 for j < t <= i (pairwise exponents)
        m = ((i[None, None, :] > i[None, :, None]) & (i[None, None, :] <= i[:, None, None])).reshape(n * n, n)
    elif name == "eye":
        m = i[None, :] == i[:, None]
    elif name == "diag_keep":   # [2*16, 16]: strict lower (A rows) over inclusive lower (P rows)
        m = torch.cat([i[None, :] < i[:, None], i[None, :] <= i[:, None]], 0)
    else:
        raise KeyError(name)
    return m.to(dtype)


def _bmm_add(c: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``c + alpha * a @ b`` over any leading dims, as one fused batched GEMM."""
    out = torch.baddbmm(c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=alpha)
    return out.view(*c.shape)


def _bmm_add_(c: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``c += alpha * a @ b`` in place (``c`` a contiguous temporary), one batched GEMM with no copy of ``c``."""
    c.view(-1, *c.shape[-2:]).baddbmm_(a.flatten(0, -3), b.flatten(0, -3), alpha=alpha)
    return c


def _bmm(a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """``alpha * a @ b`` over any leading dims as one batched GEMM (no separate scaling pass)."""
    a3, b3 = a.flatten(0, -3), b.flatten(0, -3)
    out = torch.baddbmm(a3.new_empty(a3.shape[0], a3.shape[1], b3.shape[2]), a3, b3, beta=0.0, alpha=alpha)
    return out.view(*a.shape[:-1], b.shape[-1])


@dataclass
class _Tiles:
    """Sub-tile operands shared by the two Grams (rows [b*K ; Q] per tile, columns K)."""
    rowf: Tensor | None  # [..., n-1, 16, K]       exp(sum over [tile start, i]) for tiles 1..n-1
    esufl: Tensor | None  # [..., n-1, 16, K]     exp(sum over (j, end of tile t]) for tiles 0..n-2
    ehop: Tensor | None   # [..., n-1, n-1, K]    [s-1, t]: exp(sum of the tiles strictly between t and s) if t < s
                          #                       else 0
    xs: Tensor | None    # [..., n-1, 2, 16, K]    row operands of the off-diagonal blocks
    ks: Tensor | None    # [..., n-1, (n-1)*16, K] column operands of the off-diagonal blocks
    xd: Tensor           # [..., n, 2, 16, K]      dense: midpoint-scaled rows; pairwise: raw rows
    kdg: Tensor          # dense: [..., n, 16, K] midpoint-scaled K; pairwise: F*K [..., n, 16, 16, K]
    er: Tensor | None    # dense: [..., n, 16, K] exp(Gl - m)
    fac: Tensor | None   # pairwise: [..., n, 16, 16, K] exp(sum over (j, i]) masked to j <= i
    dense: bool


@dataclass
class _Intra:
    """Everything a chunk's forward and backward need besides the entry state, for all chunks at once."""
    q: Tensor; k: Tensor; v: Tensor; b: Tensor           # noqa: E702  chunked inputs (q scaled)
    gam: Tensor          # [..., C, K] exp(G)
    esuf: Tensor         # [..., C, K] exp(G_C - G)
    kd: Tensor           # [..., C, K] K * exp(G_C - G)
    kb: Tensor           # [..., C, K] b * K
    Tinv: Tensor         # [..., C, C] (I + A)^-1
    P: Tensor            # [..., C, C] lower incl. diagonal
    sol: Tensor          # [..., C, K+V] [W | Uw], the UT solve's output
    W: Tensor            # [..., C, K]  (view into sol)
    Uw: Tensor           # [..., C, V]
    Mn: Tensor           # [..., K, K] minus the chunk transition: Kd^T W - Diag(Gamma_C)
    qn: Tensor           # [..., C, K] minus the effective query: P W - Gamma*Q
    tiles: _Tiles


@dataclass
class _Kept:
    """What the forward may keep for the backward besides the inputs and the entry states (the costly part to
    rebuild: both Gram assemblies, the triangular solve and two of the GEMMs): 1.25x the input bytes for fp32 at
    K = V = 2C, so autograd keeps 2.75x in all. Kept only within ``KEEP_LIMIT`` (bf16 inputs: it would be 4.5x)."""
    P: Tensor            # [..., C, C]
    Tinv: Tensor         # [..., C, C]
    sol: Tensor          # [..., C, K+V]
    Mn: Tensor           # [..., K, K]


# Largest (autograd-saved bytes / input bytes) for which the forward keeps its solve (issue 13's bound).
KEEP_LIMIT = 3.0


def _keep_fits(ins: tuple[Tensor, ...], kept_ins: tuple[Tensor, ...], entries: Tensor, it: _Intra) -> bool:
    """Whether the kept inputs (``kept_ins``: the inputs or their padded chunk copies) + entry states + the
    :class:`_Kept` tensors fit in ``KEEP_LIMIT`` x the input bytes. Shapes and dtypes only."""
    nbytes = lambda x: x.numel() * x.element_size()  # noqa: E731
    saved = sum(nbytes(x) for x in (*kept_ins, entries, it.P, it.Tinv, it.sol, it.Mn))
    return saved <= KEEP_LIMIT * sum(nbytes(x) for x in ins)


def _exp(x: Tensor, floor: float, *, inplace: bool = True) -> Tensor:
    """``exp(max(x, -floor))`` (in place on ``x`` when it is a temporary); see ``_EXP_FLOOR``."""
    return (x.clamp_min_(-floor) if inplace else x.clamp_min(-floor)).exp_()


def _decay(g: Tensor, n: int, fl: float, cd: torch.dtype, dev: torch.device
           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The decay factors of ``g [..., C, K]`` in ``n`` sub-tiles: ``(gt, Gl, tot, sufl, esuf, gam)``, g tiled, its
    sums over [tile start, i], each tile's total, sums over (j, tile end], ``exp(G_C - G)`` and ``exp(G)``."""
    ST = SUB_TILE
    gt = g.unflatten(-2, (n, ST))                                         # [..., C, K] -> [..., n, 16, K]
    Gl = gt.cumsum(-2)                                                    # sum over [tile start, i]
    tot = Gl[..., -1, :]                                                  # [..., n, K]
    G = Gl + (tot.cumsum(-2) - tot)[..., None, :] if n > 1 else Gl       # + earlier tiles (same-sign sums)
    sufl = torch.matmul(_const("suffix", ST, cd, dev), gt)                # sum over (j, tile end]
    esuf = sufl + torch.matmul(_const("suffix", n, cd, dev), tot)[..., None, :] if n > 1 else sufl.clone()
    esuf = _exp(esuf, fl).flatten(-3, -2)                                 # exp(G_C - G)
    gam = _exp(G.flatten(-3, -2), fl, inplace=n > 1)
    return gt, Gl, tot, sufl, esuf, gam


def _off_diagonal_operands(k: Tensor, kt: Tensor, kbt: Tensor, qt: Tensor, Gl: Tensor, tot: Tensor, sufl: Tensor,
                           n: int, fl: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(rowf, esufl, ehop, xs, ks)`` of :class:`_Tiles`: the operands of the blocks below the diagonal tiles
    (``n > 1``)."""
    cd, dev, ST, K = k.dtype, k.device, SUB_TILE, k.shape[-1]
    lead = k.shape[:-2]
    rowf = _exp(Gl[..., 1:, :, :], fl, inplace=False)
    between = torch.matmul(_const("between", n, cd, dev), tot).unflatten(-2, (n, n))   # [..., s, t, K]
    # column factor of block (s, t) = exp(sum over (j, end of t]) * exp(tiles strictly between): both <= 1
    ehop = _exp(between[..., 1:, :-1, :], fl, inplace=False)
    ehop.mul_(_const("revcum", n - 1, cd, dev).T[:, :, None])                          # keep t < s
    esufl = _exp(sufl[..., :-1, :, :], fl, inplace=False)
    xs = k.new_empty(*lead, n - 1, 2, ST, K)
    torch.mul(kbt[..., 1:, :, :], rowf, out=xs[..., 0, :, :])
    torch.mul(qt[..., 1:, :, :], rowf, out=xs[..., 1, :, :])
    ks = ((kt[..., :-1, :, :] * esufl)[..., None, :, :, :] * ehop[..., :, :, None, :]).flatten(-3, -2)
    return rowf, esufl, ehop, xs, ks


def _diagonal_operands(k: Tensor, kt: Tensor, kbt: Tensor, qt: Tensor, Gl: Tensor, gt: Tensor, n: int, fl: float,
                       dense: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(xd, kdg, er, fac)`` of :class:`_Tiles`: the operands of the diagonal tiles, midpoint-scaled (``dense``)
    or pairwise."""
    cd, dev, ST, K = k.dtype, k.device, SUB_TILE, k.shape[-1]
    er = fac = None
    if dense:
        er = (Gl - 0.5 * (Gl[..., :1, :] + Gl[..., -1:, :])).exp_()     # midpoint of the tile's range (g <= 0)
        xd = k.new_empty(*k.shape[:-2], n, 2, ST, K)
        torch.mul(kbt, er, out=xd[..., 0, :, :])
        torch.mul(qt, er, out=xd[..., 1, :, :])
        kdg = kt / er                                                     # K * exp(m - Gl)
    else:
        expo = torch.matmul(_const("span", ST, cd, dev), gt).unflatten(-2, (ST, ST))        # [..., n, i, j, K]
        fac = _exp(expo, fl).mul_(_const("revcum", ST, cd, dev).T[:, :, None])              # keep j <= i
        xd = torch.stack([kbt, qt], -3)
        kdg = fac * kt[..., None, :, :]                                                    # [..., n, i, j, K]
    return xd, kdg, er, fac


def _grams(k: Tensor, tiles: _Tiles, n: int) -> tuple[Tensor, Tensor]:
    """Both Grams ``(A, P) [..., C, C]`` from the sub-tile operands: the diagonal tiles, then the blocks below."""
    cd, dev, ST, C = k.dtype, k.device, SUB_TILE, k.shape[-2]
    xd, kdg = tiles.xd, tiles.kdg
    if tiles.dense:
        diag = torch.matmul(xd.flatten(-3, -2), kdg.transpose(-1, -2))   # [..., n, 32, 16]
        diag = torch.where(_const("diag_keep", ST, torch.bool, dev), diag, 0.0)
    else:
        diag = torch.matmul(xd.transpose(-3, -2), kdg.transpose(-1, -2))                  # [..., n, i, 2, j]
        diag = diag.transpose(-3, -2).flatten(-3, -2) * _const("diag_keep", ST, cd, dev)  # [..., n, 32, 16]
    A = k.new_zeros(*k.shape[:-2], C, C)
    P = k.new_zeros(*k.shape[:-2], C, C)
    d2 = diag.unflatten(-2, (2, ST))                                      # [..., n, 2, 16, 16]
    for r, L in enumerate((A, P)):
        _diag_tiles(L, n).copy_(d2[..., r, :, :])
    if n > 1:
        off = torch.matmul(tiles.xs.flatten(-3, -2), tiles.ks.transpose(-1, -2)).unflatten(-2, (2, ST))
        for r, L in enumerate((A, P)):                                    # off: [..., n-1, 2, 16, ce]
            L[..., ST:, :C - ST] += off[..., r, :, :].flatten(-3, -2)
    return A, P


def _intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, dense: bool, kept: _Kept | None = None,
           values: bool = True) -> tuple[_Intra, tuple[Tensor, Tensor] | None]:
    """Decay factors, both Grams, the UT solve and the chunk transition, batched over [NC, H].

    The forward (``kept`` None, ``values``) builds everything and also returns ``(H = Kd^T Uw, P Uw)``. A backward
    given the forward's :class:`_Kept` rebuilds only the decay factors and sub-tile operands (elementwise work that
    would cost more bytes to keep than to recompute) and the effective query; one without it rebuilds everything
    but the two value products (``values=False``).
    """
    cd = q.dtype
    fl = _EXP_FLOOR[cd]
    C, K = k.shape[-2], k.shape[-1]
    n = C // SUB_TILE
    dev = q.device
    gt, Gl, tot, sufl, esuf, gam = _decay(g, n, fl, cd, dev)
    kb = k * b[..., None]
    kd = k * esuf
    kt, kbt, qt = (x.unflatten(-2, (n, SUB_TILE)) for x in (k, kb, q))  # [..., C, K] -> [..., n, 16, K]
    rowf = esufl = ehop = xs = ks = None
    if n > 1:
        rowf, esufl, ehop, xs, ks = _off_diagonal_operands(k, kt, kbt, qt, Gl, tot, sufl, n, fl)
    xd, kdg, er, fac = _diagonal_operands(k, kt, kbt, qt, Gl, gt, n, fl, dense)
    tiles = _Tiles(rowf, esufl, ehop, xs, ks, xd, kdg, er, fac, dense)
    if kept is not None:                                                  # backward: the rest was kept
        W, Uw = kept.sol[..., :K], kept.sol[..., K:]
        qn = torch.matmul(kept.P, W).addcmul_(q, gam, value=-1.0)
        it = _Intra(q, k, v, b, gam, esuf, kd, kb, kept.Tinv, kept.P, kept.sol, W, Uw, kept.Mn, qn, tiles)
        return it, None
    A, P = _grams(k, tiles, n)
    rhs = k.new_empty(*k.shape[:-2], C, K + v.shape[-1])
    torch.mul(kb, gam, out=rhs[..., :K])
    torch.mul(v, b[..., None], out=rhs[..., K:])
    # explicit inverse (one triangular solve against I, then GEMMs; reused by the backward as T^T)
    Tinv = torch.linalg.solve_triangular(A, _const("eye", C, cd, dev).expand_as(A), upper=False, unitriangular=True)
    del A
    sol = torch.matmul(Tinv, rhs)
    W, Uw = sol[..., :K], sol[..., K:]
    kdT = kd.transpose(-1, -2)
    Mn = torch.matmul(kdT, W)                                             # own storage: the backward keeps it
    Mn.diagonal(dim1=-2, dim2=-1).sub_(gam[..., -1, :])
    p_sol = torch.matmul(P, sol if values else W)                         # P [W | Uw] in one GEMM
    qn = torch.addcmul(p_sol[..., :K], q, gam, value=-1.0)
    it = _Intra(q, k, v, b, gam, esuf, kd, kb, Tinv, P, sol, W, Uw, Mn, qn, tiles)
    return it, (torch.matmul(kdT, Uw), p_sol[..., K:]) if values else None


def _diag_tiles(L: Tensor, n: int) -> Tensor:
    """View ``[..., n, 16, 16]`` of the diagonal 16 x 16 tiles of ``L [..., C, C]``."""
    ST = SUB_TILE
    return L.unflatten(-1, (n, ST)).unflatten(-3, (n, ST)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _gram_backward(dA: Tensor, dP: Tensor, it: _Intra) -> tuple[Tensor, Tensor, Tensor]:
    """Given dA (strictly lower) and dP (lower), return (d(b*K), dQ, dK) through both Grams."""
    t = it.tiles
    C = it.k.shape[-2]
    n, ST = C // SUB_TILE, SUB_TILE
    dd = torch.stack([_diag_tiles(L, n) for L in (dA, dP)], -3)          # [..., n, 2, 16, 16]
    if t.dense:
        ddf = dd.flatten(-3, -2)                                          # [..., n, 32, 16]
        dx = torch.matmul(ddf, t.kdg).unflatten(-2, (2, ST)).mul_(t.er[..., :, None, :, :])  # [..., n, 2, 16, K]
        dk = torch.matmul(ddf.transpose(-1, -2), t.xd.flatten(-3, -2)).div_(t.er)            # [..., n, 16, K]
    else:
        ddi = dd.transpose(-3, -2)                                        # [..., n, i, 2, j]
        dx = torch.matmul(ddi, t.kdg).transpose(-3, -2)                   # [..., n, 2, i, K]
        outer = torch.matmul(ddi.transpose(-1, -2), t.xd.transpose(-3, -2))                   # [..., n, i, j, K]
        dk = (outer * t.fac).sum(-3)                                      # over i
    if n > 1:
        ce = C - ST
        dl = torch.stack([L[..., ST:, :ce].unflatten(-2, (n - 1, ST)) for L in (dA, dP)], -3).flatten(-3, -2)
        dxs = torch.matmul(dl, t.ks).unflatten(-2, (2, ST))               # [..., n-1, 2, 16, K]
        dx[..., 1:, :, :, :].addcmul_(dxs, t.rowf[..., :, None, :, :])
        dks = torch.matmul(dl.transpose(-1, -2), t.xs.flatten(-3, -2)).unflatten(-2, (n - 1, ST))  # [.., s, t, 16, K]
        dk[..., :-1, :, :].addcmul_(dks.mul_(t.ehop[..., :, :, None, :]).sum(-4), t.esufl)
    return dx[..., 0, :, :].flatten(-3, -2), dx[..., 1, :, :].flatten(-3, -2), dk.flatten(-3, -2)


# ----------------------------------------------------------------------------------------------------------------
# Folds over the chunk index (contiguous step-major slices, results written in place)
# ----------------------------------------------------------------------------------------------------------------
def _fold_forward(Mn: Tensor, Hs: Tensor, lay: _StepLayout, S0: Tensor) -> tuple[Tensor, Tensor]:
    """``S <- H_c - Mn_c S`` (Mn = -M); returns entry states [NC,H,K,V] (step-major) and finals [N,H,K,V]."""
    S0s = S0[lay.order]
    entries = torch.empty_like(Hs)
    final = torch.empty_like(S0s)
    counts, offs = lay.counts, lay.offsets
    n0 = counts[0] if counts else 0
    final[n0:] = S0s[n0:]                                                 # documents without chunks keep S0
    entries[:n0] = S0s[:n0]
    for j, (n_j, o_j) in enumerate(zip(counts, offs)):
        n_next = counts[j + 1] if j + 1 < len(counts) else 0
        sl = slice(o_j, o_j + n_j)
        args = (Hs[sl].flatten(0, 1), Mn[sl].flatten(0, 1), entries[sl].flatten(0, 1))
        if n_next == n_j:                                                 # every document continues
            torch.baddbmm(*args, alpha=-1.0, out=entries[offs[j + 1]:offs[j + 1] + n_j].flatten(0, 1))
            continue
        S = torch.baddbmm(*args, alpha=-1.0).unflatten(0, (n_j, -1))
        if n_next:
            entries[offs[j + 1]:offs[j + 1] + n_next] = S[:n_next]
        final[n_next:n_j] = S[n_next:]
    return entries, final[lay.inv_order]


def _fold_backward(Mn: Tensor, R: Tensor, lay: _StepLayout, d_final: Tensor) -> tuple[Tensor, Tensor]:
    """``dS_c = R_c - Mn_c^T dS'_c`` backwards; returns exit-state grads dS' [NC,H,K,V] and dS0 [N,H,K,V]."""
    d_fin = d_final[lay.order]
    d_exit = torch.empty_like(R)
    d_s0 = d_fin.clone()
    counts, offs = lay.counts, lay.offsets
    if counts:
        d_exit[offs[-1]:offs[-1] + counts[-1]] = d_fin[:counts[-1]]
    for j in range(len(counts) - 1, -1, -1):
        n_j, o_j = counts[j], offs[j]
        sl = slice(o_j, o_j + n_j)
        # the entry grad of step j is the exit grad of step j-1 for the same documents (or dS0 at j = 0)
        dst = d_exit[offs[j - 1]:offs[j - 1] + n_j] if j else d_s0[:n_j]
        torch.baddbmm(R[sl].flatten(0, 1), Mn[sl].flatten(0, 1).transpose(-1, -2), d_exit[sl].flatten(0, 1),
                      alpha=-1.0, out=dst.flatten(0, 1))
        if j and counts[j - 1] > n_j:                                     # documents whose last chunk is j-1
            d_exit[offs[j - 1] + n_j:offs[j - 1] + counts[j - 1]] = d_fin[n_j:counts[j - 1]]
    return d_exit, d_s0[lay.inv_order]


# ----------------------------------------------------------------------------------------------------------------
# The Function
# ----------------------------------------------------------------------------------------------------------------
class _ChunkKDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor | None,
                scale: float, lay: _StepLayout, chunk: int, dense: bool, n_seq: int, keep_solve: bool | None
                ) -> tuple[Tensor, Tensor]:
        cd = compute_dtype(q.dtype)
        H, K, Vd = k.shape[2], k.shape[3], v.shape[3]
        ins = (q, k, v, g, beta)
        qc, kc, vc, gc, bc = (_to_chunks(x, lay, chunk, cd) for x in ins)
        it, (Hs, p_uw) = _intra(qc.mul_(scale), kc, vc, gc, bc, dense)
        S0 = s0.to(cd) if s0 is not None else q.new_zeros(n_seq, H, K, Vd, dtype=cd)
        entries, final = _fold_forward(it.Mn, Hs, lay, S0)
        o = _bmm_add(p_uw, it.qn, entries, alpha=-1.0)
        # Inputs already in the compute dtype are kept in the chunk layout (the same bytes as the inputs, and the
        # backward skips five gathers); lower-precision inputs are kept as given (the chunk copies would be fp32).
        chunked = all(x.dtype == cd for x in ins)
        kept_ins = (qc, kc, vc, gc, bc) if chunked else ins
        keep = keep_solve if keep_solve is not None else _keep_fits(ins, kept_ins, entries, it)
        extra = (it.P, it.Tinv, it.sol, it.Mn) if keep else ()
        ctx.save_for_backward(*kept_ins, entries, *extra)
        ctx.meta = (scale, lay, chunk, dense, n_seq, s0.dtype if s0 is not None else None, chunked,
                    [(x.shape, x.dtype) for x in ins])
        return _from_chunks(o, lay, v.shape, q.dtype), final

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_o: Tensor | None, d_final: Tensor | None) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        ins, S, extra = saved[:5], saved[5], saved[6:]
        scale, lay, chunk, dense, n_seq, s0_dtype, chunked, in_meta = ctx.meta
        cd = S.dtype
        if chunked:
            qc, kc, vc, gc, bc = ins                                      # q already scaled
        else:
            qc, kc, vc, gc, bc = (_to_chunks(x, lay, chunk, cd) for x in ins)
            qc.mul_(scale)
        it, _ = _intra(qc, kc, vc, gc, bc, dense, _Kept(*extra) if extra else None, values=False)
        dO = _to_chunks(d_o, lay, chunk, cd) if d_o is not None else torch.zeros_like(it.Uw)
        d_final = d_final.to(cd) if d_final is not None else S.new_zeros(n_seq, *S.shape[1:])
        R = _bmm(it.qn.transpose(-1, -2), dO, alpha=-1.0)                  # (Gamma Q - P W)^T dO  [NC,H,K,V]
        dSx, dS0 = _fold_backward(it.Mn, R, lay, d_final)                  # exit-state grads per chunk
        St = S.transpose(-1, -2)
        U = _bmm_add(it.Uw, it.W, S, alpha=-1.0)                          # pseudo-values Uw - W S
        dU = _bmm_add_(torch.matmul(it.P.transpose(-1, -2), dO), it.kd, dSx)
        dP = torch.matmul(dO, U.transpose(-1, -2)).tril_()
        dQg = torch.matmul(dO, St)
        dKd = torch.matmul(U, dSx.transpose(-1, -2))
        # [W | Uw] = T [b G K | b V] and U = Uw - W S, so with dUw = dU and dW = -dU S^T:
        dVb = torch.matmul(it.Tinv.transpose(-1, -2), dU)                # d(b V) = T^T dU
        dKn = torch.matmul(dVb, St)                                       # -d(b G K) = T^T dU S^T = dVb S^T
        dA = _bmm(dVb, U.transpose(-1, -2), alpha=-1.0).tril_(-1)         # -T^T (dUw Uw^T + dW W^T) = -dVb U^T
        dkb, dq, dk = _gram_backward(dA, dP, it)
        # Collect per (token, channel): E = d(b K) in total, then dq, dk and (dG = q dq - k dk + 2 bK E, exact
        # because every Gram / decay factor depends on G only through differences and Gamma, Gamma_C, Kd).
        E = torch.addcmul(dkb, it.gam, dKn, value=-1.0)
        dq = torch.addcmul(dq, it.gam, dQg)                               # contiguous (dq was a view)
        dk.addcmul_(it.b[..., None], E).addcmul_(it.esuf, dKd)
        dG = it.q * dq
        dG.addcmul_(it.k, dk, value=-1.0).addcmul_(it.kb, E, value=2.0)
        dG[..., -1, :] += (it.kd * dKd).sum(-2) + (dSx * S).sum(-1) * it.gam[..., -1, :]
        dg = torch.matmul(_const("revcum", dG.shape[-2], cd, dG.device), dG)      # dg_t = sum_{i >= t} dG_i
        db = (it.k * E).sum(-1) + (it.v * dVb).sum(-1)
        dv = dVb.mul_(it.b[..., None])
        outs = [_from_chunks(x, lay, shape, dtype)
                for x, (shape, dtype) in zip((dq.mul_(scale), dk, dv, dg, db), in_meta)]
        ds0 = dS0.to(s0_dtype) if s0_dtype is not None else None
        return (*outs, ds0, None, None, None, None, None, None)


def chunk_kda_function(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       cu_seqlens: Tensor | None = None, chunk_size: int = 64,
                       g_lower_bound: float | None = None, keep_solve: bool | None = None
                       ) -> tuple[Tensor, Tensor | None]:
    """Chunkwise KDA with a hand-written backward; signature and semantics of the reference ``chunk_kda``.

    Args:
        q, k: ``[B,T,H,K]``; v ``[B,T,H,V]``; g ``[B,T,H,K]`` log decay <= 0; beta ``[B,T,H]``.
        scale: default ``K ** -0.5``. initial_state: ``[N,H,K,V]`` or None. cu_seqlens: int ``[N+1]`` (B = 1).
        chunk_size: a multiple of 16.
        g_lower_bound: a bound the gate guarantees (every g >= it; K3's lower-bounded gate: ``gate_lower_bound``),
            or None when there is none (softplus gate). Picks the diagonal sub-tile path; values are never read.
        keep_solve: keep P, the UT inverse, [W | Uw] and M for the backward (faster) instead of rebuilding them;
            None (default): keep them when autograd's saved bytes stay within ``KEEP_LIMIT`` x the input bytes
            (from the shapes and dtypes alone: fp32 at K = V >= 32 with C = 64 keeps, bf16 inputs do not).
    Returns:
        ``(o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32 (float64 for float64) or None)``.
    Single-device op; no process group.
    """
    n_seq = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_TILE}, got {chunk_size}")
    if g_lower_bound is not None and g_lower_bound > 0:
        raise ValueError(f"g_lower_bound must be <= 0 (log decays are <= 0), got {g_lower_bound}")
    B, T, H, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    lay = _step_layout(doc_lengths(B, T, cu_seqlens), chunk_size, H, q.device)
    dense = dense_diagonal_ok(g_lower_bound, q.dtype)
    o, final = _ChunkKDA.apply(q, k, v, g, beta, initial_state, float(scale), lay, chunk_size, dense, n_seq,
                               keep_solve)
    return o, (final if output_final_state else None)
