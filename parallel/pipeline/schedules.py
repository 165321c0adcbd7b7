"""Pipeline schedules as pure data: per pipeline rank, the ordered list of forward/backward actions.

An action ``Action('F'|'B', chunk, mb)`` runs local chunk ``chunk`` of its rank (virtual stage
``Placement.stage(rank, chunk)``, see placement.py) on micro-batch ``mb``. Dependencies (the only ones; p2p
messages are implied by them):

* ``F(v, m)`` needs the activations of ``F(v-1, m)`` (a message from the rank of stage ``v-1``) when ``v > 0``;
* ``B(v, m)`` needs ``F(v, m)`` on the same rank, and the gradients of ``B(v+1, m)`` (a message from the rank of
  stage ``v+1``) unless ``v`` is the last virtual stage.

Schedules (``M`` micro-batches, ``pp`` ranks, ``vpp`` chunks per rank):

* ``afab``: all forwards (chunk-major) then all backwards (reverse chunk order) -- simplest, most memory; debug.
* ``1f1b`` (vpp = 1): rank ``r`` warms up with ``pp - r - 1`` forwards, then alternates one forward / one
  backward, then drains the remaining backwards.
* ``interleaved`` (Megatron's interleaved 1F1B): the ``M * vpp`` virtual micro-batches of a rank are taken in
  groups of ``pp`` micro-batches per chunk (forward: chunks ascending, backward: chunks descending); warm-up is
  ``2 (pp - r - 1) + (vpp - 1) pp`` forwards (all of them when ``M == pp``). Needs ``M % pp == 0``.

Bubble (idle) fraction with equal stages, forward time f and backward b, no communication time:
``(pp - 1) / (vpp * M + pp - 1)`` for 1F1B and interleaved 1F1B (idle time ``(pp-1)(f+b)/vpp`` against ideal
compute ``M (f+b)``); chunk-major AFAB reaches the same bubble but holds the activations of all ``M``
micro-batches. :func:`simulate` measures it for any schedule and stage costs; the tests check it against the
formula.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from k3train.config import ConfigError
from parallel.pipeline.placement import Placement

SCHEDULES = ("afab", "1f1b", "interleaved")


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # 'F' | 'B'
    chunk: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.mb}"


@dataclass(frozen=True, order=True)
class Message:
    """One p2p transfer, named by the boundary it crosses: ``kind='act'``: activations of virtual stage ``stage``
    for stage ``stage + 1``; ``kind='grad'``: their gradients, from stage ``stage + 1`` back to ``stage``."""

    kind: str  # 'act' | 'grad'
    stage: int  # boundary index b: between virtual stages b and b+1
    mb: int


def resolve_schedule(name: str, pp: int, vpp: int) -> str:
    """``parallel.schedule`` -> the schedule actually run ('afab' | '1f1b' | 'interleaved')."""
    if name == "auto":
        return "interleaved" if vpp > 1 else "1f1b"
    if name == "1f1b" and vpp > 1:
        raise ConfigError(f"parallel.schedule: '1f1b' runs one chunk per rank but parallel.vpp = {vpp}; use "
                          "'interleaved' (or 'auto')")
    if name == "interleaved" and vpp == 1:
        return "1f1b"  # the interleaved schedule with one chunk is 1F1B
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.schedule: unknown schedule {name!r} (expected auto, {', '.join(SCHEDULES)})")
    return name


def check_num_microbatches(schedule: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """Raise :class:`ConfigError` when the schedule cannot run ``num_microbatches`` micro-batches."""
    M = num_microbatches
    if M < 1:
        raise ConfigError(f"train.global_batch_size: a step needs at least one micro-batch, got {M}")
    if schedule == "interleaved" and (M % pp != 0 or M < pp):
        raise ConfigError(f"train.global_batch_size: the interleaved pipeline schedule needs the number of "
                          f"micro-batches per step ({M}) to be a positive multiple of parallel.pp = {pp}")


def _one_f_one_b(pp: int, rank: int, M: int) -> list[Action]:
    warmup = min(pp - rank - 1, M)
    acts = [Action("F", 0, m) for m in range(warmup)]
    for i in range(M - warmup):
        acts += [Action("F", 0, warmup + i), Action("B", 0, i)]
    acts += [Action("B", 0, m) for m in range(M - warmup, M)]
    return acts


def _interleaved(pp: int, vpp: int, rank: int, M: int) -> list[Action]:
    total = M * vpp
    group = pp * vpp

    def virtual(k: int, forward: bool) -> Action:
        # the k-th virtual micro-batch of this rank: groups of pp micro-batches per chunk (schedule order, not
        # placement: Action names the local chunk, the Placement maps it to a virtual stage)
        c = (k % group) // pp
        m = (k // group) * pp + k % pp
        return Action("F", c, m) if forward else Action("B", vpp - 1 - c, m)

    warmup = total if M == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    acts = [virtual(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        acts += [virtual(warmup + i, True), virtual(i, False)]
    acts += [virtual(k, False) for k in range(total - warmup, total)]
    return acts


def _afab(vpp: int, M: int) -> list[Action]:
    fwd = [Action("F", c, m) for c in range(vpp) for m in range(M)]
    bwd = [Action("B", c, m) for c in reversed(range(vpp)) for m in range(M)]
    return fwd + bwd


def check_schedule(schedule: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """Every reason :func:`build_schedule` refuses its arguments, without building anything (the planner checks
    millions of layouts): raises :class:`ConfigError`."""
    check_num_microbatches(schedule, pp, vpp, num_microbatches)
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule: unknown schedule {schedule!r}")
    if schedule == "1f1b" and vpp != 1:
        raise ConfigError(f"parallel.schedule: '1f1b' needs vpp = 1, got {vpp}")


def build_schedule(schedule: str, pp: int, vpp: int, num_microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered actions of one training step (``schedule`` as resolved by
    :func:`resolve_schedule`). Pure: no processes, no tensors."""
    check_schedule(schedule, pp, vpp, num_microbatches)
    if schedule == "afab":
        return [_afab(vpp, num_microbatches) for _ in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, r, num_microbatches) for r in range(pp)]
    return [_interleaved(pp, vpp, r, num_microbatches) for r in range(pp)]


