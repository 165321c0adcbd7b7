"""Quantile Balancing (QB): the router-bias rule of Kimi K3 (spec "Router and Quantile Balancing"; seed 001 5.6-5.7,
seed 003 5.3-5.4), plus the sign rule it replaces. Pure functions, no state, no communication.

Notation: a step routes m tokens over n experts, top-k. Scores ``s[m, n]`` (sigmoid, in (0, 1)), bias ``b[n]``.

1. Route with Top-(k+1) of ``s + b``: the first k are the route, the (k+1)-th value is the token threshold
   ``alpha_i`` (an expert enters token i's top-k iff its biased score beats alpha_i).
2. Holding alpha fixed, expert j would receive ``#{i : s_ij + b_hat_j > alpha_i}`` tokens. Setting that count to
   the target ``q = m k / n`` gives ``-b_hat_j`` = the (q+1)-th largest margin ``s_ij - alpha_i``, i.e.
   ``b_hat_j`` = the (q+1)-th smallest "required bias" ``r_ij = alpha_i - s_ij``.
   Non-integer q: we use ``Q = ceil(q)`` (the count the histogram rule of the seed aims at; n * Q >= m k, so the
   targets can absorb every assignment). If ``Q + 1 > m`` (tiny m only) the largest r is used.
3. ``b_new = b_hat - mean(b_hat)`` (a common shift changes no top-k); it routes the NEXT step only.

Distributed estimator (what training uses): per expert a histogram of ``r_ij`` with B uniform bins over
``[b_min - 1, b_max + 1]`` of the bias that routed the step. Why that range: alpha_i is a biased score, so
``b_min < alpha_i < 1 + b_max``; with ``0 < s_ij < 1``, ``b_min - 1 < r_ij < b_max + 1``. It depends only on the bias,
which is identical on every rank, so all ranks bin identically and the integer counts can be SUM-all-reduced
across ranks and micro-batches: the result is exactly the histogram of the global batch. In floating point r can
touch or (by rounding of s + b) step a few ulps past an end (sigmoid saturates to exactly 0 or 1 in fp32), so bin
indices are clamped into the edge bins; such a value is off by far less than a bin width. The estimate: accumulate
the bins from the low-r end until the count EXCEEDS Q (seed 001 5.7, "until it exceeds the target"), i.e. reaches
Q + 1 -- that bin holds the same order statistic r_(Q+1) as the exact rule -- and interpolate linearly inside it.
So |histogram - exact| <= one bin width always, even for sparse data. (Seed 003 words it "reaches ceil(q)", which
estimates r_(ceil q), one order statistic lower; with q in the thousands the two are within a bin of each other.
We follow the exact rule so that both estimators target the same value.)
"""
from __future__ import annotations

import math

import torch


def target_count(num_assignments: torch.Tensor | int, num_experts: int) -> torch.Tensor | int:
    """``Q = ceil(m k / n)`` from the number of token->expert assignments ``m k`` (exact integer arithmetic)."""
    return (num_assignments + num_experts - 1) // num_experts


