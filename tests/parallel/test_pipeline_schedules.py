"""Pipeline schedules and p2p programs as pure data: simulated in one process, no tensors, no ranks."""
from __future__ import annotations

import pytest

from k3train.config import ConfigError
from parallel.pipeline.p2p import Instr, build_programs, check_programs
from parallel.pipeline.schedules import (Action, build_schedule, resolve_schedule, simulate, theoretical_bubble,
                                         validate_schedule)

CASES = [(pp, vpp, M) for pp in (2, 3, 4) for vpp in (1, 2, 3) for M in (pp, 2 * pp, 3 * pp)]


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("kind,pp,vpp,M", [(k, *c) for k in ("afab", "interleaved", "1f1b") for c in CASES
                                            if k != "1f1b" or c[1] == 1])
def test_schedule_runs_and_programs_match(kind: str, pp: int, vpp: int, M: int, paired: bool) -> None:
    sched = build_schedule(kind, pp, vpp, M, paired)
    validate_schedule(sched, pp, vpp, M)
    sim = simulate(sched, pp, vpp)  # raises on deadlock
    assert sim.makespan > 0
    progs = build_programs(sched, pp, vpp, sim)
    check_programs(progs, pp, vpp)  # send order == recv order per pair, recv before use, send after produce
    for r in range(pp):
        assert [i.action for i in progs[r] if i.op == "compute"] == sched[r]


@pytest.mark.parametrize("pp,vpp,M", CASES)
def test_bubble_matches_formula(pp: int, vpp: int, M: int) -> None:
    """Equal stages (chunk cost 1/vpp forward, 2/vpp backward): idle fraction (pp-1)/(vpp*M + pp-1)."""
    kind = resolve_schedule("auto", pp, vpp)
    sim = simulate(build_schedule(kind, pp, vpp, M), pp, vpp, f_cost=1 / vpp, b_cost=2 / vpp)
    assert sim.bubble == pytest.approx(theoretical_bubble(pp, vpp, M), abs=1e-9)


def test_1f1b_shape() -> None:
    """1F1B on rank r: pp-r-1 warm-up forwards, then alternate, then drain; the last rank strictly alternates."""
    s = build_schedule("1f1b", 4, 1, 6)
    assert [repr(a) for a in s[0][:4]] == ["F0.0", "F0.1", "F0.2", "F0.3"]
    assert [a.kind for a in s[3]] == ["F", "B"] * 6
    # in-flight forwards never exceed pp - r (the 1F1B memory bound)
    for r in range(4):
        live = peak = 0
        for a in s[r]:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(4 - r, 6)


def test_paired_schedule_warms_up_two_forwards_apart() -> None:
    """F/B pairing's schedule (``paired``): the warm-ups of consecutive ranks differ by two forwards (module
    docstring) -- interleaved 1F1B runs one more forward than unpaired before its first backward, 1F1B
    ``2 (pp - r - 1) + 1`` -- capped by the micro-batches, the rest of the order unchanged; AFAB as it was."""
    for kind, pp, vpp, M in (("1f1b", 4, 1, 6), ("1f1b", 4, 1, 3), ("interleaved", 4, 2, 8), ("interleaved", 2, 3, 4),
                             ("interleaved", 2, 2, 2)):
        plain, paired = build_schedule(kind, pp, vpp, M), build_schedule(kind, pp, vpp, M, paired=True)
        for r in range(pp):
            warm = [next(i for i, a in enumerate(s[r]) if a.kind == "B") for s in (plain, paired)]
            total = sum(a.kind == "F" for a in plain[r])
            want = warm[0] + 1 if kind == "interleaved" else 2 * (pp - r - 1) + 2
            assert warm[1] == min(want, total), (kind, pp, vpp, M, r, warm)
            assert [a for a in paired[r] if a.kind == "F"] == [a for a in plain[r] if a.kind == "F"]
            assert [a for a in paired[r] if a.kind == "B"] == [a for a in plain[r] if a.kind == "B"]
    assert build_schedule("afab", 2, 2, 4, paired=True) == build_schedule("afab", 2, 2, 4)


def test_interleaved_order() -> None:
    """Megatron's interleaved order: forward groups of pp micro-batches per chunk, backward chunks reversed."""
    s = build_schedule("interleaved", 2, 2, 4)
    fwd = [repr(a) for a in s[0] if a.kind == "F"]
    bwd = [repr(a) for a in s[0] if a.kind == "B"]
    assert fwd == ["F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "F0.3", "F1.2", "F1.3"]
    assert bwd == ["B1.0", "B1.1", "B0.0", "B0.1", "B1.2", "B1.3", "B0.2", "B0.3"]
    # rank 0 warms up with 2*(pp-1) + (vpp-1)*pp = 4 forwards
    assert [a.kind for a in s[0][:5]] == ["F"] * 5 and s[0][5].kind == "B"


def test_same_neighbour_pp2_many_microbatches() -> None:
    """pp = 2: both neighbours are the same rank; activations and gradients share the pair in both directions."""
    sched = build_schedule("interleaved", 2, 3, 12)
    progs = build_programs(sched, 2, 3)
    check_programs(progs, 2, 3)
    both = {i.msg.kind for i in progs[0] if i.op == "send"}
    assert both == {"act", "grad"}


def test_bad_schedules_are_rejected() -> None:
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 0), Action("B", 0, 0)]]
    with pytest.raises(ValueError, match="before its forward"):
        simulate(bad, 2, 1)
    bad = [[Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)],
           [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]]
    simulate(bad, 2, 1)  # different orders are fine as long as dependencies can be met


def test_deadlock_is_detected() -> None:
    # rank 1 (last stage) insists on B.1 before F.0; rank 0 sends mb 0 first and waits for grad of mb 0 before
    # forwarding mb 1: rank 1 needs act 1 -> never sent.
    cyc = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
           [Action("F", 0, 1), Action("B", 0, 1), Action("F", 0, 0), Action("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(cyc, 2, 1)


def test_microbatch_and_schedule_errors() -> None:
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        build_schedule("interleaved", 4, 2, 6)  # not a multiple of pp
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        build_schedule("interleaved", 4, 2, 0)
    with pytest.raises(ConfigError, match="parallel.schedule"):
        resolve_schedule("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="parallel.schedule"):
        resolve_schedule("gpipe", 2, 1)
    assert resolve_schedule("auto", 2, 2) == "interleaved"
    assert resolve_schedule("interleaved", 2, 1) == "1f1b"
    build_schedule("1f1b", 4, 1, 3)  # fewer micro-batches than stages: allowed (large bubble)


def test_program_instr_repr() -> None:
    assert "compute" in repr(Instr("compute", action=Action("F", 0, 0)))
