"""Receives posted one compute ahead (parallel/pipeline/p2p_programs.py) and the placement object: pure logic,
exhaustive over small pipelines (no tensors, no processes)."""
from __future__ import annotations

import pytest

from parallel.pipeline.p2p import Instr, build_programs, check_programs, recv_lead, run_programs
from parallel.pipeline.placement import Placement
from parallel.pipeline.schedules import (Action, Message, build_schedule, deps_of, forward_only_schedule,
                                         message_route, simulate)


def _cases():
    for kind in ("1f1b", "interleaved", "afab"):
        for pp in (2, 3, 4):
            for vpp in (1, 2, 3):
                if kind == "1f1b" and vpp > 1:
                    continue
                for M in range(1, 3 * pp + 2):  # M < pp, M not a multiple of pp, several rounds
                    if kind == "interleaved" and M % pp:
                        continue
                    yield kind, pp, vpp, M


CASES = list(_cases())


def _lead_per_msg(progs: list[list[Instr]], pp: int, vpp: int) -> dict[tuple[int, Message], int]:
    """``(rank, message) ->`` the number of computes between the post of its receive and its consumer."""
    out = {}
    for r, prog in enumerate(progs):
        posted, n = {}, 0
        for ins in prog:
            if ins.op == "recv":
                posted[ins.msg] = n
            elif ins.op == "compute":
                out.update({(r, m): n - posted[m] for m in deps_of(ins.action, r, pp, vpp)})
                n += 1
    return out


def _lead_per_recv(progs: list[list[Instr]], pp: int, vpp: int) -> list[int]:
    return list(_lead_per_msg(progs, pp, vpp).values())


def test_every_order_is_consistent_and_deadlock_free() -> None:
    """Both orders, every schedule, pp 2..4, vpp 1..3, M from 1 to 3 pp + 1 (and the forward-only programs):
    identical pair sequences, receive before use, send after produce, and no deadlock when pair operations
    complete in posting order (NCCL) or by tag (gloo). Posted ahead: every receive at most one compute early."""
    ahead = {k: [0, 0] for k in ("1f1b", "interleaved", "afab")}
    for kind, pp, vpp, M in CASES:
        full = build_schedule(kind, pp, vpp, M)
        for sched in (full, forward_only_schedule(full)):
            sim = simulate(sched, pp, vpp)
            for post_ahead in (False, True):
                progs = build_programs(sched, pp, vpp, sim, post_ahead=post_ahead)
                where = (kind, pp, vpp, M, post_ahead, sched is full)
                assert [[i.action for i in p if i.op == "compute"] for p in progs] == sched, where
                check_programs(progs, pp, vpp)
                run_programs(progs, pp, vpp, ordered=True)
                run_programs(progs, pp, vpp, ordered=False)
                if post_ahead:
                    assert max(_lead_per_recv(progs, pp, vpp), default=0) <= 1, where  # buffers held <= 1 compute
                    if sched is full:
                        a, n = recv_lead(progs, pp, vpp)
                        ahead[kind][0] += a
                        ahead[kind][1] += n
    # what the greedy pair merge reaches over these cases (1F1B's alternating F/B exchanges both directions
    # between the same two computes: one of the two receives cannot be ahead under a shared pair order)
    assert ahead["interleaved"][0] / ahead["interleaved"][1] > 0.95
    assert ahead["afab"][0] / ahead["afab"][1] > 0.95
    assert ahead["1f1b"][0] / ahead["1f1b"][1] > 0.55


