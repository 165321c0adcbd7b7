"""F/B pairing of the pipeline programs (``p2p_programs.pair_programs``, ``parallel.overlap_ep``): every pair is an
F and a B of different micro-batches, adjacent in the paired program; every rank's p2p operations keep their order
(so every rank pair's sequences still agree); the paired programs pass the static checks and run deadlock-free
under ordered (NCCL-like) matching; the steady state is paired."""
from __future__ import annotations

import pytest

from parallel.pipeline.p2p import build_programs, check_programs, run_programs
from parallel.pipeline.p2p_programs import pair_programs
from parallel.pipeline.schedules import build_schedule, deps_of


@pytest.mark.parametrize("name,pp,vpp,m", [("1f1b", 2, 1, 4), ("1f1b", 4, 1, 16), ("interleaved", 2, 2, 4),
                                           ("interleaved", 4, 2, 8), ("interleaved", 8, 4, 32), ("afab", 2, 1, 4)])
def test_pair_programs(name: str, pp: int, vpp: int, m: int) -> None:
    programs = build_programs(build_schedule(name, pp, vpp, m, paired=True), pp, vpp)
    paired, firsts = pair_programs(programs, pp, vpp)
    check_programs(paired, pp, vpp)
    run_programs(paired, pp, vpp, ordered=True)
    for r, (before, after) in enumerate(zip(programs, paired)):
        assert [i for i in before if i.op != "compute"] == [i for i in after if i.op != "compute"], r
        assert sorted(map(str, before)) == sorted(map(str, after)), r
        computes = [i.action for i in after if i.op == "compute"]
        for x in firsts[r]:
            i = next(k for k, ins in enumerate(after) if ins.op == "compute" and ins.action == x)
            y = after[i + 1].action
            assert {x.kind, y.kind} == {"F", "B"} and x.mb != y.mb, (r, x, y)
            posted = {ins.msg for ins in after[:i] if ins.op == "recv"}
            assert set(deps_of(y, r, pp, vpp)) <= posted, (r, x, y)  # y's inputs posted before the pair
        if name != "afab":  # 1F1B steady state: most computes are in a pair
            assert 2 * len(firsts[r]) >= len(computes) // 4, (r, len(firsts[r]), len(computes))
