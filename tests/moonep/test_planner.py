"""Properties of the pure MoonEP planner (hypothesis): conservation, perfect balance, replica bounds,
determinism, the token split, and the tight worst-case lower bound ceil(E(R-1)/R^2)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep.planner import (
    balanced_capacity,
    plan_redundant_experts,
    plan_static,
    redundancy_lower_bound,
    redundancy_upper_bound,
    replica_lower_bound,
    split_tokens,
    worst_case_counts,
    zipf_counts,
)


@st.composite
def instances(draw, max_ranks: int = 8, max_per_rank: int = 6, max_count: int = 60):
    """(counts[E], R): uniform, sparse (mostly zeros) or heavy-tailed counts."""
    R = draw(st.integers(1, max_ranks))
    n = draw(st.integers(1, max_per_rank))
    kind = draw(st.sampled_from(["uniform", "sparse", "heavy"]))
    if kind == "uniform":
        counts = draw(st.lists(st.integers(0, max_count), min_size=R * n, max_size=R * n))
    elif kind == "sparse":
        counts = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, max_count * 5]), min_size=R * n, max_size=R * n))
    else:
        counts = draw(st.lists(st.integers(0, 3), min_size=R * n, max_size=R * n))
        counts = [c ** 6 for c in counts]  # 0, 1, 64, 729
    return np.array(counts, dtype=np.int64), R


def _check_plan(c: np.ndarray, R: int) -> None:
    plan = plan_redundant_experts(c, R)
    E, n = c.size, c.size // R
    # every entry exactly once
    assert (plan.alloc >= 0).all()
    assert np.array_equal(plan.alloc.sum(1), c)
    # perfect balance: each rank computes exactly its capacity; max = ceil(T/R)
    assert np.array_equal(plan.loads_after, balanced_capacity(int(c.sum()), R))
    assert plan.loads_after.max() == -(-int(c.sum()) // R)
    # replicas: at most E/R per rank, all from one home group, consistent with alloc
    for d in range(R):
        foreign = [e for e in range(E) if plan.alloc[e, d] > 0 and e // n != d]
        assert tuple(foreign) == plan.replicas[d]
        assert len(foreign) <= redundancy_upper_bound(E, R)
        assert len({e // n for e in foreign}) <= 1
        if foreign:
            assert plan.home[d] == foreign[0] // n
    # no planner can do with fewer replicas than the certificate
    assert plan.num_replicas.max() >= replica_lower_bound(c, R)
    # deterministic
    again = plan_redundant_experts(c.copy(), R)
    assert np.array_equal(again.alloc, plan.alloc) and again.replicas == plan.replicas


@settings(max_examples=400, deadline=None)
@given(instances())
def test_planner_properties(inst) -> None:
    _check_plan(*inst)


@settings(max_examples=300, deadline=None)
@given(instances())
def test_already_balanced_needs_no_replicas(inst) -> None:
    c, R = inst
    plan = plan_redundant_experts(c, R)
    cap = balanced_capacity(int(c.sum()), R)
    if (plan.loads_before <= cap).all():
        assert plan.num_replicas.sum() == 0 and plan.moved_entries == 0


@settings(max_examples=300, deadline=None)
@given(instances(), st.integers(0, 2**31 - 1))
def test_split_tokens_marginals(inst, seed) -> None:
    c, R = inst
    rng = np.random.default_rng(seed)
    # random per-source decomposition of the counts
    by_src = np.stack([rng.multinomial(int(ce), np.ones(R) / R) for ce in c], axis=1)
    for plan in (plan_redundant_experts(c, R), plan_static(c, R)):
        split = split_tokens(plan, by_src)
        assert (split >= 0).all()
        assert np.array_equal(split.sum(1), by_src)  # every source entry goes somewhere once
        assert np.array_equal(split.sum(0).T, plan.alloc)  # every destination gets its allocation


@pytest.mark.parametrize("E,R", [(8, 2), (8, 4), (16, 4), (64, 8), (60, 6), (256, 16), (896, 64), (24, 8)])
def test_worst_case_lower_bound_is_attained(E: int, R: int) -> None:
    """One rank's experts cold, all others equally hot: any perfectly balancing plan needs ceil(E(R-1)/R^2)
    replicas on the cold rank, and this planner uses exactly that many there (never more than E/R)."""
    c = worst_case_counts(E, R)
    bound = redundancy_lower_bound(E, R)
    assert bound == -(-E * (R - 1) // R**2)
    assert replica_lower_bound(c, R) == bound  # the instance forces it for ANY planner
    plan = plan_redundant_experts(c, R)
    assert plan.num_replicas[0] == bound == plan.num_replicas.max()
    assert bound <= redundancy_upper_bound(E, R)
    # explicit count check: bound - 1 foreign experts cannot carry the cold rank's capacity
    hot = c.max()
    assert (bound - 1) * hot < plan.capacity[0] <= bound * hot


def test_k3_bounds_coincide() -> None:
    assert redundancy_lower_bound(896, 64) == redundancy_upper_bound(896, 64) == 14


@settings(max_examples=400, deadline=None)
@given(instances())
def test_planner_meets_the_worst_case_bound(inst) -> None:
    """With R | T (equal tokens per rank) no instance forces more than ceil(E(R-1)/R^2) replicas (certificate),
    and this planner never uses more: it is worst-case optimal (proof in moonep/planner.py)."""
    c, R = inst
    c = c.copy()
    c[0] += (-int(c.sum())) % R  # make T divisible by R
    bound = redundancy_lower_bound(c.size, R)
    assert replica_lower_bound(c, R) <= bound
    assert plan_redundant_experts(c, R).num_replicas.max() <= bound


@pytest.mark.parametrize("E,R,k,alpha", [(64, 8, 8, 1.2), (896, 64, 16, 1.0)])
def test_zipf_balance(E: int, R: int, k: int, alpha: float) -> None:
    rng = np.random.default_rng(0)
    for _ in range(3):
        c = zipf_counts(E, 64 * R, k, alpha, rng)  # 64 tokens per rank: R | T
        plan = plan_redundant_experts(c, R)
        assert plan.loads_before.max() > 1.2 * plan.loads_before.mean()
        assert plan.loads_after.max() == plan.loads_after.min() == 64 * k
        assert plan.num_replicas.max() <= redundancy_lower_bound(E, R)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        plan_redundant_experts([1, 2, 3], 2)
    with pytest.raises(ValueError, match="negative"):
        plan_redundant_experts([1, -2], 2)
    plan = plan_redundant_experts(np.zeros(8, dtype=np.int64), 4)  # nothing routed
    assert plan.num_replicas.sum() == 0 and plan.loads_after.sum() == 0
