"""Quantile Balancing pure functions: seed 001 section 5.6 worked example, exact vs histogram, sign rule."""
from __future__ import annotations

import math

import pytest
import torch

from k3train.ops.quantile_balancing import (
    ema_update,
    max_violation,
    qb_exact_update,
    qb_histogram_counts,
    qb_histogram_range,
    qb_histogram_update,
    route_topk_plus_one,
    sign_update,
    target_count,
)

torch.set_num_threads(1)

# Seed 001 5.6 (paper Figure 5): m=8 tokens, n=4 experts, k=1, bias 0, loads (4,3,1,0). The seed does not print
# the score table; these scores reproduce every number it does print: E1's sorted margins
# (0.36, 0.32, 0.06, 0.05, 0, 0, 0, -0.29), b_hat = (-0.06, -0.03, +0.10, +0.10), t4 = (0.74, 0.40, 0.34, 0.68)
# moving from E1 to E4, three edges moved, final loads (2, 2, 2, 2).
WORKED_SCORES = [
    [0.90, 0.54, 0.30, 0.44],  # t1 -> E1
    [0.82, 0.50, 0.20, 0.35],  # t2 -> E1
    [0.55, 0.30, 0.40, 0.50],  # t3 -> E1, then E4
    [0.74, 0.40, 0.34, 0.68],  # t4 -> E1, then E4
    [0.60, 0.80, 0.30, 0.20],  # t5 -> E2
    [0.50, 0.65, 0.20, 0.35],  # t6 -> E2
    [0.31, 0.63, 0.60, 0.30],  # t7 -> E2, then E3
    [0.45, 0.20, 0.70, 0.30],  # t8 -> E3
]


def _loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    idx, _ = route_topk_plus_one(scores, bias, k)
    return torch.bincount(idx.reshape(-1), minlength=scores.shape[1])


def test_route_topk_plus_one() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.rand(50, 8, generator=g)
    b = torch.randn(8, generator=g) * 0.1
    idx, alpha = route_topk_plus_one(s, b, 3)
    vals, ref = torch.topk(s + b, 4, dim=-1)
    assert torch.equal(idx, ref[:, :3]) and torch.equal(alpha, vals[:, 3])
    with pytest.raises(ValueError, match="num_experts_per_token"):
        route_topk_plus_one(s, b, 8)


def test_worked_example_seed001() -> None:
    s = torch.tensor(WORKED_SCORES, dtype=torch.float64)
    b0 = torch.zeros(4, dtype=torch.float64)
    assert _loads(s, b0, 1).tolist() == [4, 3, 1, 0]
    _, alpha = route_topk_plus_one(s, b0, 1)
    e1_margins = sorted((s[:, 0] - alpha).tolist(), reverse=True)
    assert e1_margins == pytest.approx([0.36, 0.32, 0.06, 0.05, 0.0, 0.0, 0.0, -0.29], abs=1e-12)

    b_hat = qb_exact_update(s, b0, 1, center=False)
    assert b_hat.tolist() == pytest.approx([-0.06, -0.03, 0.10, 0.10], abs=1e-12)
    b1 = qb_exact_update(s, b0, 1)
    assert b1.tolist() == pytest.approx([-0.0875, -0.0575, 0.0725, 0.0725], abs=1e-12)

    idx_new, _ = route_topk_plus_one(s, b1, 1)
    assert torch.bincount(idx_new[:, 0], minlength=4).tolist() == [2, 2, 2, 2]
    idx_old, _ = route_topk_plus_one(s, b0, 1)
    moved = (idx_old[:, 0] != idx_new[:, 0]).nonzero().flatten().tolist()
    assert moved == [2, 3, 6]  # t3 -> E4, t4 -> E4, t7 -> E3: three edges
    assert idx_new[[2, 3, 6], 0].tolist() == [3, 3, 2]


def test_worked_example_histogram() -> None:
    s = torch.tensor(WORKED_SCORES, dtype=torch.float32)
    b0 = torch.zeros(4)
    _, alpha = route_topk_plus_one(s, b0, 1)
    lo, hi = qb_histogram_range(b0)
    assert (float(lo), float(hi)) == (-1.0, 1.0)
    counts = qb_histogram_counts(s, alpha, lo, hi, 1000)
    assert counts.sum(dim=1).tolist() == [8] * 4
    b_hist = qb_histogram_update(counts, lo, hi, 8 * 1 / 4, center=False)
    width = 2.0 / 1000
    assert (b_hist.double() - torch.tensor([-0.06, -0.03, 0.10, 0.10], dtype=torch.float64)).abs().max() <= width
    assert _loads(s, b_hist - b_hist.mean(), 1).tolist() == [2, 2, 2, 2]


def test_non_integer_target() -> None:
    # m=10, n=4, k=1: q = 2.5 -> Q = ceil(q) = 3; b_hat_j is the (Q+1) = 4th smallest r of column j
    g = torch.Generator().manual_seed(1)
    s = torch.rand(10, 4, generator=g, dtype=torch.float64)
    b = torch.zeros(4, dtype=torch.float64)
    assert target_count(10, 4) == 3
    b_hat = qb_exact_update(s, b, 1, center=False)
    _, alpha = route_topk_plus_one(s, b, 1)
    r = alpha[:, None] - s
    # the 4th order statistic of each column (r has ties at 0: the runner-up expert of each token)
    assert ((r < b_hat).sum(0) <= 3).all() and ((r <= b_hat).sum(0) >= 4).all()
    assert torch.isin(b_hat, r).all()


