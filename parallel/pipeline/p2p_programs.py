"""Per-rank p2p *programs* (the order of computes, sends and receives of one step) and their static checks.

Transport model the order must satisfy (the strictest of the ones we run on): the p2p operations between two
ranks are matched in the order each end posts them (NCCL: one stream per rank pair, both directions; gloo
matches by tag and does not care), an operation completes once both ends posted it and every earlier operation
of the pair completed, and a rank's host blocks only (a) before a compute, on the receives it consumes, and
(b) before a compute, on its sends posted two computes earlier (``P2PTransport.complete_sends``). So the
sequence of p2p operations of every rank pair must be identical on both ends, and the whole must not deadlock
under that model; :func:`run_programs` executes the programs under it (or under tag matching) without tensors.

Two orders (``build_programs(..., post_ahead=)``):

* by time (``post_ahead=False``, the original rule): :func:`schedules.simulate` gives every message the time its
  sender finishes; BOTH ends post their side at that time (ties by message key). Both ends then see the same
  pair sequence, but a receive is posted only once its data would be ready, so most receives sit right before
  the compute that consumes them and the transfer lies on the critical path.
* posted ahead (default): every receive is posted before the compute *preceding* its consumer (one compute
  ahead, as Megatron's overlapped p2p), every send right after the compute producing it. Between two ranks the
  messages of each direction keep their production order, and the two directions are merged greedily: at each
  step the head whose placement keeps both heads' receives ahead (and delays no send) goes first. Where the two
  ends' wishes conflict (rank a wants the receive of y before the compute that produces x, rank b the receive of
  x before the compute that produces y: inherent in 1F1B, whose alternating F/B exchanges both directions
  between the same computes) one receive is posted later, at the latest right before its consumer, so the pair
  sequences stay identical and deadlock-free. :func:`recv_lead` counts how many receives are ahead. Where that
  order deadlocks under the transport model (AFAB with several chunks and many micro-batches: the next chunk's
  inputs are ready while the receiver still runs this chunk's forward of every micro-batch, and a sender waits
  at most one compute for its send), every receive whose receiver would reach its gap only after the send must
  have completed is posted by then instead (:func:`_latest_recv_gap`; the receive buffer is held longer).

Vision encoder actions (``EF``/``EB``, schedules.py) are local computes of the first rank without messages: the
programs are built from the F/B schedule alone and each encoder compute is then put right before the next F/B
compute of its schedule position (after that gap's posts, so the sends already left and the receives are posted
while the encoder runs) or at the end. They take no part in the send-completion rule (the runner does not wait
for sends before them), so every rank's p2p behaviour is exactly the F/B program's.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.placement import Placement
from parallel.pipeline.schedules import (Action, Message, SimResult, deps_of, message_route, produces, simulate,
                                         strip_encoder)


@dataclass(frozen=True)
class Instr:
    """One step of a rank's program: ``op`` = 'compute' (``action``), 'send' or 'recv' (``msg``)."""

    op: str
    action: Action | None = None
    msg: Message | None = None

    def __repr__(self) -> str:
        return f"{self.op}({self.action if self.action is not None else self.msg})"


def _msg_key(m: Message) -> tuple[int, int, int]:
    return (0 if m.kind == "act" else 1, m.stage, m.mb)


def build_programs(sched: list[list[Action]], pp: int, vpp: int, sim: SimResult | None = None,
                   post_ahead: bool = True) -> list[list[Instr]]:
    """Per pipeline rank, the ordered instructions (compute / send / recv) of one step (see module docstring).
    ``sim``: the simulation of the F/B schedule, without encoder actions (computed if omitted); ``post_ahead``:
    receives one compute ahead. Encoder actions in ``sched`` are inserted by :func:`insert_encoder_computes`."""
    placement = Placement.of(pp, vpp)
    base = strip_encoder(sched)
    if sim is not None and [len(x) for x in sim.start] != [len(x) for x in base]:
        raise ValueError("build_programs: sim must be the simulation of the F/B schedule (no encoder actions)")
    sim = sim or simulate(base, pp, vpp)
    if not post_ahead:
        progs = _programs_by_time(base, placement, sim)
    else:
        progs = _programs_posted_ahead(base, placement, sim, early=False)
        try:
            run_programs(progs, pp, vpp, ordered=True)
        except ProgramDeadlock:  # a sender would wait for good on a receive posted at its consumer (AFAB, vpp > 1)
            progs = _programs_posted_ahead(base, placement, sim, early=True)
            run_programs(progs, pp, vpp, ordered=True)  # still deadlocked: the error here, never a hang in a step
    return insert_encoder_computes(progs, sched) if base != sched else progs