def forward_only_schedule(sched: list[list[Action]]) -> list[list[Action]]:
    """The forward actions of ``sched`` in their order on each rank (a forward-only pass, e.g. evaluation).
    Deadlock-free whenever ``sched`` is: forwards depend only on forwards, and the restriction of a feasible
    execution order to the forwards is still feasible."""
    return [[a for a in acts if a.kind == "F"] for acts in sched]


def theoretical_bubble(pp: int, vpp: int, num_microbatches: int) -> float:
    """Idle fraction of the (interleaved) 1F1B pipeline with equal stages: ``(pp-1) / (vpp*M + pp-1)``."""
    return (pp - 1) / (vpp * num_microbatches + pp - 1)


# --------------------------------------------------------------------------------------------------------------
# simulation
# --------------------------------------------------------------------------------------------------------------
def deps_of(a: Action, rank: int, pp: int, vpp: int) -> list[Message]:
    """Messages action ``a`` on ``rank`` must receive before it can run."""
    pl = Placement.of(pp, vpp)
    v = pl.stage(rank, a.chunk)
    if a.kind == "F":
        return [] if pl.is_first(v) else [Message("act", v - 1, a.mb)]
    return [] if pl.is_last(v) else [Message("grad", v, a.mb)]


def produces(a: Action, rank: int, pp: int, vpp: int) -> list[Message]:
    """Messages action ``a`` on ``rank`` sends when it finishes."""
    pl = Placement.of(pp, vpp)
    v = pl.stage(rank, a.chunk)
    if a.kind == "F":
        return [] if pl.is_last(v) else [Message("act", v, a.mb)]
    return [] if pl.is_first(v) else [Message("grad", v - 1, a.mb)]


