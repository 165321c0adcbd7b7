"""The collective-trace test utility (``tests/collective_trace.py``): it records what ranks really call, and its
checker rejects traces that would hang or mismatch."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from collective_trace import Event, assert_collectives_match, check_traces, trace_collectives
from dist_helpers import run_distributed


def _ag(group: tuple[int, ...], shape: tuple[int, ...] = (2, 3)) -> Event:
    return Event("all_gather_single", group, sig=(((len(group),) + shape, "float32"), (shape, "float32")))


def test_checker_accepts_matching_and_rejects_mismatched_traces() -> None:
    ar = Event("all_reduce", (0, 1), sig=(((4,), "float32"),))
    assert check_traces([[ar, _ag((0, 1))], [ar, _ag((0, 1))]]) == []
    # a subgroup's collectives are compared among its members only; ranks outside may do anything else
    assert check_traces([[_ag((0, 1))], [_ag((0, 1))], [ar]]) == []
    order = check_traces([[ar, _ag((0, 1))], [_ag((0, 1)), ar]])
    assert order and "collective #0" in order[0]
    missing = check_traces([[ar, _ag((0, 1))], [ar]])  # rank 1 skipped a collective: a hang
    assert missing and "<nothing>" in missing[0]
    shapes = check_traces([[_ag((0, 1), (2, 3))], [_ag((0, 1), (2, 4))]])
    assert shapes and "rank 1" in shapes[0]
    send = Event("isend", (), p2p=[("send", 1, (3,), "float32")])
    recv = Event("irecv", (), p2p=[("recv", 0, (3,), "float32")])
    assert check_traces([[send], [recv]]) == []
    bad = check_traces([[send], [Event("irecv", (), p2p=[("recv", 0, (4,), "float32")])]])
    assert bad and "p2p 0 -> 1" in bad[0]
    assert check_traces([[send], []])  # a send nobody receives


def _body(rank: int, world_size: int) -> None:
    sub = dist.new_group([0, 1])
    with trace_collectives() as trace:
        t = torch.ones(3)
        dist.all_reduce(t)
        if rank < 2:
            out = torch.empty(10, dtype=torch.float64)
            dist.all_gather_single(out, torch.zeros(5, dtype=torch.float64), group=sub)
        recv = torch.empty(2)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world_size),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world_size)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        objs: list = [None] * world_size
        dist.all_gather_object(objs, rank)  # calls other c10d functions inside: recorded once
    assert recv.tolist() == [float((rank - 1) % world_size)] * 2 and objs == list(range(world_size))
    assert [e.op for e in trace.events] == (["all_reduce"] + (["all_gather_single"] if rank < 2 else [])
                                           + ["batch_isend_irecv", "all_gather_object"])
    assert trace.events[0].group == tuple(range(world_size)) and trace.events[0].sig == (((3,), "float32"),)
    if rank < 2:
        assert trace.count("all_gather_single", group=(0, 1)) == 1
        assert trace.events[1].sig == (((10,), "float64"), ((5,), "float64"))
    assert trace.events[-2].p2p == [("send", (rank + 1) % world_size, (2,), "float32"),
                                    ("recv", (rank - 1) % world_size, (2,), "float32")]
    assert dist.all_reduce is not None and "wrapper" not in repr(dist.all_reduce)  # restored after the block
    everyone = assert_collectives_match(trace)
    assert len(everyone) == world_size


def test_trace_records_real_calls_and_matches() -> None:
    run_distributed(_body, 3, timeout=120)


@pytest.mark.parametrize("op", ["all_reduce"])
def test_trace_restores_functions(op: str) -> None:
    before = getattr(dist, op)
    with trace_collectives():
        assert getattr(dist, op) is not before
    assert getattr(dist, op) is before