def insert_encoder_computes(programs: list[list[Instr]], sched: list[list[Action]]) -> list[list[Instr]]:
    """``programs`` (built from the F/B part of ``sched``) with ``sched``'s encoder actions as computes: each
    right before the next F/B compute that follows it in ``sched`` (after the posts in front of that compute),
    or at the end of the program. Every other instruction keeps its relative order."""
    out = []
    for prog, acts in zip(programs, sched):
        pending: list[Action] = []
        before: dict[int, list[Action]] = {}  # index of the F/B compute -> encoder actions right before it
        k = 0
        for a in acts:
            if a.is_encoder:
                pending.append(a)
            else:
                before[k], pending, k = pending, [], k + 1
        new, k = [], 0
        for ins in prog:
            if ins.op == "compute":
                if ins.action.is_encoder:
                    raise ValueError("insert_encoder_computes: the programs already hold encoder computes")
                new += [Instr("compute", action=e) for e in before.get(k, [])]
                k += 1
            new.append(ins)
        out.append(new + [Instr("compute", action=e) for e in pending])
    return out


def _programs_by_time(sched: list[list[Action]], pl: Placement, sim: SimResult) -> list[list[Instr]]:
    programs: list[list[Instr]] = []
    for r in range(pl.pp):
        items: list[tuple[tuple, Instr]] = []
        for i, a in enumerate(sched[r]):
            # a compute sorts after every p2p post that becomes ready at or before its start
            items.append(((sim.start[r][i], 1, i), Instr("compute", action=a)))
            for msg in produces(a, r, pl.pp, pl.vpp):
                items.append(((sim.ready[msg], 0) + _msg_key(msg), Instr("send", msg=msg)))
        for msg, t in sim.ready.items():
            if message_route(msg, pl)[1] == r:
                items.append(((t, 0) + _msg_key(msg), Instr("recv", msg=msg)))
        items.sort(key=lambda x: x[0])
        programs.append([ins for _, ins in items])
    return programs


def _programs_posted_ahead(sched: list[list[Action]], pl: Placement, sim: SimResult,
                           early: bool) -> list[list[Instr]]:
    pp, vpp = pl.pp, pl.vpp
    # gap g of a rank: the slot right before its compute g (g = len: after the last compute)
    send_gap: dict[Message, int] = {}  # the gap right after the producing compute (sender)
    consumer: dict[Message, int] = {}  # index of the consuming compute (receiver)
    for r, acts in enumerate(sched):
        for i, a in enumerate(acts):
            for m in produces(a, r, pp, vpp):
                send_gap[m] = i + 1
            for m in deps_of(a, r, pp, vpp):
                consumer[m] = i
    route = {m: message_route(m, pl) for m in send_gap}
    latest = {m: _latest_recv_gap(m, route[m], send_gap[m], consumer[m], sim) if early
              else max(consumer[m] - 1, 0) for m in send_gap}
    gap: dict[tuple[Message, str], int] = {}  # (msg, 'send'|'recv') -> gap on that end
    pos: dict[Message, int] = {}  # position in its rank pair's sequence
    by_route: dict[tuple[int, int], list[Message]] = {}
    for m in send_gap:
        by_route.setdefault(route[m], []).append(m)
    for a, b in sorted({(min(r), max(r)) for r in by_route}):  # the rank pairs that exchange messages
        queues = [sorted(by_route.get((s, d), ()), key=lambda m: (send_gap[m], sim.ready[m], _msg_key(m)))
                  for s, d in ((a, b), (b, a))]
        _merge_pair(a, b, queues, _PairWishes(route, send_gap, consumer, latest, sim), gap, pos)
    items: list[list[tuple[tuple, Instr]]] = [[((i, 1, 0, 0), Instr("compute", action=a))
                                               for i, a in enumerate(sched[r])] for r in range(pp)]
    for m, (s, d) in route.items():  # keys are unique per rank: the order of this loop does not matter
        items[s].append(((gap[(m, "send")], 0, pos[m], d), Instr("send", msg=m)))
        items[d].append(((gap[(m, "recv")], 0, pos[m], s), Instr("recv", msg=m)))
    programs: list[list[Instr]] = []
    for r in range(pp):
        items[r].sort(key=lambda x: x[0])
        programs.append([ins for _, ins in items[r]])
    return programs


