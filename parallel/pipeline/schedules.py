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
* ``paired`` (F/B pairing, ``parallel.overlap_ep``: the runner computes a steady-state F and the B after it at the
  same time, parallel/pairing.py): the warm-ups of consecutive ranks must differ by TWO forwards. Rank r's k-th
  pair holds ``B(k)``, which needs rank r+1's ``B(k)`` -- in rank r+1's k-th pair, so rank r's pair k starts when
  rank r+1's pair k ends; and rank r's pair forward ``F(W_r + k)`` is what rank r+1 runs in its pair
  ``k + W_r - W_{r+1}``. With a difference of one, that is rank r+1's next pair, which then waits for the forward
  side of rank r's pair (a pair's forward ends late: it shares the rank with the backward): every pair of every
  rank waits on its neighbour and the step stretches to about ``F + B`` per pair plus that forward side (the
  planner predicted K3 at 4K, pp 32 1F1B, 45.3 s paired against 29.9 s unpaired). With two, rank r's pair k
  feeds rank r+1's pair k+2 and waits for rank r+1's pair k, both finished one pair earlier: no rank waits in
  the steady state. Interleaved 1F1B already warms up ``2 (pp - r - 1)`` (+ ``(vpp - 1) pp``) forwards and takes
  one more (as Megatron's combined 1F1B does: the last rank's pair forward must be of another micro-batch than
  its backward); 1F1B takes ``2 (pp - r - 1) + 1``, holding up to ``2 pp - 1`` micro-batches in flight on rank 0
  instead of ``pp`` (Megatron pairs under pipelining with the interleaved schedule only).

Bubble (idle) fraction with equal stages, forward time f and backward b, no communication time:
``(pp - 1) / (vpp * M + pp - 1)`` for 1F1B and interleaved 1F1B (idle time ``(pp-1)(f+b)/vpp`` against ideal
compute ``M (f+b)``); chunk-major AFAB reaches the same bubble but holds the activations of all ``M``
micro-batches. :func:`simulate` measures it for any schedule and stage costs; the tests check it against the
formula.

Vision encoder actions (``parallel.encoder_schedule``, a vision model at pp > 1): ``Action('EF', 0, m)`` runs the
encoder (MoonViT + projector) on micro-batch ``m``'s media, ``Action('EB', 0, m)`` its backward. They live only on
the rank of virtual stage 0 (``Placement.first_rank``), need no messages, and are ordered locally: ``EF(m)`` before
``F(0, m)`` (whose embedding takes its output), ``EB(m)`` after ``B(0, m)`` (which produces the output's
gradient). :func:`place_encoder` inserts them into an F/B schedule: ``before`` (all encoder forwards, then the
pipeline, then all encoder backwards: the baseline) or ``bubbles`` (where they lengthen the step least: the first
micro-batch's encoder forward necessarily before the pipeline starts, the others mostly in the first rank's idle
time and slack; backward symmetric). The p2p programs are built from the F/B schedule alone and the encoder
computes inserted afterwards (p2p_programs.py), so every rank pair's p2p sequence is that of the F/B schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from k3train.config import ConfigError
from parallel.pipeline.placement import Placement

SCHEDULES = ("afab", "1f1b", "interleaved")


ENCODER_KINDS = ("EF", "EB")  # vision encoder forward / backward (module docstring)
ENCODER_SCHEDULES = ("bubbles", "before", "inline")  # parallel.encoder_schedule


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # 'F' | 'B' | 'EF' | 'EB' (encoder actions: chunk 0, first rank only)
    chunk: int
    mb: int

    @property
    def is_encoder(self) -> bool:
        return self.kind in ENCODER_KINDS

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


def one_f_one_b_warmup(pp: int, rank: int, M: int, paired: bool = False) -> int:
    """The forwards 1F1B runs on ``rank`` before its steady state (module docstring; ``paired``: F/B pairing's)."""
    return min(2 * (pp - rank - 1) + 1 if paired else pp - rank - 1, M)


def _one_f_one_b(pp: int, rank: int, M: int, paired: bool = False) -> list[Action]:
    warmup = one_f_one_b_warmup(pp, rank, M, paired)
    acts = [Action("F", 0, m) for m in range(warmup)]
    for i in range(M - warmup):
        acts += [Action("F", 0, warmup + i), Action("B", 0, i)]
    acts += [Action("B", 0, m) for m in range(M - warmup, M)]
    return acts


