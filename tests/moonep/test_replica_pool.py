"""MoonEP's shared replica pool (moonep/replica_pool.py): a stack of MoE layers with several micro-batches in
flight, backwards in pipeline order (not the reverse of the forwards), with and without activation recomputation,
skewed routings with a zero-token rank, against the single-process stack: outputs, every gradient and the
parameters after two SGD steps, fp32 tight. The pool stays two banks whatever the depth and the micro-batches;
every rank makes the same collectives; the graph-mode reference into a bank resolves to another bank."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from ep_cases import D, L, build_moe, skew_router
from k3train.model.moe import grouped_expert_ffn
from moonep import apply_expert_parallel, gather_full_experts, param_reduce_group
from moonep.replica_pool import BankHolder, bank_saved_tensor_hooks
from parallel.dims import ParallelDims

T = 8  # tokens per rank and micro-batch
ATOL = 2e-5


class Stack(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for moe in self.layers:
            x = x + moe(x)
        return x


def _stack(seed: int) -> Stack:
    layers = [build_moe(seed + i) for i in range(3)]
    skew_router(layers[0], [0, 1])  # rank 0's experts only: the other ranks compute only replicas / nothing
    skew_router(layers[2], [2, 5])
    return Stack(layers)


def _run(rank: int, ws: int, recompute: bool) -> None:
    dims = ParallelDims(dp=ws, ep=ws, world_size=ws, rank=rank).build_groups()
    ref = _stack(3)
    model = copy.deepcopy(ref)
    state = apply_expert_parallel(model, dims, moonep=True)
    run = (lambda x: checkpoint(model, x, use_reentrant=False)) if recompute else model
    g = torch.Generator().manual_seed(7)
    sl = slice(rank * T, (rank + 1) * T)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        xs = [torch.randn(ws * T, D, generator=g) for _ in range(3)]
        probes = [torch.randn(ws * T, D, generator=g) for _ in range(3)]
        ref_opt.zero_grad()
        x_ref = [x.clone().requires_grad_() for x in xs]
        sum((ref(x) * p).sum() for x, p in zip(x_ref, probes)).backward()

        opt.zero_grad()
        x_loc = [x[sl].clone().requires_grad_() for x in xs]
        with trace_collectives() as trace:
            outs = [run(x_loc[0]), run(x_loc[1])]  # two micro-batches in flight
            (outs[0] * probes[0][sl]).sum().backward()  # the older one first, as 1F1B does
            with torch.no_grad():
                model.layers[0](x_loc[2][:2])  # a forward without backward in between (shifts the banks)
            outs.append(run(x_loc[2]))
            (outs[2] * probes[2][sl]).sum().backward()
            (outs[1] * probes[1][sl]).sum().backward()
        assert_collectives_match(trace)
        # step 0: identical parameters; step 1: parameters equal up to the rounding of differently ordered
        # gradient sums, which this model (sharp SiTU, RMSNorm on small latents) amplifies ~100x (on a 2-core host
        # without AVX-512, one w_gate element of 1024 differs by 2.1e-4 / 3.4e-4 relative; a wrong replica
        # gradient is off by O(1))
        atol, rtol = (ATOL, 1e-5) if step == 0 else (5e-4, 1e-3)
        for i, out in enumerate(outs):
            torch.testing.assert_close(out, ref(xs[i])[sl].detach(), atol=atol, rtol=rtol, msg=f"output {i}")
            torch.testing.assert_close(x_loc[i].grad, x_ref[i].grad[sl], atol=atol, rtol=rtol)
        ref_p = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.clone()
            group = param_reduce_group(name, p, dims)
            if group is not None:
                dist.all_reduce(grad, group=group)
            if getattr(p, "_k3_expert_parallel", False):
                n = p.shape[0]
                want = ref_p[name].grad[rank * n:(rank + 1) * n]
            else:
                want = ref_p[name].grad
            torch.testing.assert_close(grad, want, atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}")
            p.grad.copy_(grad)  # the summed gradient, so both optimizers take the same step
        ref_opt.step()
        opt.step()
        for name, p in model.named_parameters():  # the same step: parameters agree to rounding
            want = ref_p[name].detach()
            if getattr(p, "_k3_expert_parallel", False):
                want = want[rank * p.shape[0]:(rank + 1) * p.shape[0]]
            torch.testing.assert_close(p.detach(), want, atol=1e-5, rtol=1e-5, msg=name)
    for i, moe in enumerate(model.layers):
        full = gather_full_experts(moe.experts, dims)
        for pname, got in zip(("w_gate", "w_up", "w_down"), full):
            torch.testing.assert_close(got, getattr(ref.layers[i].experts, pname).detach(), atol=1e-5, rtol=1e-5)
    pool = state.pool
    n = model.layers[0].experts.w_gate.shape[0]
    bank = 3 * n * L * model.layers[0].experts.w_gate.shape[2] * 4
    assert pool.nbytes() == 2 * bank  # 3 layers x 3 micro-batches in flight: still two banks
    assert pool.found > 0 and pool.fetches > 0
    if not recompute:  # graph mode: a bank kept since forward or filled ahead serves several backwards
        assert pool.found >= 4, pool.found


def _body(rank: int, ws: int) -> None:
    _run(rank, ws, recompute=False)
    _run(rank, ws, recompute=True)


def test_replica_pool_stack_matches_single_process() -> None:
    run_distributed(_body, 2)


def test_saved_bank_reference_resolves_to_refetched_bank() -> None:
    """The replica graph saved in forward keeps no bank reference: after the bank is overwritten, the backward
    computes with whatever bank ``holder`` points to (here another one holding the same weights)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2, 8, 12, generator=g), torch.randn(2, 8, 12, generator=g), torch.randn(2, 12, 8, generator=g))
    x = torch.randn(10, 8, generator=g)
    offsets = torch.tensor([4, 10], dtype=torch.int32)
    bank_a = tuple(t.clone() for t in w)
    leaves = [t.detach().requires_grad_() for t in bank_a]
    x_leaf = x.clone().requires_grad_()
    holder = BankHolder()
    with bank_saved_tensor_hooks(bank_a, holder):
        y = grouped_expert_ffn(x_leaf, offsets, *leaves)
    for t in bank_a:
        t.fill_(float("nan"))  # the next layer refills the bank
    holder.tensors = tuple(t.clone() for t in w)  # fetched again, into another bank
    probe = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, [x_leaf] + leaves, probe)
    ref_leaves = [t.clone().requires_grad_() for t in w]
    ref_x = x.clone().requires_grad_()
    want = torch.autograd.grad(grouped_expert_ffn(ref_x, offsets, *ref_leaves), [ref_x] + ref_leaves, probe)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