@pytest.mark.parametrize("m,n,k,bins", [(4096, 16, 2, 1000), (1000, 12, 3, 200), (333, 8, 1, 50), (7, 5, 2, 10)])
def test_histogram_within_one_bin_of_exact(m: int, n: int, k: int, bins: int) -> None:
    g = torch.Generator().manual_seed(m + n)
    s = torch.sigmoid(torch.randn(m, n, generator=g) + torch.linspace(-1, 1, n))
    b = torch.randn(n, generator=g) * 0.2
    _, alpha = route_topk_plus_one(s, b, k)
    lo, hi = qb_histogram_range(b)
    counts = qb_histogram_counts(s, alpha, lo, hi, bins)
    width = float(hi - lo) / bins
    exact = qb_exact_update(s, b, k, center=False)
    est = qb_histogram_update(counts, lo, hi, m * k / n, center=False)
    assert (est - exact).abs().max() <= width * (1 + 1e-5)
    centred = qb_histogram_update(counts, lo, hi, m * k / n)
    assert abs(float(centred.mean())) < 1e-6
    assert torch.allclose(centred, est - est.mean(), atol=1e-6)


def test_histogram_counts_add_over_microbatches() -> None:
    g = torch.Generator().manual_seed(2)
    s = torch.rand(300, 6, generator=g)
    b = torch.randn(6, generator=g) * 0.3
    _, alpha = route_topk_plus_one(s, b, 2)
    lo, hi = qb_histogram_range(b)
    whole = qb_histogram_counts(s, alpha, lo, hi, 64)
    parts = qb_histogram_counts(s[:117], alpha[:117], lo, hi, 64) + qb_histogram_counts(s[117:], alpha[117:], lo, hi,
                                                                                         64)
    assert torch.equal(whole, parts)
    assert whole.sum(1).tolist() == [300] * 6


def test_histogram_edges_are_clamped() -> None:
    # saturated sigmoid scores (exactly 0 and 1 in fp32) put r on the ends of [b_min - 1, b_max + 1]
    s = torch.tensor([[1.0, 0.0, 0.0, 0.5], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    b = torch.tensor([0.3, -0.2, 0.0, 0.1])
    _, alpha = route_topk_plus_one(s, b, 1)
    lo, hi = qb_histogram_range(b)
    r = alpha[:, None] - s
    assert (r >= lo - 1e-6).all() and (r <= hi + 1e-6).all()
    counts = qb_histogram_counts(s, alpha, lo, hi, 16)
    assert counts.sum(1).tolist() == [3] * 4
    # values beyond the range (not reachable from real scores) land in the edge bins
    far = qb_histogram_counts(torch.tensor([[5.0, -5.0]]), torch.tensor([0.0]), -1.0, 1.0, 4)
    assert far.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]


def test_empty_step_keeps_bias() -> None:
    b = torch.tensor([0.1, -0.1, 0.0])
    assert torch.equal(qb_exact_update(torch.zeros(0, 3), b, 1), b)
    assert torch.equal(qb_histogram_update(torch.zeros(3, 8, dtype=torch.int32), -1.1, 1.1, 0, bias=b), b)


def test_qb_balances_skewed_scores_where_sign_rule_does_not() -> None:
    # m=4096 tokens, 16 experts with strongly skewed popularity, top-2; the same batch re-routed after each update
    g = torch.Generator().manual_seed(0)
    m, n, k = 4096, 16, 2
    s = torch.sigmoid(torch.linspace(-2.0, 2.0, n) + torch.randn(m, n, generator=g))
    b_qb = torch.zeros(n)
    b_sign = torch.zeros(n)
    assert float(max_violation(_loads(s, b_qb, k))) > 4.0
    for _ in range(5):
        b_qb = qb_exact_update(s, b_qb, k)
        b_sign = sign_update(b_sign, _loads(s, b_sign, k), 1e-3)
    assert float(max_violation(_loads(s, b_qb, k))) < 1.1
    assert float(max_violation(_loads(s, b_sign, k))) > 4.0
    # the histogram path (B = 1000) gets there too
    b_h = torch.zeros(n)
    for _ in range(5):
        _, alpha = route_topk_plus_one(s, b_h, k)
        lo, hi = qb_histogram_range(b_h)
        counts = qb_histogram_counts(s, alpha, lo, hi, 1000)
        b_h = qb_histogram_update(counts, lo, hi, m * k / n, bias=b_h)
    assert float(max_violation(_loads(s, b_h, k))) < 1.1


def test_sign_ema_maxvio() -> None:
    b = torch.zeros(4)
    loads = torch.tensor([10, 0, 5, 5])
    assert sign_update(b, loads, 0.01).tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    assert float(max_violation(loads)) == pytest.approx(2.0)
    assert float(max_violation(torch.zeros(4))) == 0.0
    old, new = torch.tensor([1.0, -1.0]), torch.tensor([0.0, 0.0])
    assert ema_update(old, new, 0.9).tolist() == pytest.approx([0.9, -0.9])
    assert ema_update(old, new, 0.0) is new
    with pytest.raises(ValueError, match="qb_ema"):
        ema_update(old, new, 1.0)
    assert math.isclose(float(max_violation(torch.tensor([3, 3, 3]))), 1.0)
