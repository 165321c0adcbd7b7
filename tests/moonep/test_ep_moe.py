"""EP / MoonEP LatentMoE vs the single-process layer: outputs and EVERY gradient (gloo ranks, fp32, tight).

Each rank feeds its own slice of a global batch; the reference runs the whole batch in one process. Expert
gradients are SUM-reduced over ``edp`` and gathered over ``ep`` before the comparison; dense gradients are
SUM-reduced over ``dp_cp``. Two micro-batches are run forward before either backward, so buffer reuse across
in-flight micro-batches is exercised.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from dist_helpers import run_distributed
from ep_cases import D, E, K, build_moe, clone, skew_router
from moonep import apply_expert_parallel, gather_full_experts, param_reduce_group
from parallel.dims import ParallelDims

T = 12  # tokens per rank per micro-batch
ATOL = 2e-5


def _case(dims: ParallelDims, moonep: bool, skew: bool, seed: int, recompute: bool = False) -> None:
    ref = build_moe(seed)
    if skew:  # every token picks experts 0 and 1, both owned by EP rank 0: other ranks receive nothing
        skew_router(ref, [0, 1])
    ep_moe = clone(ref)
    state = apply_expert_parallel(ep_moe, dims, moonep=moonep)
    run = (lambda x: checkpoint(ep_moe, x, use_reentrant=False)) if recompute else ep_moe
    ws, rank = dims.world_size, dims.rank
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(ws * T, D, generator=g) for _ in range(2)]
    probes = [torch.randn(ws * T, D, generator=g) for _ in range(2)]

    x_ref = [x.clone().requires_grad_() for x in xs]
    loss_ref = sum((ref(x) * p).sum() for x, p in zip(x_ref, probes))
    loss_ref.backward()

    sl = slice(rank * T, (rank + 1) * T)
    x_loc = [x[sl].clone().requires_grad_() for x in xs]
    outs = [run(x) for x in x_loc]  # both forwards before any backward
    plan = ep_moe.dispatcher.last_plan
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, ref(x)[sl].detach(), atol=ATOL, rtol=1e-5)
    loss = sum((out * p[sl]).sum() for out, p in zip(outs, probes))
    loss.backward()
    for x, xr in zip(x_loc, x_ref):
        torch.testing.assert_close(x.grad, xr.grad[sl], atol=ATOL, rtol=1e-5)

    ref_params = dict(ref.named_parameters())
    for name, p in ep_moe.named_parameters():
        if p.grad is None:
            raise AssertionError(f"{name} has no gradient")
        grad = p.grad.clone()
        group = param_reduce_group(name, p, dims)
        if group is not None:
            dist.all_reduce(grad, group=group)
        if name.startswith("experts."):
            continue
        torch.testing.assert_close(grad, ref_params[name].grad, atol=ATOL, rtol=1e-5, msg=name)
    for pname, full in zip(("w_gate", "w_up", "w_down"), gather_full_experts(ep_moe.experts, dims, grads=False)):
        torch.testing.assert_close(full, ref_params[f"experts.{pname}"].detach(), atol=0, rtol=0)
    grads = []
    for pname in ("w_gate", "w_up", "w_down"):
        p = getattr(ep_moe.experts, pname)
        grad = p.grad.clone()
        if dims.group("edp") is not None:
            dist.all_reduce(grad, group=dims.group("edp"))
        grads.append(grad)
    ep_group = dims.group("ep")
    for pname, grad in zip(("w_gate", "w_up", "w_down"), grads):
        parts = [torch.empty_like(grad) for _ in range(dims.ep)]
        dist.all_gather(parts, grad, group=ep_group)
        torch.testing.assert_close(torch.cat(parts), ref_params[f"experts.{pname}"].grad, atol=ATOL, rtol=1e-5,
                                   msg=pname)

    assert state.buffers.grows == 0  # token buffers sized once for the worst case
    assert ep_moe.dispatcher.metrics.count == 2  # one per forward: a recomputed forward is not counted twice
    # the plan of the last micro-batch: perfect balance with MoonEP; the skewed case starves ranks without it
    n_routes = T * K
    if moonep:
        assert plan.loads_after.tolist() == [n_routes] * dims.ep
        assert plan.num_replicas.max() <= E // dims.ep
    if skew:
        assert plan.loads_before[1:].sum() == 0 and plan.loads_before[0] == n_routes * dims.ep
        if not moonep:
            assert plan.loads_after[1:].sum() == 0  # ranks that receive zero tokens still run the step


def _body(rank: int, world_size: int, ep: int) -> None:
    dims = ParallelDims(dp=world_size, ep=ep, world_size=world_size, rank=rank).build_groups()
    for i, (moonep, skew) in enumerate([(True, False), (False, False), (True, True), (False, True)]):
        _case(dims, moonep, skew, seed=10 * i + ep)
    _case(dims, True, False, seed=99, recompute=True)  # activation checkpointing re-runs the collectives


@pytest.mark.parametrize("world_size,ep", [(2, 2), (4, 4), (4, 2)])
def test_ep_latent_moe_matches_single_process(world_size: int, ep: int) -> None:
    run_distributed(_body, world_size, ep)


def _split_body(rank: int, world_size: int) -> None:
    """``parallel.expert_wgrad_split`` on vs off: the same outputs and bit-identical input and parameter gradients
    (the own experts' weight gradients computed while the input gradients' all-to-all travels), with MoonEP
    replicas, with ranks that receive no token, under activation checkpointing and under QAT."""
    from k3train.quant.qat import apply_qat

    dims = ParallelDims(dp=world_size, ep=world_size, world_size=world_size, rank=rank).build_groups()
    cases = [(True, False, False, "none"), (False, True, False, "none"), (True, True, True, "none"),
             (True, False, False, "mxfp4")]
    for i, (moonep, skew, recompute, qat) in enumerate(cases):
        ref = build_moe(40 + i, **({} if qat == "none" else dict(routed_expert_hidden_size=32,
                                                                  moe_intermediate_size=32)))
        if skew:
            skew_router(ref, [0, 1])
        g = torch.Generator().manual_seed(41 + i)
        xs = [torch.randn(T, D, generator=g) for _ in range(2)]
        probes = [torch.randn(T, D, generator=g) for _ in range(2)]
        got = []
        for split in (False, True):
            m = clone(ref)
            apply_expert_parallel(m, dims, moonep=moonep, split_wgrad=split)
            apply_qat([m], qat, "mxfp8" if qat != "none" else "none")
            run = (lambda x, m=m: checkpoint(m, x, use_reentrant=False)) if recompute else m
            x_loc = [x.clone().requires_grad_() for x in xs]
            outs = [run(x) for x in x_loc]
            sum((o * p).sum() for o, p in zip(outs, probes)).backward()
            got.append(([o.detach() for o in outs], [x.grad for x in x_loc],
                        {n: p.grad for n, p in m.named_parameters()}))
        (o0, x0, p0), (o1, x1, p1) = got
        for a, b in zip(o0 + x0, o1 + x1):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
        assert p0.keys() == p1.keys()
        for name in p0:
            torch.testing.assert_close(p1[name], p0[name], atol=0, rtol=0, msg=f"case {i}: {name}")


def test_expert_wgrad_split_is_bit_identical():
    run_distributed(_split_body, 2)
