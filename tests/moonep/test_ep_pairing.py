"""F/B pairing (``parallel.overlap_ep``, parallel/pairing.py) at the MoE level: two EP LatentMoE layers, three
micro-batches, the forward of micro-batch m+1 on the pair worker (side 1: the ``ep_pair`` group, its own buffers
and replica pool) while the backward of micro-batch m runs on the main thread (side 0) -- against the same
layers run one micro-batch after the other: every output, input gradient and parameter gradient bit-identical.

Edge data inside the pairs: micro-batch 1 has NO tokens on EP rank 1 (it is the forward side of the first pair
and the backward side of the second); the skewed case routes every token to experts 0 and 1 (six experts get
zero tokens; without MoonEP rank 1 computes nothing). Also under activation checkpointing (the backward side
re-runs the forward's collectives, on its own side). The collectives of the paired run are traced: every group --
``ep`` and ``ep_pair`` told apart by name -- sees the same calls in the same order on every rank, and both sides
were used.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from ep_cases import D, build_moe, skew_router
from moonep import apply_expert_parallel
from parallel.dims import ParallelDims
from parallel.pairing import PairExecutor

T, M = 8, 3  # tokens per rank per micro-batch, micro-batches


def _tokens(rank: int, mb: int) -> int:
    return 0 if (mb == 1 and rank == 1) else T  # a rank with no tokens in micro-batch 1


def _case(dims: ParallelDims, pair: PairExecutor, moonep: bool, skew: bool, recompute: bool, seed: int) -> None:
    layers = nn.ModuleList([build_moe(seed), build_moe(seed + 1)])
    if skew:
        for moe in layers:
            skew_router(moe, [0, 1])
    state = apply_expert_parallel(layers, dims, moonep=moonep, paired=True)
    g = torch.Generator().manual_seed(seed + 7)
    xs = [torch.randn(_tokens(dims.rank, m), D, generator=g) for m in range(M)]
    probes = [torch.randn(_tokens(dims.rank, m), D, generator=g) for m in range(M)]

    def layer(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)

    def forward(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = xs[m].clone().requires_grad_()
        h = x + layer(layers[0], x)
        out = h + layer(layers[1], h)
        return x, out, (out * probes[m]).sum()

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.clone() for n, p in layers.named_parameters()}
        layers.zero_grad(set_to_none=True)
        return out

    seq = []  # one micro-batch after the other, side 0 only
    for m in range(M):
        x, out, loss = forward(m)
        loss.backward()
        seq.append((x.grad, out.detach()))
    want = grads()

    paired = [forward(0)]
    with trace_collectives() as trace:
        for m in range(M - 1):
            nxt, _ = pair.run(lambda m=m: forward(m + 1), lambda m=m: paired[m][2].backward(),
                              f"forward of micro-batch {m + 1}", f"backward of micro-batch {m}")
            paired.append(nxt)
        paired[-1][2].backward()
    got = grads()
    assert_collectives_match(trace)  # per group, ep and ep_pair apart: the same calls in the same order
    used = {e.desc for e in trace.events}
    assert {"ep", "ep_pair"} <= used, used
    if moonep:  # the replica weights of each side travel over that side's weight group
        assert {"ep_weights", "ep_weights_pair"} <= used, used
    assert state.pair_side.buffers.nbytes() > 0

    for m, ((x_ref, out_ref), (x, out, _)) in enumerate(zip(seq, paired)):
        assert torch.equal(out.detach(), out_ref), f"micro-batch {m}: output"
        assert torch.equal(x.grad, x_ref), f"micro-batch {m}: input gradient"
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if skew and not moonep:
        plan = layers[1].dispatcher.last_plan
        assert plan.loads_after[1:].sum() == 0  # rank 1 computed nothing, and joined every collective


def _body(rank: int, world_size: int) -> None:
    dims = ParallelDims(dp=world_size, ep=world_size, world_size=world_size, rank=rank).build_groups()
    pair = PairExecutor(rank)
    try:
        for i, (moonep, skew, recompute) in enumerate([(True, False, False), (False, True, False),
                                                       (True, True, True)]):
            _case(dims, pair, moonep, skew, recompute, seed=20 + 10 * i)
    finally:
        pair.close()


def test_paired_ep_moe_bit_identical_with_edge_data() -> None:
    run_distributed(_body, 2)