@dataclass(frozen=True)
class _PairWishes:
    """Where each message's ends want its operations (:func:`_programs_posted_ahead`): its route, the sender's gap
    right after the producing compute, the consuming compute, the receiver's latest wanted gap, the simulation."""
    route: dict[Message, tuple[int, int]]
    send_gap: dict[Message, int]
    consumer: dict[Message, int]
    latest: dict[Message, int]
    sim: SimResult


def _merge_pair(a: int, b: int, queues: list[list[Message]], w: _PairWishes, gap: dict[tuple[Message, str], int],
                pos: dict[Message, int]) -> None:
    """The two directions of rank pair ``(a, b)`` (``queues``: a->b, b->a in production order) merged greedily
    into one sequence (module docstring): each message's send and receive gap (``gap``) and position (``pos``)."""
    floor = {a: 0, b: 0}  # gap of the pair's latest placed operation on each end

    def place(m: Message, fl: dict[int, int]) -> tuple[int, int, int, int]:
        """(send gap, recv gap, missed, delayed) of ``m`` placed next after floors ``fl``."""
        s, d = w.route[m]
        sg = max(w.send_gap[m], fl[s])
        want = w.latest[m]
        rg = max(want, fl[d])
        return sg, rg, int(rg > want), int(sg > w.send_gap[m])

    def score(first: Message, then: Message) -> tuple:
        fl = dict(floor)
        total = [0, 0]
        for m in (first, then):
            sg, rg, missed, delayed = place(m, fl)
            if rg > w.consumer[m]:
                return (1,)  # infeasible: the receive would come after its consumer
            s, d = w.route[m]
            fl[s], fl[d] = sg, rg
            total[0] += missed
            total[1] += delayed
        return (0, *total, w.sim.ready[first], _msg_key(first))

    heads, n = [0, 0], 0
    while heads[0] < len(queues[0]) or heads[1] < len(queues[1]):
        if heads[0] == len(queues[0]) or heads[1] == len(queues[1]):
            k = 0 if heads[0] < len(queues[0]) else 1
        else:
            x, y = queues[0][heads[0]], queues[1][heads[1]]
            k = 0 if score(x, y) <= score(y, x) else 1
        m = queues[k][heads[k]]
        heads[k] += 1
        sg, rg, _, _ = place(m, floor)
        if rg > w.consumer[m]:
            raise RuntimeError(f"p2p order: no position for the receive of {m} (pair {a}, {b})")
        s, d = w.route[m]
        floor[s], floor[d] = sg, rg
        gap[(m, "send")], gap[(m, "recv")], pos[m] = sg, rg, n
        n += 1


def _latest_recv_gap(m: Message, route: tuple[int, int], send_gap: int, consumer: int, sim: SimResult) -> int:
    """The gap of the receiver to post ``m``'s receive in when one compute before every consumer deadlocks
    (:func:`build_programs` falls back to it): one compute before its consumer, unless the receiver
    gets there (in the simulated schedule) only after the sender must see the send complete -- before its
    compute ``send_gap + 1`` (``complete_sends``: a send waits at most one compute) -- then its last gap that
    starts no later than the sender's compute ``send_gap`` (the send's post, plus that compute). Under AFAB with
    several chunks the next chunk's inputs arrive while the receiver still runs this chunk's forwards of every
    micro-batch: posted one compute before their consumers the sender would block on them, and its neighbours
    on it, for good (a hang at pp 4, vpp 2, 16 micro-batches)."""
    s, d = route
    want = max(consumer - 1, 0)
    ends = sim.end[d]
    if send_gap + 1 >= len(sim.start[s]):  # no compute of the sender waits on this send
        return want
    deadline = sim.start[s][send_gap + 1]
    if want == 0 or ends[want - 1] <= deadline:  # the receiver reaches that gap in time
        return want
    g = want
    while g > 0 and ends[g - 1] > sim.start[s][send_gap]:
        g -= 1
    return g