@pytest.mark.parametrize("kind,pp,vpp,M", [("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8),
                                           ("interleaved", 8, 4, 32), ("1f1b", 4, 1, 8), ("afab", 3, 2, 5)])
def test_posting_ahead_beats_time_order(kind: str, pp: int, vpp: int, M: int) -> None:
    sched = build_schedule(kind, pp, vpp, M)
    before = recv_lead(build_programs(sched, pp, vpp, post_ahead=False), pp, vpp)
    after = recv_lead(build_programs(sched, pp, vpp), pp, vpp)
    assert before[1] == after[1] and after[0] > before[0]
    if (kind, pp) == ("interleaved", 8):
        assert after[0] == after[1]  # K3's layout: every receive one compute ahead


def test_1f1b_conflict_is_inherent_pp2() -> None:
    """pp=2, 1F1B, M=2: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. Rank 0 would post grad(0) before F1,
    i.e. before its send of act(1); rank 1 act(1) before B0, i.e. before its send of grad(0): the two ends
    would disagree on the pair order, so exactly one of these receives is posted late."""
    sched = build_schedule("1f1b", 2, 1, 2)
    progs = build_programs(sched, 2, 1)
    assert recv_lead(progs, 2, 1) == (2, 3)  # grad(0), grad(1) on rank 0, act(1) on rank 1 (act(0) feeds F0)
    lead = _lead_per_msg(progs, 2, 1)
    assert lead[(0, Message("grad", 0, 1))] == 1
    assert sorted([lead[(0, Message("grad", 0, 0))], lead[(1, Message("act", 0, 1))]]) == [0, 1]


def test_simulator_catches_a_pair_order_deadlock() -> None:
    """Negative control: rank 0 posts the receive of grad(0) before its send of act(0), rank 1 the other way
    round. Tag matching (gloo) copes; ordered pair streams (NCCL) deadlock, and the static check rejects it."""
    g0, a0 = Message("grad", 0, 0), Message("act", 0, 0)
    progs = [[Instr("compute", action=Action("F", 0, 0)), Instr("recv", msg=g0), Instr("send", msg=a0),
              Instr("compute", action=Action("B", 0, 0))],
             [Instr("recv", msg=a0), Instr("compute", action=Action("F", 0, 0)),
              Instr("compute", action=Action("B", 0, 0)), Instr("send", msg=g0)]]
    run_programs(progs, 2, 1, ordered=False)
    with pytest.raises(RuntimeError, match="deadlock"):
        run_programs(progs, 2, 1, ordered=True)
    with pytest.raises(AssertionError, match="pair"):
        check_programs(progs, 2, 1)


def test_simulator_catches_a_missing_send() -> None:
    sched = build_schedule("interleaved", 2, 2, 2)
    progs = build_programs(sched, 2, 2)
    progs[1] = [i for i in progs[1] if not (i.op == "send" and i.msg == Message("act", 1, 0))]
    with pytest.raises(RuntimeError, match="deadlock"):
        run_programs(progs, 2, 2, ordered=False)


def test_placement() -> None:
    pl = Placement(4, 3)
    assert pl.num_stages == 12 and Placement.of(4, 3) == pl
    for v in range(12):
        assert pl.stage(pl.rank_of(v), pl.chunk_of(v)) == v
    assert pl.local_stages(1) == [1, 5, 9]
    assert [pl.prev_local(v) for v in (0, 3, 4, 11)] == [None, None, 0, 7]
    assert [pl.next_local(v) for v in (0, 7, 8, 11)] == [4, 11, None, None]
    assert pl.first_rank == 0 and pl.last_rank == 3 and pl.last_chunk() == 2
    assert pl.boundary_ranks(3) == (3, 0)
    assert message_route(Message("act", 3, 0), pl) == (3, 0) == message_route(Message("act", 3, 0), 4)
    assert message_route(Message("grad", 3, 0), pl) == (0, 3)
    for bad in (lambda: pl.rank_of(12), lambda: pl.stage(4, 0), lambda: pl.stage(0, 3), lambda: Placement(0, 1)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("kind,pp,vpp", [("afab", 4, 2), ("afab", 8, 3), ("afab", 3, 4), ("interleaved", 4, 2),
                                         ("interleaved", 8, 3), ("1f1b", 8, 1)])
def test_many_micro_batches_never_block_a_sender(kind: str, pp: int, vpp: int, paired: bool) -> None:
    """Many micro-batches per step: under AFAB with several chunks the next chunk's inputs are ready while the
    receiver still runs every micro-batch's forward of this chunk; posted one compute before their consumer,
    their sends would not complete within the compute a sender waits (``complete_sends``) and the pipeline
    hung (pp 4, vpp 2, 16 micro-batches: the trainer stopped at its collective timeout). Such a receive is posted
    by the time its send is; every program stays consistent, and deadlock-free under both transports (and under
    F/B pairing, whose pairing runs the ordered model too)."""
    from parallel.pipeline.p2p_programs import pair_programs

    for M in sorted({4 * pp, 6 * pp, 37 if kind != "interleaved" else 5 * pp}):
        progs = build_programs(build_schedule(kind, pp, vpp, M, paired), pp, vpp)
        check_programs(progs, pp, vpp)
        run_programs(progs, pp, vpp, ordered=True)
        run_programs(progs, pp, vpp, ordered=False)
        if paired:
            pair_programs(progs, pp, vpp)
        if kind != "afab":  # where one compute ahead does not deadlock, every receive stays there
            assert max(_lead_per_recv(progs, pp, vpp), default=0) <= 1, (kind, pp, vpp, M)
