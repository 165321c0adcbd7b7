"""The per-rank dispatch layout, checked by simulating the all-to-alls in one process (no ranks needed):
every route reaches a rank that computes its expert, in the group of that expert, once; the combine brings each
result back to its route; the prefetch schedule is consistent with the plan."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moonep.layout import build_rank_layout, inverse_permutation
from moonep.planner import make_plan


def _routes(rng: np.random.Generator, R: int, N: int, k: int, E: int, skew: bool) -> list[torch.Tensor]:
    out = []
    for _ in range(R):
        p = np.ones(E)
        if skew:
            p = 1.0 / np.arange(1, E + 1) ** 2.0
        g = np.log(p / p.sum())[None, :] + rng.gumbel(size=(N, E))
        out.append(torch.as_tensor(np.argsort(-g, axis=1)[:, :k].copy(), dtype=torch.long))
    return out


def _simulate(R: int, n: int, k: int, N: int, moonep: bool, skew: bool, seed: int) -> None:
    E = R * n
    rng = np.random.default_rng(seed)
    routes = _routes(rng, R, N, k, E, skew)
    by_src = np.stack([np.bincount(r.reshape(-1).numpy(), minlength=E) for r in routes])
    plan = make_plan(by_src.sum(0), R, moonep)
    lays = [build_rank_layout(plan, by_src, s, routes[s]) for s in range(R)]
    # payload of route (src, flat) = its global id; the "expert" maps payload p of expert e to (p, e)
    payload = [torch.arange(N * k) + 1000 * s for s in range(R)]
    sent = [[None] * R for _ in range(R)]
    for s, lay in enumerate(lays):
        chunks = torch.split(payload[s][lay.send_order], lay.send_splits)
        for d in range(R):
            sent[s][d] = chunks[d]
    results = [torch.empty(0)] * R
    for d, lay in enumerate(lays):
        recv = torch.cat([sent[s][d] for s in range(R)])
        assert [sent[s][d].numel() for s in range(R)] == lay.recv_splits
        sorted_rows = recv[lay.recv_perm]
        assert sorted_rows.numel() == plan.loads_after[d] == sum(lay.group_counts)
        bounds = np.cumsum([0] + lay.group_counts)
        experts_of_group = list(range(d * n, (d + 1) * n)) + list(plan.replicas[d]) + [-1] * (n - len(plan.replicas[d]))
        out = torch.empty_like(sorted_rows)
        for g in range(2 * n):
            rows = sorted_rows[bounds[g]:bounds[g + 1]]
            if rows.numel() == 0:
                continue
            e = experts_of_group[g]
            src, flat = rows // 1000, rows % 1000
            for s_, f_ in zip(src.tolist(), flat.tolist()):
                assert int(routes[s_].reshape(-1)[f_]) == e  # right expert
            assert list(zip(src.tolist(), flat.tolist())) == sorted(zip(src.tolist(), flat.tolist()))  # global order
            assert rows.numel() == plan.alloc[e, d]
            out[bounds[g]:bounds[g + 1]] = rows * 100 + e  # "compute": a function of (route, expert)
        results[d] = out[inverse_permutation(lay.recv_perm)]
    # combine: reverse all-to-all, back to flat route order
    for s, lay in enumerate(lays):
        back = torch.cat([torch.split(results[d], lays[d].recv_splits)[s] for d in range(R)])
        y = torch.empty_like(back).index_copy_(0, lay.send_order, back)
        expected = payload[s] * 100 + routes[s].reshape(-1)
        assert torch.equal(y, expected)
    # prefetch schedule: each replica slot fetched from the owner; every send matched by one receive
    sends = sorted((t.expert, t.src, t.dst, t.slot) for lay in lays for t in lay.prefetch_sends)
    recvs = sorted((t.expert, t.src, t.dst, t.slot) for lay in lays for t in lay.prefetch_recvs)
    assert sends == recvs
    for e, src, dst, slot in recvs:
        assert src == e // n and plan.replicas[dst][slot] == e


@settings(max_examples=60, deadline=None)
@given(R=st.integers(1, 5), n=st.integers(1, 4), k=st.integers(1, 3), N=st.integers(0, 9), moonep=st.booleans(),
       skew=st.booleans(), seed=st.integers(0, 10_000))
def test_layout_routes_every_entry_once(R, n, k, N, moonep, skew, seed) -> None:
    k = min(k, R * n)
    _simulate(R, n, k, N, moonep, skew, seed)