def route_topk_plus_one(scores: torch.Tensor, bias: torch.Tensor, k: int,
                        allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-(k+1) routing of ``scores[m, n] + bias[n]`` (only over the experts ``allowed[m, n]`` marks, when given:
    grouped top-k, k3train/model/moe.py ``group_choice_mask``).

    Returns ``topk_idx[m, k]`` (long; the route, by decreasing biased score) and ``alpha[m]`` (the (k+1)-th
    biased score, the token threshold of QB), both without gradient.
    """
    m, n = scores.shape
    if not 1 <= k < n:
        raise ValueError(f"route_topk_plus_one: need 1 <= k (num_experts_per_token) < n={n}, got k={k}")
    if bias.shape != (n,):
        raise ValueError(f"route_topk_plus_one: bias must have shape ({n},), got {tuple(bias.shape)}")
    with torch.no_grad():
        biased = scores.detach() + bias.to(scores.dtype)
        if allowed is not None:
            biased = biased.masked_fill(~allowed, float("-inf"))
        vals, idx = torch.topk(biased, k + 1, dim=-1, sorted=True)
    return idx[:, :k], vals[:, k]


def qb_exact_update(scores: torch.Tensor, bias: torch.Tensor, k: int, center: bool = True) -> torch.Tensor:
    """One exact QB step (reference; needs every score of the step in one place).

    ``scores[m, n]``: the step's router scores, ``bias[n]``: the bias that routed them. Returns the new bias
    ``[n]`` (centred unless ``center=False``): ``b_hat_j = -`` the (Q+1)-th largest margin ``s_ij - alpha_i``
    of column j, ``Q = ceil(m k / n)``. With m == 0 the bias is returned unchanged.
    """
    m, n = scores.shape
    if m == 0:
        return bias.clone()
    _, alpha = route_topk_plus_one(scores, bias, k)
    margins = scores.detach() - alpha[:, None]
    rank = min(int(target_count(m * k, n)), m - 1)  # 0-based index of the (Q+1)-th largest
    sorted_desc = torch.sort(margins, dim=0, descending=True).values
    b_hat = -sorted_desc[rank]
    if center:
        b_hat = b_hat - b_hat.mean()
    return b_hat.to(bias.dtype)


def qb_histogram_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi) = (min(bias) - 1, max(bias) + 1)`` as 0-d tensors on the bias' device (no host sync).

    Derived from the bias only, so every rank routing the layer gets bit-identical edges.
    """
    b = bias.detach()
    return b.min() - 1.0, b.max() + 1.0


def qb_histogram_counts(scores: torch.Tensor, alpha: torch.Tensor, lo: torch.Tensor | float,
                        hi: torch.Tensor | float, bins: int) -> torch.Tensor:
    """Per-expert histogram of ``r_ij = alpha_i - s_ij`` over ``[lo, hi]`` with ``bins`` uniform bins.

    ``scores[m, n]``, ``alpha[m]`` -> ``LongTensor[n, bins]``. Values outside ``[lo, hi)`` (only possible
    through rounding, see the module docstring) are clamped into the edge bins. Counts of disjoint token sets
    add up to the counts of their union, so micro-batches and ranks combine by summation.
    """
    m, n = scores.shape
    if bins < 1:
        raise ValueError(f"qb_histogram_counts: qb_bins must be >= 1, got {bins}")
    with torch.no_grad():
        r = alpha[:, None].to(scores.dtype) - scores.detach()
        scale = bins / (hi - lo)
        pos = torch.nan_to_num(torch.floor((r - lo) * scale), nan=0.0).clamp_(0, bins - 1).long()
        flat = pos + torch.arange(n, device=scores.device) * bins
        return torch.bincount(flat.reshape(-1), minlength=n * bins).view(n, bins)


def qb_histogram_update(counts: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float,
                        q: torch.Tensor | float, bias: torch.Tensor | None = None,
                        center: bool = True) -> torch.Tensor:
    """New bias from the (globally summed) histograms ``counts[n, B]`` of ``r`` over ``[lo, hi]``.

    For each expert, find the first bin where the cumulative count exceeds ``Q = ceil(q)`` (``q = m k / n``),
    i.e. reaches ``K = min(Q + 1, m)``, and interpolate linearly inside it:
    ``b_hat_j = lo + (bin + (K - count_before - 1/2) / count_in_bin) * width`` (the c values of a bin taken as
    evenly spread, each at the middle of its 1/c share), within one bin width of the exact (Q+1)-th smallest r
    (:func:`qb_exact_update`).
    Centred unless ``center=False``. If no token was counted (m == 0) ``bias`` (required then) is returned.
    Computed in float64; returns ``bias.dtype`` (float32 when ``bias`` is None).
    """
    n, bins = counts.shape
    counts = counts.to(torch.int64)
    cum = counts.cumsum(dim=1)
    total = cum[:, -1]
    q_t = torch.as_tensor(q, dtype=torch.float64, device=counts.device)
    # target order statistic K = Q + 1 (1-based), at most the number of counted values
    big_k = (torch.ceil(q_t).to(torch.int64) + 1).expand(n)
    big_k = torch.minimum(big_k, total).clamp(min=1)
    pos = torch.searchsorted(cum.contiguous(), big_k[:, None].contiguous(), side="left").squeeze(1)
    pos = pos.clamp(max=bins - 1)
    in_bin = counts.gather(1, pos[:, None]).squeeze(1)
    before = cum.gather(1, pos[:, None]).squeeze(1) - in_bin
    frac = ((big_k - before).double() - 0.5) / in_bin.clamp(min=1).double()
    lo64 = torch.as_tensor(lo, dtype=torch.float64, device=counts.device)
    hi64 = torch.as_tensor(hi, dtype=torch.float64, device=counts.device)
    b_hat = lo64 + (pos.double() + frac) * ((hi64 - lo64) / bins)
    if center:
        b_hat = b_hat - b_hat.mean()
    out_dtype = bias.dtype if bias is not None else torch.float32
    b_hat = b_hat.to(out_dtype)
    if bias is not None:
        # nothing counted this step: keep the old bias (no information, and 0/0 above)
        b_hat = torch.where(total.sum() > 0, b_hat, bias.detach())
    return b_hat


def sign_update(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free sign rule: ``b_j += rate * sign(mean_load - load_j)`` (not centred, as published)."""
    loads = loads.to(torch.float64)
    step = torch.sign(loads.mean() - loads) * rate
    return (bias.double() + step).to(bias.dtype)


def ema_update(old_bias: torch.Tensor, new_bias: torch.Tensor, ema: float) -> torch.Tensor:
    """``ema * old + (1 - ema) * new``; ``ema = 0`` returns ``new`` (the config's ``qb_ema``)."""
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"ema_update: qb_ema must be in [0, 1), got {ema}")
    if ema == 0.0:
        return new_bias
    return (ema * old_bias.double() + (1.0 - ema) * new_bias.double()).to(new_bias.dtype)


def max_violation(loads: torch.Tensor) -> torch.Tensor:
    """MaxVio = max expert load / mean expert load (1 = perfectly balanced). ``loads[n]`` -> 0-d float64; 0 when
    nothing was routed."""
    loads = loads.to(torch.float64)
    mean = loads.mean()
    return torch.where(mean > 0, loads.max() / mean.clamp(min=math.ulp(1.0)), torch.zeros_like(mean))