def _virtual(pp: int, vpp: int, k: int, forward: bool) -> Action:
    """The interleaved schedule's k-th virtual micro-batch of a rank: groups of pp micro-batches per chunk
    (schedule order, not placement: Action names the local chunk, the Placement maps it to a virtual stage)."""
    group = pp * vpp
    c = (k % group) // pp
    m = (k // group) * pp + k % pp
    return Action("F", c, m) if forward else Action("B", vpp - 1 - c, m)


def _interleaved_warmup(pp: int, vpp: int, rank: int, M: int, paired: bool = False) -> int:
    total = M * vpp
    return total if M == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp + int(paired), total)


def interleaved_prefix(pp: int, vpp: int, rank: int, M: int, paired: bool = False) -> list[int]:
    """The local chunks of the interleaved schedule's forwards on ``rank`` before its first backward, then that
    backward's chunk (what :func:`_interleaved` runs first, without building the rest)."""
    warmup = _interleaved_warmup(pp, vpp, rank, M, paired)
    n_fwd = warmup + (1 if warmup < M * vpp else 0)
    return [_virtual(pp, vpp, k, True).chunk for k in range(n_fwd)] + [_virtual(pp, vpp, 0, False).chunk]


def _interleaved(pp: int, vpp: int, rank: int, M: int, paired: bool = False) -> list[Action]:
    total = M * vpp

    def virtual(k: int, forward: bool) -> Action:
        return _virtual(pp, vpp, k, forward)

    warmup = _interleaved_warmup(pp, vpp, rank, M, paired)
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


def build_schedule(schedule: str, pp: int, vpp: int, num_microbatches: int,
                   paired: bool = False) -> list[list[Action]]:
    """Per pipeline rank, the ordered actions of one training step (``schedule`` as resolved by
    :func:`resolve_schedule`). ``paired``: the schedule F/B pairing runs (module docstring: warm-ups two forwards
    apart). Pure: no processes, no tensors."""
    check_schedule(schedule, pp, vpp, num_microbatches)
    if schedule == "afab":
        return [_afab(vpp, num_microbatches) for _ in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(pp, r, num_microbatches, paired) for r in range(pp)]
    return [_interleaved(pp, vpp, r, num_microbatches, paired) for r in range(pp)]


def forward_only_schedule(sched: list[list[Action]]) -> list[list[Action]]:
    """The forward actions of ``sched`` (encoder forwards included) in their order on each rank (a forward-only
    pass, e.g. evaluation). Deadlock-free whenever ``sched`` is: forwards depend only on forwards, and the
    restriction of a feasible execution order to the forwards is still feasible."""
    return [[a for a in acts if a.kind in ("F", "EF")] for acts in sched]


def strip_encoder(sched: list[list[Action]]) -> list[list[Action]]:
    """``sched`` without its encoder actions (the F/B schedule the p2p programs are built from)."""
    return [[a for a in acts if not a.is_encoder] for acts in sched]


def theoretical_bubble(pp: int, vpp: int, num_microbatches: int) -> float:
    """Idle fraction of the (interleaved) 1F1B pipeline with equal stages: ``(pp-1) / (vpp*M + pp-1)``."""
    return (pp - 1) / (vpp * num_microbatches + pp - 1)


# --------------------------------------------------------------------------------------------------------------
# simulation
# --------------------------------------------------------------------------------------------------------------
def deps_of(a: Action, rank: int, pp: int, vpp: int) -> list[Message]:
    """Messages action ``a`` on ``rank`` must receive before it can run."""
    if a.is_encoder:
        return []  # local only: ordered after/before its stage-0 action on the same rank
    pl = Placement.of(pp, vpp)
    v = pl.stage(rank, a.chunk)
    if a.kind == "F":
        return [] if pl.is_first(v) else [Message("act", v - 1, a.mb)]
    return [] if pl.is_last(v) else [Message("grad", v, a.mb)]