def check_programs(programs: list[list[Instr]], pp: int, vpp: int) -> None:
    """Static checks (no processes): for every ordered rank pair the send sequence equals the receive sequence,
    every receive is posted before the compute that needs it, and every send after the compute producing it."""
    pl = Placement.of(pp, vpp)
    for r, prog in enumerate(programs):
        posted: set[Message] = set()
        done: set[Message] = set()  # messages whose producing compute ran on this rank
        for ins in prog:
            if ins.op == "recv":
                posted.add(ins.msg)
            elif ins.op == "send":
                if ins.msg not in done:
                    raise AssertionError(f"rank {r}: send {ins.msg} before the compute producing it")
            else:
                for d in deps_of(ins.action, r, pp, vpp):
                    if d not in posted:
                        raise AssertionError(f"rank {r}: {ins.action} runs before receiving {d}")
                done.update(produces(ins.action, r, pp, vpp))
    sends: dict[tuple[int, int], list[Message]] = {}  # (src, dst) -> messages in src's order
    recvs: dict[tuple[int, int], list[Message]] = {}  # (src, dst) -> messages in dst's order
    for r, prog in enumerate(programs):
        for i in prog:
            if i.op == "send":
                sends.setdefault((r, message_route(i.msg, pl)[1]), []).append(i.msg)
            elif i.op == "recv":
                recvs.setdefault((message_route(i.msg, pl)[0], r), []).append(i.msg)
    for src, dst in sorted(set(sends) | set(recvs)):
        s, r = sends.get((src, dst), []), recvs.get((src, dst), [])
        if s != r:
            raise AssertionError(f"p2p order mismatch {src}->{dst}: sends {s[:6]}... recvs {r[:6]}...")
    # the pair's combined op sequence (both directions) must agree too (single-stream transports such as NCCL)
    seqs = _pair_seqs(programs, pl)
    for a, b in sorted({(min(k), max(k)) for k in seqs}):
        if seqs.get((a, b), []) != seqs.get((b, a), []):
            raise AssertionError(f"p2p op order on pair ({a}, {b}) differs between the two ends")


def _pair_seqs(programs: list[list[Instr]], pl: Placement) -> dict[tuple[int, int], list[Message]]:
    """``{(rank, peer): the p2p messages of rank's program exchanged with peer, in program order}`` (pairs
    without messages left out)."""
    out: dict[tuple[int, int], list[Message]] = {}
    for r, prog in enumerate(programs):
        for i in prog:
            if i.op != "compute":
                s, d = message_route(i.msg, pl)
                if r in (s, d) and s != d:
                    out.setdefault((r, d if r == s else s), []).append(i.msg)
    return out


class ProgramDeadlock(RuntimeError):
    """The programs deadlock under the transport model (:func:`run_programs`)."""


def run_programs(programs: list[list[Instr]], pp: int, vpp: int, ordered: bool = True) -> None:
    """Execute the programs under the transport model of the module docstring (``ordered``: pair operations
    complete in posting order, as on NCCL; otherwise matched by tag, as on gloo), without tensors. Raises
    :class:`ProgramDeadlock` on deadlock, naming what every blocked rank waits for."""
    pl = Placement.of(pp, vpp)
    pair_of = {}
    seqs: dict[tuple[int, int], list[Message]] = {}
    by_rank = _pair_seqs(programs, pl)
    for a, b in sorted({(min(k), max(k)) for k in by_rank}):
        seqs[(a, b)] = by_rank.get((a, b), [])
        for m in seqs[(a, b)]:
            pair_of[m] = (a, b)
    done_upto = dict.fromkeys(seqs, 0)
    sent: set[Message] = set()
    received: set[Message] = set()
    complete: set[Message] = set()

    def progress_pair(m: Message) -> None:
        if not ordered:
            if m in sent and m in received:
                complete.add(m)
            return
        key = pair_of[m]
        seq, i = seqs[key], done_upto[key]
        while i < len(seq) and seq[i] in sent and seq[i] in received:
            complete.add(seq[i])
            i += 1
        done_upto[key] = i

    pc, computed = [0] * pp, [0] * pp
    pending: list[list[tuple[int, Message]]] = [[] for _ in range(pp)]  # (computes before the post, msg)
    while True:
        moved = False
        for r in range(pp):
            prog = programs[r]
            while pc[r] < len(prog):
                ins = prog[pc[r]]
                if ins.op == "recv":
                    received.add(ins.msg)
                    progress_pair(ins.msg)
                elif ins.op == "send":
                    sent.add(ins.msg)
                    pending[r].append((computed[r], ins.msg))
                    progress_pair(ins.msg)
                elif ins.action.is_encoder:
                    pass  # a local compute outside the p2p rules (module docstring)
                else:
                    pending[r] = [(g, m) for g, m in pending[r] if m not in complete]
                    need = [m for g, m in pending[r] if g <= computed[r] - 1]
                    need += [m for m in deps_of(ins.action, r, pp, vpp) if m not in complete]
                    if need:
                        break
                    computed[r] += 1
                pc[r] += 1
                moved = True
        if all(pc[r] == len(programs[r]) for r in range(pp)):
            left = [m for m in pair_of if m not in complete]
            if left:
                raise ProgramDeadlock(f"p2p programs deadlock at the end of the step: incomplete {left[:6]}")
            return
        if not moved:
            waits = {r: (programs[r][pc[r]], [m for g, m in pending[r] if g <= computed[r] - 1],
                         [m for m in deps_of(programs[r][pc[r]].action, r, pp, vpp) if m not in complete])
                     for r in range(pp) if pc[r] < len(programs[r])}
            raise ProgramDeadlock(f"p2p programs deadlock; blocked ranks (instr, sends, receives): {waits}")


