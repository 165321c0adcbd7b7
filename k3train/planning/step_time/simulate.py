"""The schedule: every pipeline rank's real program executed event by event (module docstring of
:mod:`k3train.planning.step_time`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from k3train.planning.step_time.costs import ActionCosts
from k3train.planning.step_time.pairing import pair_side_ends
from parallel.pipeline.schedules import deps_of


@dataclass
class SimOut:
    makespan: float
    end: list[float]                     # per rank: its last compute's end
    busy_compute: list[float]            # elapsed seconds computing
    busy_comm: list[float]               # elapsed seconds in in-action communication
    chunk_done: list[dict[int, float]]   # per rank: chunk -> end of its last backward


_PRE: dict[int, tuple[Any, list]] = {}


def _precompiled(programs: list[list[Any]], pp: int, vpp: int) -> list[list[tuple]]:
    """Per rank, the program as ``('recv',) | ('send', msg, dst) | ('comp', action, virtual stage, deps)``
    (memoised per programs object: the planner reuses one per schedule, pp, vpp and micro-batch count)."""
    key = id(programs)
    if key not in _PRE or _PRE[key][0] is not programs:
        out = []
        for r, prog in enumerate(programs):
            rows: list[tuple] = []
            for ins in prog:
                if ins.op == "recv":
                    rows.append(("recv",))
                elif ins.op == "send":
                    m = ins.msg
                    rows.append(("send", m, (m.stage + 1) % pp if m.kind == "act" else m.stage % pp))
                else:
                    a = ins.action
                    rows.append(("comp", a, a.chunk * pp + r, tuple(deps_of(a, r, pp, vpp))))
            out.append(rows)
        _PRE[key] = (programs, out)
    return _PRE[key][1]


def simulate_programs(programs: list[list[Any]], pp: int, vpp: int, costs: ActionCosts, replicas: int,
                      speed: Callable[[int], float] | None = None, pairs: Any = None) -> SimOut:
    """Event-driven run of every pipeline rank's program (:mod:`k3train.planning.step_time`). ``replicas``: ranks doing the same
    work at the same time (dp x cp); ``speed(n)``: a rank's speed (1 = alone) while ``n`` ranks of the host
    compute (:meth:`Device.rank_speed`; None: a device each). ``pairs``: ``(firsts, f_phases, b_phases)`` of F/B
    pairing (the programs :func:`parallel.pipeline.p2p_programs.pair_programs` returned, its ``firsts``, and
    :func:`side_phases`): a pair starts once both computes' inputs are there and runs their compute together with
    what :func:`pair_seconds` leaves of their in-action communication (at full speed). The pair's first compute
    ``X`` posts its trailing sends as soon as its side is done, while the second still runs (the runner's
    ``run_pair``): the pair runs as two segments, split where :func:`pair_side_ends` ends ``X``'s side at full
    speed (each segment that share of the pair's compute and of its communication, so the whole is unchanged),
    and ``X``'s posts leave between them."""
    sim = _Simulation(_precompiled(programs, pp, vpp), pp, costs, pairs)
    sim.settle()
    while not all(sim.done):
        sim.step(speed, replicas)
    return SimOut(makespan=max(sim.end), end=sim.end, busy_compute=sim.bc, busy_comm=sim.bm,
                  chunk_done=sim.chunk_done)


_INF = float("inf")


class _Simulation:
    """The state of :func:`simulate_programs` at time ``t``: per rank its position in its program, the running
    action's compute (seconds at full speed) and then in-action communication (wall seconds: measured while every
    rank computes) left, the second segment of a running pair, the inputs it is blocked on; the messages' arrival
    times and the links' next free time."""

    def __init__(self, progs: list[list[tuple]], pp: int, costs: ActionCosts, pairs: Any) -> None:
        self.progs, self.pp, self.costs, self.pairs = progs, pp, costs, pairs
        self.pos = [0] * pp
        self.arrival: dict[Any, float] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.rem = [0.0] * pp          # remaining compute of the running action (seconds at full speed)
        self.rem_comm = [0.0] * pp     # then its in-action communication (wall seconds)
        self.running: list[Any] = [None] * pp
        self.second: list[tuple | None] = [None] * pp  # a pair: (compute, communication, X's posts) after X's side
        self.wait: list[tuple] = [()] * pp  # deps of the compute a rank is blocked on
        self.t = 0.0
        self.end = [0.0] * pp
        self.bc, self.bm = [0.0] * pp, [0.0] * pp
        self.chunk_done: list[dict[int, float]] = [{} for _ in range(pp)]
        self.pair_ends: dict[tuple[int, int], tuple[float, float]] = {}  # (F stage, B stage) -> side ends
        self.chunk_b: list[int | None] = [None] * pp  # the chunk of the backward the running action holds (if any)
        self.done = [False] * pp

    def post(self, r: int, ins: tuple) -> None:
        if ins[0] == "send":
            msg, dst = ins[1], ins[2]
            lat, xfer = self.costs.msg_s.get(msg.stage, (0.0, 0.0))
            k = (r, dst)
            start = max(self.t, self.link_free.get(k, 0.0))
            self.link_free[k] = start + xfer
            self.arrival[msg] = start + xfer + lat
        self.pos[r] += 1

    def advance(self, r: int) -> None:
        """Post rank ``r``'s receives and sends up to its next compute, and start it if its inputs are there."""
        prog = self.progs[r]
        self.wait[r] = ()
        while self.pos[r] < len(prog):
            ins = prog[self.pos[r]]
            if ins[0] != "comp":
                self.post(r, ins)
                continue
            a, v, deps = ins[1], ins[2], ins[3]
            two = self.pairs is not None and a in self.pairs[0][r]
            if two:
                deps = deps + prog[self.pos[r] + 1][3]
            if any(self.arrival.get(d, _INF) > self.t + 1e-15 for d in deps):
                self.wait[r] = deps
                return
            costs = self.costs
            comp, comm = (costs.f[v], costs.f_comm[v]) if a.kind == "F" else (costs.b[v], costs.b_comm[v])
            if two:
                comp, comm = self._start_pair(r, a, v, prog[self.pos[r] + 1])
                self.pos[r] += 1
            else:
                self.chunk_b[r] = a.chunk if a.kind == "B" else None
            self.rem[r], self.rem_comm[r] = comp, comm
            self.running[r] = a
            self.pos[r] += 1
            return
        self.done[r] = True

    def _start_pair(self, r: int, a: Any, v: int, nxt: tuple) -> tuple[float, float]:
        """The first segment's ``(compute, communication)`` of the pair ``a`` + ``nxt`` (the second's kept)."""
        a2, v2 = nxt[1], nxt[2]
        costs, pairs = self.costs, self.pairs
        fv, bv = (v, v2) if a.kind == "F" else (v2, v)
        comp = costs.f[fv] + costs.b[bv]
        if (fv, bv) not in self.pair_ends:  # the same two stages pair once per micro-batch: timed once
            self.pair_ends[fv, bv] = pair_side_ends(pairs[1][fv], pairs[2][bv])
        ends = self.pair_ends[fv, bv]
        total = max(ends)
        comm = max(0.0, total - comp)
        x = min(1.0, ends[0 if a.kind == "F" else 1] / total) if total > 0.0 else 1.0
        self.second[r] = (comp * (1.0 - x), comm * (1.0 - x), pairs[0][r][a])
        self.chunk_b[r] = (a if a.kind == "B" else a2).chunk
        return comp * x, comm * x

    def settle(self) -> None:
        """Advance every idle rank until none moves (a send may unblock a rank checked before it)."""
        moved = True
        while moved:
            moved = False
            for r in range(self.pp):
                if not self.done[r] and self.running[r] is None:
                    before = self.pos[r]
                    self.advance(r)
                    moved = moved or self.pos[r] != before or self.done[r]

    def step(self, speed: Callable[[int], float] | None, replicas: int) -> None:
        """To the next event: a running action's compute or communication ends, or a blocked rank's input arrives."""
        # a rank computes, then waits in its action's collectives (asleep: it leaves the cores to the others)
        pp, rem, rem_comm, t = self.pp, self.rem, self.rem_comm, self.t
        busy = [r for r in range(pp) if self.running[r] is not None]
        computing = [r for r in busy if rem[r] > 0.0]
        rate = speed(len(computing) * replicas) if speed is not None and computing else 1.0
        t_next = min((t + (rem[r] / rate if rem[r] > 0.0 else rem_comm[r]) for r in busy), default=_INF)
        for r in range(pp):
            if self.wait[r]:
                w = max(self.arrival.get(d, _INF) for d in self.wait[r])
                if t < w < t_next:
                    t_next = w
        if t_next == _INF:
            raise RuntimeError("pipeline programs deadlock in the simulation")
        dt = t_next - t
        for r in busy:
            if rem[r] > 0.0:
                rem[r] -= dt * rate
                self.bc[r] += dt
                if rem[r] <= 1e-12 * max(1.0, t_next):
                    rem[r] = 0.0
            else:
                rem_comm[r] -= dt
                self.bm[r] += dt
        self.t = t = t_next
        for r in busy:
            if rem[r] <= 0.0 and rem_comm[r] <= 1e-12 * max(1.0, t) and self.second[r] is not None:
                rem[r], rem_comm[r], n = self.second[r]  # X's side is done: its posts leave, the pair goes on
                self.second[r] = None
                for _ in range(n):
                    self.post(r, self.progs[r][self.pos[r]])
            if rem[r] <= 0.0 and rem_comm[r] <= 1e-12 * max(1.0, t):
                self.running[r] = None
                self.end[r] = t
                if self.chunk_b[r] is not None:
                    self.chunk_done[r][self.chunk_b[r]] = t
        self.settle()
