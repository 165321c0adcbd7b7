"""The estimator's simulated collectives: thread-ranks exchange real values; a lone rank gets shapes right."""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3train.planning.sim_collectives import SimGroup, run_ranks, simulated_collectives


def test_thread_ranks_all_gather_real_values_and_lone_rank_shapes():
    def body(g: SimGroup) -> torch.Tensor:
        x = torch.full((2, 3), float(g.rank))
        out = x.new_empty(g.size * x.numel())
        dist.all_gather_single(out, x.reshape(-1), group=g)
        assert dist.get_world_size(g) == g.size and dist.get_rank(g) == g.rank
        return out.view(g.size, 2, 3)

    orig = dist.all_gather_single
    with simulated_collectives():
        outs = run_ranks(3, body)
        lone = SimGroup(4, 2)
        y = torch.arange(8.0)
        piece = y.new_empty(2)
        dist.reduce_scatter_single(piece, y, group=lone)
        work = dist.all_reduce(y, group=lone, async_op=True)
        assert work.wait()
    for o in outs:
        assert torch.equal(o, torch.arange(3.0)[:, None, None].expand(3, 2, 3))
    assert piece.tolist() == [4.0, 5.0]          # this rank's slice of the input
    assert dist.all_gather_single is orig           # torch.distributed restored


def test_a_failing_thread_rank_raises_instead_of_hanging():
    def body(g: SimGroup) -> None:
        if g.rank == 1:
            raise ValueError("rank 1 refuses")
        out = torch.empty(2)
        dist.all_gather_single(out, torch.ones(1), group=g)

    with simulated_collectives():
        try:
            run_ranks(2, body)
        except ValueError as e:
            assert "rank 1 refuses" in str(e)
        else:
            raise AssertionError("no error")