def produces(a: Action, rank: int, pp: int, vpp: int) -> list[Message]:
    """Messages action ``a`` on ``rank`` sends when it finishes."""
    if a.is_encoder:
        return []
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
    without any backward, :func:`forward_only_schedule`, runs every forward exactly once). Encoder actions, when
    the first rank has any: only there, every ``EF(m)`` (and ``EB(m)`` when there are backwards) exactly once,
    ``EF(m)`` before ``F(0, m)`` and ``EB(m)`` after ``B(0, m)``."""
    kinds = "FB" if any(a.kind == "B" for acts in sched for a in acts) else "F"
    want = {Action(k, c, m) for k in kinds for c in range(vpp) for m in range(M)}
    pl = Placement.of(pp, vpp)
    first, c0 = pl.first_rank, pl.chunk_of(0)
    has_enc = any(a.is_encoder for a in sched[first])
    enc_want = {Action("E" + k, 0, m) for k in kinds for m in range(M)} if has_enc else set()
    for r, acts in enumerate(sched):
        if r != first and any(a.is_encoder for a in acts):
            raise ValueError(f"rank {r}: encoder actions belong to the first stage's rank {first} only")
        w = want | enc_want if r == first else want
        if len(acts) != len(w) or set(acts) != w:
            missing, extra = w - set(acts), len(acts) - len(set(acts))
            raise ValueError(f"rank {r}: schedule is not a permutation of all actions "
                             f"(missing {sorted(missing)[:4]}, duplicates {extra})")
        pos = {a: i for i, a in enumerate(acts)}
        for c in range(vpp if kinds == "FB" else 0):
            for m in range(M):
                if pos[Action("B", c, m)] < pos[Action("F", c, m)]:
                    raise ValueError(f"rank {r}: B{c}.{m} scheduled before its forward")
        if r == first and has_enc:
            for m in range(M):
                if pos[Action("EF", 0, m)] > pos[Action("F", c0, m)]:
                    raise ValueError(f"rank {r}: EF0.{m} scheduled after F{c0}.{m}, which embeds its output")
                if kinds == "FB" and pos[Action("EB", 0, m)] < pos[Action("B", c0, m)]:
                    raise ValueError(f"rank {r}: EB0.{m} scheduled before B{c0}.{m}, which produces its gradient")


def _per_mb(x: Iterable[float] | float, M: int, what: str) -> list[float]:
    if isinstance(x, (int, float)):
        return [float(x)] * M
    out = [float(v) for v in x]
    if len(out) != M:
        raise ValueError(f"{what}: {len(out)} costs for {M} micro-batches")
    return out


def simulate(sched: list[list[Action]], pp: int, vpp: int, f_cost: Iterable[float] | float = 1.0,
             b_cost: Iterable[float] | float = 2.0, comm: float = 0.0, enc_f_cost: Iterable[float] | float = 0.0,
             enc_b_cost: Iterable[float] | float = 0.0, durations: list[list[float]] | None = None) -> SimResult:
    """Run the schedule as soon as dependencies allow (each rank executes its list in order, one action at a
    time). ``f_cost``/``b_cost``: a number or one per virtual stage; ``enc_f_cost``/``enc_b_cost``: the cost of
    the encoder actions ``EF``/``EB``, a number or one per micro-batch (their media differ); ``durations``: per
    rank, per action, instead of all of these (e.g. measured times replayed). Raises RuntimeError on deadlock,
    naming what every blocked rank waits for."""
    placement = Placement.of(pp, vpp)
    n = placement.num_stages
    fc = [float(f_cost)] * n if isinstance(f_cost, (int, float)) else [float(x) for x in f_cost]
    bc = [float(b_cost)] * n if isinstance(b_cost, (int, float)) else [float(x) for x in b_cost]
    M = sum(1 for a in sched[0] if a.kind == "F") // vpp
    validate_schedule(sched, pp, vpp, M)
    ec = {"EF": _per_mb(enc_f_cost, M, "enc_f_cost"), "EB": _per_mb(enc_b_cost, M, "enc_b_cost")}
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
                t0 = max([clock[r], *(ready[d] for d in deps)])
                if durations is not None:
                    t1 = t0 + float(durations[r][pos[r]])
                elif a.is_encoder:
                    t1 = t0 + ec[a.kind][a.mb]
                else:
                    v = placement.stage(r, a.chunk)
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


# --------------------------------------------------------------------------------------------------------------
# vision encoder actions
# --------------------------------------------------------------------------------------------------------------
def place_encoder(sched: list[list[Action]], pp: int, vpp: int, f_cost: Iterable[float] | float,
                  b_cost: Iterable[float] | float, enc_f_cost: Iterable[float] | float,
                  enc_b_cost: Iterable[float] | float, mode: str = "bubbles", comm: float = 0.0) -> list[list[Action]]:
    """``sched`` (an F/B schedule, or a forward-only one) with the encoder actions of every micro-batch inserted
    on the first rank (module docstring). Pure and deterministic: the result depends only on the arguments, so
    ranks that must run the same order (the first stage's cp group, which shares the media) compute it alike
    from static costs; never pass measured times.

    ``f_cost``/``b_cost``: per virtual stage (as :func:`simulate`), ``enc_f_cost``/``enc_b_cost``: per
    micro-batch, in the same units. ``mode``: ``inline`` returns the F/B schedule (the encoder runs inside
    ``F(0, m)``); ``before``: every ``EF`` first, then the pipeline, then every ``EB``; ``bubbles``: greedy, one
    encoder action at a time (forwards by micro-batch, then backwards from the last micro-batch down, the most
    constrained first) at the position of the first rank's action list that lengthens the simulated step least
    -- exactly, by the critical path: an action of cost ``c`` put before action ``q`` delays ``q`` by
    ``max(0, end(q-1) + c - start(q))``, which lengthens the step by what exceeds ``q``'s total float -- ties
    going to the position nearest its stage-0 action (the encoder's activations live shorter). The result is the
    best of that, ``before`` and the ``inline`` order (each EF right before its F, each EB right after its B) by
    simulated makespan, so it is never worse than either."""
    if mode not in ENCODER_SCHEDULES:
        raise ValueError(f"encoder schedule must be one of {', '.join(ENCODER_SCHEDULES)}, got {mode!r}")
    base = strip_encoder(sched)
    if mode == "inline":
        return base
    f_cost, b_cost = (c if isinstance(c, (int, float)) else [float(x) for x in c] for c in (f_cost, b_cost))
    pl = Placement.of(pp, vpp)
    r0, c0 = pl.first_rank, pl.chunk_of(0)
    M = sum(1 for a in base[0] if a.kind == "F") // vpp
    backward = any(a.kind == "B" for acts in base for a in acts)
    ef, eb = _per_mb(enc_f_cost, M, "enc_f_cost"), _per_mb(enc_b_cost, M, "enc_b_cost")
    chain = base[r0]

    def with_slots(slots: list[list[Action]]) -> list[list[Action]]:
        acts: list[Action] = []
        for q, a in enumerate(chain):
            acts += slots[q] + [a]
        out = list(base)
        out[r0] = acts + slots[len(chain)]
        return out

    def by_slot(pick: Callable[[Action], int]) -> list[list[Action]]:
        slots: list[list[Action]] = [[] for _ in range(len(chain) + 1)]
        for m in range(M):
            slots[pick(Action("EF", 0, m))].append(Action("EF", 0, m))
            if backward:
                slots[pick(Action("EB", 0, m))].append(Action("EB", 0, m))
        return with_slots([sorted(s, key=_slot_order) for s in slots])

    idx = {a: i for i, a in enumerate(chain)}
    before = by_slot(lambda e: 0 if e.kind == "EF" else len(chain))
    if mode == "before":
        return before
    inline = by_slot(lambda e: idx[Action("F", c0, e.mb)] if e.kind == "EF" else idx[Action("B", c0, e.mb)] + 1)
    greedy = with_slots(_greedy_slots(base, pp, vpp, f_cost, b_cost, ef, eb, comm, backward))
    costs = dict(f_cost=f_cost, b_cost=b_cost, comm=comm, enc_f_cost=ef, enc_b_cost=eb)
    spans = [simulate(s, pp, vpp, **costs).makespan for s in (greedy, before, inline)]
    return (greedy, before, inline)[spans.index(min(spans))]


def _slot_order(a: Action) -> tuple[int, int]:
    """Order of encoder actions sharing one gap: backwards first (they free memory), then forwards."""
    return (0 if a.kind == "EB" else 1, a.mb)


def _greedy_slots(base: list[list[Action]], pp: int, vpp: int, f_cost: Any, b_cost: Any, ef: list[float],
                  eb: list[float], comm: float, backward: bool) -> list[list[Action]]:
    """The ``bubbles`` placement of :func:`place_encoder`: per gap ``q`` of the first rank's action list (before
    its action ``q``; ``q = len``: after the last), the encoder actions put there."""
    pl = Placement.of(pp, vpp)
    r0, c0 = pl.first_rank, pl.chunk_of(0)
    n = pl.num_stages
    fc = [float(f_cost)] * n if isinstance(f_cost, (int, float)) else [float(x) for x in f_cost]
    bc = [float(b_cost)] * n if isinstance(b_cost, (int, float)) else [float(x) for x in b_cost]
    dur = [[fc[pl.stage(r, a.chunk)] if a.kind == "F" else bc[pl.stage(r, a.chunk)] for a in acts]
           for r, acts in enumerate(base)]
    producer = {m: (r, i) for r, acts in enumerate(base) for i, a in enumerate(acts) for m in produces(a, r, pp, vpp)}
    preds = [[[producer[m] for m in deps_of(a, r, pp, vpp)] for a in acts] for r, acts in enumerate(base)]
    succs: list[list[list[tuple[int, int]]]] = [[[] for _ in acts] for acts in base]
    for r, acts in enumerate(base):
        for i in range(len(acts)):
            for pr, pi in preds[r][i]:
                succs[pr][pi].append((r, i))
    topo = _topological_order(base, preds)
    chain = base[r0]
    n0 = len(chain)
    slots: list[list[tuple[Action, float]]] = [[] for _ in range(n0 + 1)]

    def critical_path() -> tuple[list[float], list[float], list[float], float]:
        """(start, float, clock before each first-rank action (encoder actions of its gap included), makespan)."""
        es = [[0.0] * len(acts) for acts in base]
        end = [[0.0] * len(acts) for acts in base]
        clock, before_q = [0.0] * pp, [0.0] * (n0 + 1)
        for r, i in topo:
            if r == r0:
                clock[r0] += sum(c for _, c in slots[i])
                before_q[i] = clock[r0]
            t0 = max([clock[r], *(end[pr][pi] + comm for pr, pi in preds[r][i])])
            es[r][i], end[r][i] = t0, t0 + dur[r][i]
            clock[r] = end[r][i]
        clock[r0] += sum(c for _, c in slots[n0])
        before_q[n0] = clock[r0]
        span = max(clock)
        ls = [[0.0] * len(acts) for acts in base]
        nxt = [span] * pp
        nxt[r0] = span - sum(c for _, c in slots[n0])
        for r, i in reversed(topo):
            lf = min([nxt[r], *(ls[sr][si] - comm for sr, si in succs[r][i])])
            ls[r][i] = lf - dur[r][i]
            nxt[r] = ls[r][i] - (sum(c for _, c in slots[i]) if r == r0 else 0.0)
        return es[r0], [ls[r0][i] - es[r0][i] for i in range(n0)], before_q, span

    idx = {a: i for i, a in enumerate(chain)}
    todo = [(Action("EF", 0, m), ef[m]) for m in range(len(ef))]
    todo += [(Action("EB", 0, m), eb[m]) for m in reversed(range(len(eb)))] if backward else []
    for a, c in todo:
        es, fl, before_q, span = critical_path()
        if a.kind == "EF":
            cand = range(idx[Action("F", c0, a.mb)], -1, -1)  # nearest to F(0, m) first
        else:
            cand = range(idx[Action("B", c0, a.mb)] + 1, n0 + 1)  # nearest to B(0, m) first
        tol = 1e-9 * max(1.0, abs(span))
        best_q, best = -1, float("inf")
        for q in cand:
            grow = (max(0.0, before_q[q] + c - es[q] - fl[q]) if q < n0
                    else max(0.0, before_q[n0] + c - span))
            if grow < best - tol:
                best_q, best = q, grow
        slots[best_q].append((a, c))
    return [sorted((a for a, _ in s), key=_slot_order) for s in slots]


def _topological_order(base: list[list[Action]], preds: list[list[list[tuple[int, int]]]]) -> list[tuple[int, int]]:
    """The (rank, index) of every action in an order where each comes after its predecessors (the previous action
    on its rank and the producers of its messages): the order :func:`simulate`'s sweep runs them in."""
    pos, out, total = [0] * len(base), [], sum(len(a) for a in base)
    done: set[tuple[int, int]] = set()
    while len(out) < total:
        moved = False
        for r, acts in enumerate(base):
            while pos[r] < len(acts) and all(p in done for p in preds[r][pos[r]]):
                done.add((r, pos[r]))
                out.append((r, pos[r]))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule deadlocks (no topological order)")
    return out
