"""The dispatcher's fast plan + layout (moonep/fast_layout.py) against the readable reference
(``plan_redundant_experts`` / ``plan_static`` + ``build_rank_layout``): identical plans and identical per-rank
index tensors on random, skewed and adversarial routings (experts with zero tokens, ranks with zero tokens, the
worst case of the replica bound), and no host synchronisation beyond the one counts copy."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moonep.fast_layout import counts_to_host, fast_rank_layout, plan_with_takes
from moonep.layout import build_rank_layout, local_route_positions
from moonep.planner import make_plan, worst_case_counts


def _routes(rng: np.random.Generator, R: int, N: list[int], k: int, E: int, kind: str) -> list[torch.Tensor]:
    out = []
    for s in range(R):
        if kind == "uniform":
            p = np.ones(E)
        elif kind == "zipf":
            p = 1.0 / np.arange(1, E + 1) ** 2.0
        else:  # "cold": the first rank's experts (and a few more) never chosen, the rest uneven
            p = rng.random(E) ** 4 + 1e-3
            p[: max(1, E // R)] = 0.0
            p[rng.random(E) < 0.3] = 0.0
            if p.sum() == 0:
                p[-1] = 1.0
        kk = min(k, int((p > 0).sum()))
        g = np.where(p > 0, np.log(np.maximum(p, 1e-300)), -np.inf)[None, :] + rng.gumbel(size=(N[s], E))
        out.append(torch.as_tensor(np.argsort(-g, axis=1)[:, :kk].copy(), dtype=torch.long).reshape(N[s], kk))
    return out


def _same_plan(a, b) -> None:
    assert a.num_experts == b.num_experts and a.num_ranks == b.num_ranks
    for f in ("counts", "capacity", "alloc", "home"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.replicas == b.replicas


def _check(routes: list[torch.Tensor], E: int, R: int, moonep: bool) -> None:
    by_src = np.stack([np.bincount(r.reshape(-1).numpy(), minlength=E) for r in routes])
    ref_plan = make_plan(by_src.sum(0), R, moonep)
    plan, takes = plan_with_takes(by_src.sum(0), R, moonep)
    _same_plan(plan, ref_plan)
    for me in range(R):
        ref = build_rank_layout(ref_plan, by_src, me, routes[me])
        local = local_route_positions(routes[me], E)
        got = fast_rank_layout(plan, takes, by_src, me, local[2])
        assert torch.equal(got.send_order, ref.send_order)
        assert torch.equal(got.recv_perm, ref.recv_perm)
        for f in ("send_splits", "recv_splits", "group_counts", "own_rows", "prefetch_sends", "prefetch_recvs",
                  "cross_rows", "reduce_round"):
            assert getattr(got, f) == getattr(ref, f), f
        assert torch.equal(got.own_offsets(torch.device("cpu")), ref.own_offsets(torch.device("cpu")))
        assert torch.equal(got.replica_offsets(torch.device("cpu")), ref.replica_offsets(torch.device("cpu")))


@settings(max_examples=120, deadline=None)
@given(R=st.integers(1, 6), n=st.integers(1, 4), k=st.integers(1, 4), N=st.lists(st.integers(0, 12), min_size=6,
       max_size=6), kind=st.sampled_from(["uniform", "zipf", "cold"]), moonep=st.booleans(),
       seed=st.integers(0, 10_000))
def test_fast_layout_equals_reference(R, n, k, N, kind, moonep, seed) -> None:
    E = R * n
    _check(_routes(np.random.default_rng(seed), R, N[:R], min(k, E), E, kind), E, R, moonep)


def test_fast_layout_adversarial() -> None:
    rng = np.random.default_rng(0)
    # everything on one expert; a rank with zero tokens; nothing routed at all
    R, n = 4, 3
    E = R * n
    hot = [torch.full((6, 1), 4, dtype=torch.long) for _ in range(R)]
    hot[2] = hot[2][:0]
    _check(hot, E, R, True)
    _check([torch.zeros(0, 2, dtype=torch.long) for _ in range(R)], E, R, True)
    # the worst case of the replica bound: rank 0's experts cold, the others equally hot
    R, n = 8, 4
    E = R * n
    c = worst_case_counts(E, R)
    flat = np.repeat(np.arange(E), c)
    rng.shuffle(flat)
    parts = np.array_split(flat, R)
    _check([torch.as_tensor(p.reshape(-1, 1)) for p in parts], E, R, True)
    # a larger zipf instance with replicas spread over many ranks
    _check(_routes(rng, 16, [32] * 16, 4, 64, "zipf"), 64, 16, True)


class _SyncOps(TorchDispatchMode):
    """Records the aten ops that read a device value on the host (a synchronisation on an accelerator)."""

    SYNCING = ("_local_scalar_dense", "item", "nonzero", "unique", "masked_select", "equal", "bincount",
               "is_nonzero", "repeat_interleave.Tensor")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if any(s in name for s in self.SYNCING):
            # repeat_interleave only syncs without output_size
            if not (name.startswith("aten::repeat_interleave") and (kwargs or {}).get("output_size") is not None):
                self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_layout_builds_without_host_reads() -> None:
    """Everything after :func:`counts_to_host` runs without reading a tensor value on the host."""
    rng = np.random.default_rng(3)
    R, n, E = 8, 4, 32
    routes = _routes(rng, R, [24] * R, 4, E, "zipf")
    gathered = torch.cat([torch.bincount(r.reshape(-1), minlength=E) for r in routes])
    local = local_route_positions(routes[5], E)
    with _SyncOps() as mode:
        by_src = counts_to_host(gathered, R)
        plan, takes = plan_with_takes(by_src.sum(0), R, True)
        lay = fast_rank_layout(plan, takes, by_src, 5, local[2])
    assert plan.num_replicas.sum() > 0 and lay.send_order.numel() == 24 * 4
    assert mode.seen == [], mode.seen
