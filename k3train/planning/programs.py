"""Each pipeline rank's program as the runtime executes it, shared by the memory estimate and the step-time model:
built from the schedule, paired under F/B pairing as the runner pairs it, and the forwards a rank runs before its
first backward (the static memory bound's and the estimate's in-flight micro-batches)."""
from __future__ import annotations

from typing import Any

from parallel.pipeline.p2p import Instr, build_programs
from parallel.pipeline.p2p_programs import pair_programs
from parallel.pipeline.schedules import Action, build_schedule, interleaved_prefix, one_f_one_b_warmup


def pairs_actions(cfg: Any) -> bool:
    """Whether the runtime pairs computes in this layout (``Config.ep_overlap``: its one rule)."""
    return cfg.ep_overlap()[0]


def single_program(M: int) -> list[Any]:
    """The one rank's program without a pipeline: every micro-batch's forward, then its backward."""
    return [Instr("compute", action=Action(k, 0, m)) for m in range(M) for k in "FB"]


def rank_programs(schedule: str, pp: int, vpp: int, M: int, paired: bool = False) -> list[list[Any]]:
    """Every pipeline rank's program (``parallel.pipeline.p2p.build_programs``) of the resolved ``schedule`` with
    ``M`` micro-batches (``paired``: F/B pairing's schedule)."""
    return build_programs(build_schedule(schedule, pp, vpp, M, paired), pp, vpp)


def forwards_before_first_backward(schedule: str, pp: int, vpp: int, num_microbatches: int,
                                   paired: bool = False) -> list[list[int]]:
    """Per pipeline rank, the local chunks of the forwards it runs before its first backward, then that backward's
    chunk last: the prefix of :func:`parallel.pipeline.schedules.build_schedule`'s action list up to the first
    backward (``schedule`` 'none': one rank, one forward; ``paired``: the schedule of F/B pairing). Only that
    prefix is built (the planner asks for thousands of (pp, vpp, micro-batches))."""
    M = num_microbatches
    if pp == 1 or schedule == "none":
        return [[0, 0]]
    if schedule == "afab":
        return [[c for c in range(vpp) for _ in range(M)] + [vpp - 1]] * pp
    if schedule == "1f1b":
        return [[0] * min(one_f_one_b_warmup(pp, r, M, paired) + 1, M) + [0] for r in range(pp)]
    return [interleaved_prefix(pp, vpp, r, M, paired) for r in range(pp)]


def paired_programs(cfg: Any, programs: list[list[Any]], pp: int, vpp: int
                    ) -> tuple[list[list[Any]], list[Any]]:
    """``(programs, firsts)`` the runner executes: under F/B pairing (``cfg.ep_overlap()``) the paired programs
    (pp > 1: ``p2p_programs.pair_programs``; pp = 1: LocalRunner's F(0), then F(m+1) with B(m), then B(M-1))
    and per rank ``{first compute of each pair: its trailing-post count}``; else ``programs`` and no pairs."""
    if not pairs_actions(cfg):
        return programs, [{} for _ in programs]
    if pp > 1:
        return pair_programs(programs, pp, vpp)
    M = sum(1 for ins in programs[0] if ins.op == "compute") // 2
    order = [Action("F", 0, 0)] + [x for m in range(M - 1) for x in (Action("F", 0, m + 1), Action("B", 0, m))]
    order.append(Action("B", 0, M - 1))
    return [[Instr("compute", action=a) for a in order]], [{Action("F", 0, m + 1): 0 for m in range(M - 1)}]


_PAIRED: dict[int, tuple[Any, Any]] = {}


def cached_pair_programs(programs: list[list[Any]], pp: int, vpp: int) -> tuple[list[list[Any]], list[dict]]:
    """:func:`parallel.pipeline.p2p_programs.pair_programs` of ``programs`` (memoised per programs object),
    what the runner executes under ``parallel.overlap_ep``."""
    if id(programs) not in _PAIRED or _PAIRED[id(programs)][0] is not programs:
        _PAIRED[id(programs)] = (programs, pair_programs(programs, pp, vpp))
    return _PAIRED[id(programs)][1]