def message_route(msg: Message, placement: Placement | int) -> tuple[int, int]:
    """``(src_rank, dst_rank)`` of a message (pipeline ranks). ``placement``: the pipeline's
    :class:`Placement` (or, for older callers, its ``pp``: a placement with enough chunks for the boundary)."""
    pl = (placement if isinstance(placement, Placement)
          else Placement.of(placement, msg.stage // placement + 2))
    lo, hi = pl.boundary_ranks(msg.stage)
    return (lo, hi) if msg.kind == "act" else (hi, lo)


@dataclass
class SimResult:
    """Outcome of :func:`simulate`. Times are in the units of the stage costs."""

    start: list[list[float]]  # per rank, per action index
    end: list[list[float]]
    ready: dict[Message, float]  # message -> time its sender finished (+ comm time)
    makespan: float
    busy: list[float] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """Idle fraction: 1 - total busy time / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


def validate_schedule(sched: list[list[Action]], pp: int, vpp: int, M: int) -> None:
    """Every rank runs every (F|B, chunk, mb) exactly once and each backward after its own forward (a schedule
    without any backward, :func:`forward_only_schedule`, runs every forward exactly once)."""
    kinds = "FB" if any(a.kind == "B" for acts in sched for a in acts) else "F"
    want = {Action(k, c, m) for k in kinds for c in range(vpp) for m in range(M)}
    for r, acts in enumerate(sched):
        if len(acts) != len(want) or set(acts) != want:
            missing, extra = want - set(acts), len(acts) - len(set(acts))
            raise ValueError(f"rank {r}: schedule is not a permutation of all actions "
                             f"(missing {sorted(missing)[:4]}, duplicates {extra})")
        pos = {a: i for i, a in enumerate(acts)}
        for c in range(vpp if kinds == "FB" else 0):
            for m in range(M):
                if pos[Action("B", c, m)] < pos[Action("F", c, m)]:
                    raise ValueError(f"rank {r}: B{c}.{m} scheduled before its forward")


def simulate(sched: list[list[Action]], pp: int, vpp: int, f_cost: Iterable[float] | float = 1.0,
             b_cost: Iterable[float] | float = 2.0, comm: float = 0.0) -> SimResult:
    """Run the schedule as soon as dependencies allow (each rank executes its list in order, one action at a
    time). ``f_cost``/``b_cost``: a number or one per virtual stage. Raises RuntimeError on deadlock, naming
    what every blocked rank waits for."""
    placement = Placement.of(pp, vpp)
    n = placement.num_stages
    fc = [float(f_cost)] * n if isinstance(f_cost, (int, float)) else [float(x) for x in f_cost]
    bc = [float(b_cost)] * n if isinstance(b_cost, (int, float)) else [float(x) for x in b_cost]
    M = sum(1 for a in sched[0] if a.kind == "F") // vpp
    validate_schedule(sched, pp, vpp, M)
    start = [[0.0] * len(s) for s in sched]
    end = [[0.0] * len(s) for s in sched]
    ready: dict[Message, float] = {}
    pos, clock = [0] * pp, [0.0] * pp
    remaining = sum(len(s) for s in sched)
    while remaining:
        progress = False
        for r in range(pp):
            while pos[r] < len(sched[r]):
                a = sched[r][pos[r]]
                deps = deps_of(a, r, pp, vpp)
                if any(d not in ready for d in deps):
                    break
                v = placement.stage(r, a.chunk)
                t0 = max([clock[r], *(ready[d] for d in deps)])
                t1 = t0 + (fc[v] if a.kind == "F" else bc[v])
                start[r][pos[r]], end[r][pos[r]] = t0, t1
                for msg in produces(a, r, pp, vpp):
                    if msg in ready:
                        raise RuntimeError(f"message {msg} produced twice")
                    ready[msg] = t1 + comm
                clock[r] = t1
                pos[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            waits = {r: (sched[r][pos[r]], [d for d in deps_of(sched[r][pos[r]], r, pp, vpp) if d not in ready])
                     for r in range(pp) if pos[r] < len(sched[r])}
            raise RuntimeError(f"pipeline schedule deadlocks; blocked ranks (action, missing messages): {waits}")
    busy = [sum(e - s for s, e in zip(start[r], end[r])) for r in range(pp)]
    return SimResult(start=start, end=end, ready=ready, makespan=max(max(e) for e in end if e), busy=busy)