def recv_lead(programs: list[list[Instr]], pp: int, vpp: int) -> tuple[int, int]:
    """``(ahead, total)``: receives posted at least one compute before the compute consuming them, out of the
    receives that can be (those not consumed by their rank's first compute)."""
    ahead = total = 0
    for r, prog in enumerate(programs):
        posted_at: dict[Message, int] = {}
        n = 0
        for ins in prog:
            if ins.op == "recv":
                posted_at[ins.msg] = n
            elif ins.op == "compute" and not ins.action.is_encoder:  # F/B computes only (module docstring)
                for m in deps_of(ins.action, r, pp, vpp):
                    if n > 0:
                        total += 1
                        ahead += int(posted_at[m] < n)
                n += 1
    return ahead, total


def pair_programs(programs: list[list[Instr]], pp: int, vpp: int
                  ) -> tuple[list[list[Instr]], list[dict[Action, int]]]:
    """F/B pairing (``parallel.overlap_ep``, parallel/pairing.py) of the F/B programs: ``(programs, firsts)``.

    A compute ``X`` and the next compute ``Y`` of a rank form a pair when one is an F and the other a B of another
    micro-batch (so neither needs the other's result on this rank) and what lies between them is ``X``'s sends
    and receives ``Y`` does not consume (``X``'s *trailing posts*): the program becomes ``X, Y`` and then those
    posts -- each rank's sequence of p2p operations is unchanged (so is every pair's, on both ends), and ``Y``'s
    receives were all posted before ``X``. The runner runs ``X`` and ``Y`` at the same time (the F on the pair
    worker) and posts ``X``'s trailing posts as soon as ``X`` computed, from ``X``'s thread, while ``Y`` may
    still run (PipelineRunner.run_pair): still all before ``Y``'s posts, so the order is the program's.
    ``firsts[r]``: ``{X: number of X's trailing posts}`` for every pair of rank ``r`` (its ``Y`` is the next
    compute, the trailing posts are the instructions right after ``Y``).
    The paired programs are checked (:func:`check_programs`, and :func:`run_programs` under ordered matching:
    deadlock-free also when ``X``'s consumers are what ``Y`` waits for: the check runs ``X``'s posts after ``Y``,
    the latest the runner may post them); a rank's pairs that fail are dropped
    from the first one on until they pass (every rank computes the same programs, so every rank agrees)."""
    def paired(r: int, prog: list[Instr], limit: int) -> tuple[list[Instr], dict[Action, int]]:
        out: list[Instr] = []
        firsts: dict[Action, int] = {}
        i = 0
        while i < len(prog):
            ins = prog[i]
            j = i + 1
            while j < len(prog) and prog[j].op != "compute":
                j += 1
            if (len(firsts) < limit and ins.op == "compute" and not ins.action.is_encoder and j < len(prog)
                    and not prog[j].action.is_encoder and {ins.action.kind, prog[j].action.kind} == {"F", "B"}
                    and ins.action.mb != prog[j].action.mb  # independent: another micro-batch
                    and not {p.msg for p in prog[i + 1:j] if p.op == "recv"} & set(deps_of(prog[j].action, r,
                                                                                              pp, vpp))):
                out += [ins, prog[j]] + prog[i + 1:j]
                firsts[ins.action] = j - i - 1
                i = j + 1
                continue
            out.append(ins)
            i += 1
        return out, firsts

    limits = [len(prog) for prog in programs]
    while True:
        result = [paired(r, prog, limit) for r, (prog, limit) in enumerate(zip(programs, limits))]
        progs = [p for p, _ in result]
        try:
            check_programs(progs, pp, vpp)
            run_programs(progs, pp, vpp, ordered=True)
            return progs, [f for _, f in result]
        except (AssertionError, RuntimeError):
            # drop the last pair of the rank with the most pairs (deterministic) and try again
            counts = [len(f) for _, f in result]
            r = max(range(len(counts)), key=lambda k: (counts[k], -k))
            if counts[r] == 0:
                raise
            limits[r] = counts[r] - 1
