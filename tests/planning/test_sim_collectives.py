"""The estimator's simulated collectives: thread-ranks exchange real values; a lone rank gets shapes right."""
from __future__ import annotations

import torch
import torch.distributed as dist

from k3train.planning.fakerun.sim_collectives import SimGroup, run_ranks, simulated_collectives


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


def test_point_to_point_on_a_simulated_group_is_local_and_logged():
    """MoonEP's replica transfers (P2POp batches, isend / irecv) on a SimGroup: sends do nothing, receives are
    zero-filled, every call is logged with the larger of its sent and received bytes (what the planner charges); the real
    P2POp / batch_isend_irecv are back afterwards."""
    g = SimGroup(4, 0, "ep")
    log: list[tuple[int, int]] = []
    orig = (dist.P2POp, dist.batch_isend_irecv, dist.irecv)
    with simulated_collectives(log):
        recv = torch.full((3, 5), 7.0)
        ops = [dist.P2POp(dist.isend, torch.ones(2), 1, group=g, tag=3),
               dist.P2POp(dist.irecv, recv, 2, group=g, tag=4)]
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 2 and all(w.wait() for w in works)
        single = torch.ones(4, dtype=torch.float64)
        dist.irecv(single, 3, group=g).wait()
        dist.isend(torch.ones(6), 1, group=g).wait()
    assert torch.equal(recv, torch.zeros(3, 5)) and torch.equal(single, torch.zeros(4, dtype=torch.float64))
    assert log == [(1, 60), (1, 32), (1, 24)]
    assert (dist.P2POp, dist.batch_isend_irecv, dist.irecv) == orig


def test_moonep_layers_are_timed_through_moonep_and_count_their_p2p():
    """The planner's CPU calibration runs MoonEP layouts through MoonEP's own dispatcher (its host work is in the
    layer times) and records the point-to-point calls it issued per micro-batch; plain EP issues none."""
    from k3train.config import load_config
    from k3train.planning.calibration.layer_bench import bench_layers

    cfg = load_config("configs/tiny.yaml", ["--model.num_hidden_layers=2", "--model.num_nextn_predict_layers=0"])
    moon = bench_layers(cfg, 1, 32, 4, 1, moonep=True)
    plain = bench_layers(cfg, 1, 32, 4, 1, moonep=False)
    assert "p2p_layers" not in plain
    assert len(moon["p2p_layers"]) == 2
    dense, moe = moon["p2p_layers"]  # layer 0 is the dense first layer (first_k_dense_replace: 1)
    assert dense == [0, 0, 0, 0]
    f_calls, f_bytes, b_calls, b_bytes = moe
    assert f_calls >= 1 and f_bytes > 0 and b_calls >= f_calls and b_bytes > 0  # fetch; refetch + reduce-back
