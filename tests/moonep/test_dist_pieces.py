"""MoonEP communication pieces on gloo ranks, each against a readable reference: the differentiable all-to-all,
replica prefetch and gradient reduce-back, QB statistics sync, DCP checkpoints across ep sizes, metrics."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from ep_cases import D, E, K, build_moe, skew_router
from k3train.model.moe import Router
from k3train.ops.quantile_balancing import qb_exact_update, qb_histogram_range
from moonep import (
    all_to_all_autograd,
    apply_expert_parallel,
    collect_moonep_metrics,
    dcp_state_dict,
    gather_full_experts,
    sync_router_balance,
)
from moonep.grad_reduce import ReduceBack, reduce_back_reference
from moonep.layout import build_rank_layout
from moonep.planner import plan_redundant_experts
from moonep.prefetch import prefetch_reference, start_prefetch
from parallel.dims import ParallelDims


# ------------------------------------------------------------------------------------------------------------
def _a2a_body(rank: int, ws: int) -> None:
    g = torch.Generator().manual_seed(0)
    splits = torch.randint(0, 4, (ws, ws), generator=g)  # splits[s, d] rows from s to d (zeros included)
    xs = [torch.randn(int(splits[s].sum()), 3, generator=g, dtype=torch.float64) for s in range(ws)]
    probe = [torch.randn(int(splits[:, d].sum()), 3, generator=g, dtype=torch.float64) for d in range(ws)]
    x = xs[rank].clone().requires_grad_()
    y = all_to_all_autograd(x, splits[:, rank].tolist(), splits[rank].tolist(), dist.group.WORLD)
    expected = torch.cat([torch.split(xs[s], splits[s].tolist())[rank] for s in range(ws)])
    assert torch.equal(y, expected)
    (y * probe[rank]).sum().backward()
    # reference gradient: the probe rows of each destination that came from this rank
    ref = torch.cat([torch.split(probe[d], splits[:, d].tolist())[rank] for d in range(ws)])
    assert torch.equal(x.grad, ref)




# ------------------------------------------------------------------------------------------------------------
def _prefetch_body(rank: int, ws: int) -> None:
    R, n, lw, fw = ws, 2, 4, 3
    E_ = R * n
    g = torch.Generator().manual_seed(1)
    full = (torch.randn(E_, lw, fw, generator=g), torch.randn(E_, lw, fw, generator=g),
            torch.randn(E_, fw, lw, generator=g))
    routes = [torch.randint(0, 2, (8, 1), generator=g) for _ in range(R)]  # only experts 0, 1: rank 0 is hot
    by_src = np.stack([np.bincount(r.reshape(-1).numpy(), minlength=E_) for r in routes])
    plan = plan_redundant_experts(by_src.sum(0), R)
    assert plan.num_replicas.sum() > 0
    lays = [build_rank_layout(plan, by_src, s, routes[s]) for s in range(R)]
    ranks = list(range(R))
    local = tuple(w[rank * n:(rank + 1) * n].clone() for w in full)
    replicas, handles = start_prefetch(lays[rank], local, dist.group.WORLD, ranks, n)
    for h in handles:
        h.wait()
    for got, want in zip(replicas, prefetch_reference(lays[rank], full, n)):
        assert torch.equal(got, want)
    # reduce-back: per-rank replica grads (deterministic), owners receive and add
    rep_grads = [tuple(torch.randn((n,) + tuple(w.shape[1:]), generator=torch.Generator().manual_seed(100 + s))
                       for w in full) for s in range(R)]
    own = tuple(torch.zeros_like(w) for w in local)
    reduce = ReduceBack(lays[rank], rep_grads[rank], dist.group.WORLD, ranks)
    reduce.start()
    reduce.finish(own, n)  # rank 0 receives from its two hosts in two rounds, at most 2n slots buffered
    assert reduce.num_rounds == [2, 1, 2][rank] and reduce.peak_rows <= 2 * n  # rank 2 sends in round 1
    ref = reduce_back_reference(lays, rep_grads, E_)
    for got, want in zip(own, ref):
        torch.testing.assert_close(got, want[rank * n:(rank + 1) * n], atol=1e-6, rtol=1e-6)


def _comm_body(rank: int, ws: int) -> None:
    _a2a_body(rank, ws)
    _prefetch_body(rank, ws)


def test_all_to_all_autograd_prefetch_and_reduce_back() -> None:
    """One 3-rank spawn (process start-up dominates): the all-to-all, then prefetch + reduce-back."""
    run_distributed(_comm_body, 3)


# ------------------------------------------------------------------------------------------------------------
TOK = 16


def _router_inputs(ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(E, D, generator=g)
    xs = torch.randn(2, ws * TOK, D, generator=g)  # two micro-batches of the global batch
    return w, xs


def _make_router(w: torch.Tensor, estimator: str = "histogram") -> Router:
    r = Router(D, E, K, estimator=estimator, bins=64)
    with torch.no_grad():
        r.weight.copy_(w)
        r.bias.copy_(torch.linspace(-0.1, 0.1, E))  # a non-trivial starting bias
    return r.train()


def _qb_body(rank: int, ws: int) -> None:
    dims = ParallelDims(dp=ws // 2, cp=2, ep=2, world_size=ws, rank=rank).build_groups()
    w, xs = _router_inputs(ws)
    router = _make_router(w)
    for mb in range(2):
        router(xs[mb, rank * TOK:(rank + 1) * TOK])
    bias0 = router.bias.clone()
    metrics = sync_router_balance(router, dims)
    assert metrics["router/stats_elements"] == E * (64 + 1)
    # identical on every rank
    allb = [torch.empty_like(router.bias) for _ in range(ws)]
    dist.all_gather(allb, router.bias)
    assert all(torch.equal(b, router.bias) for b in allb)
    # single process, same global batch: histogram estimator bit-identical, exact estimator within one bin
    ref = _make_router(w)
    exact = _make_router(w, estimator="exact")
    for mb in range(2):
        ref(xs[mb])
        exact(xs[mb])
    ref.balance_step()
    exact.balance_step()
    assert torch.equal(router.bias, ref.bias)
    lo, hi = qb_histogram_range(bias0)
    width = float(hi - lo) / 64
    assert (router.bias - exact.bias).abs().max() <= width + 1e-6
    direct = qb_exact_update(torch.sigmoid(xs.reshape(-1, D) @ w.T), bias0, K)
    torch.testing.assert_close(exact.bias, direct)  # the exact estimator is the spec formula on all tokens




# ------------------------------------------------------------------------------------------------------------
def _dcp_body(rank: int, ws: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    full = build_moe(5)
    with torch.no_grad():
        full.router.bias.copy_(torch.arange(E, dtype=torch.float32))
    dims2 = ParallelDims(dp=ws, ep=2, world_size=ws, rank=rank).build_groups()
    m2 = build_moe(5)
    m2.load_state_dict(full.state_dict())
    st2 = apply_expert_parallel(m2, dims2)
    dcp.save(dcp_state_dict(m2, dims2, st2), checkpoint_id=path)
    # reload into ep = 4 (different shards) from a model with other values
    dims4 = ParallelDims(dp=ws, ep=4, world_size=ws, rank=rank).build_groups()
    m4 = build_moe(99)
    st4 = apply_expert_parallel(m4, dims4)
    sd = dcp_state_dict(m4, dims4, st4)
    dcp.load(sd, checkpoint_id=path)
    for pname, got in zip(("w_gate", "w_up", "w_down"), gather_full_experts(m4.experts, dims4)):
        assert torch.equal(got, getattr(full.experts, pname))
    assert torch.equal(m4.router.bias, full.router.bias)
    assert torch.equal(m4.latent_down.weight, full.latent_down.weight)


def test_dcp_round_trip_across_ep_sizes(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    run_distributed(_dcp_body, 4, str(tmp_path))
    single = build_moe(123)  # ep = 1: one process reads the full tensors
    sd = single.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))
    single.load_state_dict(sd)
    full = build_moe(5)
    for name, p in full.named_parameters():
        assert torch.equal(dict(single.named_parameters())[name], p), name


# ------------------------------------------------------------------------------------------------------------
def _metrics_body(rank: int, ws: int) -> None:
    dims = ParallelDims(dp=ws, ep=ws, world_size=ws, rank=rank).build_groups()
    moe = build_moe(7)
    skew_router(moe, [0, 1])
    apply_expert_parallel(moe, dims, moonep=True)
    x = torch.randn(TOK, D, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        moe(x)
    m = collect_moonep_metrics(moe)
    assert m["moonep/worst_max_over_mean_before"] == ws  # everything on rank 0
    assert m["moonep/worst_max_over_mean_after"] == 1.0
    n = E // ws
    # rank 0's two hot experts are spread over all ranks: weight bytes = replicas * 3 * l * f * 4
    assert m["moonep/replicas"] > 0
    assert m["moonep/weight_bytes"] == m["moonep/replicas"] * 3 * 16 * 16 * 4
    assert m["moonep/root/replicas_max_per_rank"] <= n
    assert m["moonep/token_bytes"] > 0
    assert collect_moonep_metrics(moe) == {}  # reset


def _router_metrics_body(rank: int, ws: int) -> None:
    _qb_body(rank, ws)
    _metrics_body(rank, ws)


def test_qb_sync_matches_single_process_and_metrics() -> None:
    """One 4-rank spawn: QB statistics sync (dp=2 x cp=2, ep=2), then the MoonEP metrics (ep=4)."""
    run_distributed(_router_metrics_body, 4)
