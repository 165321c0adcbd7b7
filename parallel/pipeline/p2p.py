"""Point-to-point transport of the pipeline: a per-rank *program* and its executor's send/recv primitives.

Why not ``batch_isend_irecv``: with gloo, batched p2p between a pair of ranks that are both the previous and the
next neighbour (pp = 2) can match the wrong messages (megatron-core's batched p2p gives silently wrong gradients
at pp=2 on gloo). Here every tensor is its own ``isend``/``irecv`` with a tag unique to (message, tensor index)
within the step, so gloo can never confuse two messages, whatever the order they are posted in.

Ordering (also what NCCL needs, which ignores tags): :func:`build_programs` simulates the whole pipeline once
(:func:`schedules.simulate`) and orders every rank's work by simulated time. Each message gets the time its
sender finishes; BOTH ends post their side of it at that position, with ties broken by the message key. So the
sequence of p2p operations between any two ranks is identical on both ends, receives are posted before the
action that consumes them, and sends right after the action that produced them. Sends are asynchronous; the
only blocking point is ``wait`` on a receive, which the simulation proved will be satisfied (no deadlock).

Shapes are static (from the config and the micro-batch shape), so receivers pre-allocate their buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parallel.comm_stats import ByteCounter
from parallel.pipeline.schedules import Action, Message, SimResult, message_route, produces, deps_of, simulate


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


def build_programs(sched: list[list[Action]], pp: int, vpp: int,
                   sim: SimResult | None = None) -> list[list[Instr]]:
    """Per pipeline rank, the ordered instructions (compute / send / recv) of one step (see module docstring)."""
    sim = sim or simulate(sched, pp, vpp)
    programs: list[list[Instr]] = []
    for r in range(pp):
        items: list[tuple[tuple, Instr]] = []
        for i, a in enumerate(sched[r]):
            # a compute sorts after every p2p post that becomes ready at or before its start
            items.append(((sim.start[r][i], 1, i), Instr("compute", action=a)))
            for msg in produces(a, r, pp, vpp):
                items.append(((sim.ready[msg], 0) + _msg_key(msg), Instr("send", msg=msg)))
        for msg, t in sim.ready.items():
            if message_route(msg, pp)[1] == r:
                items.append(((t, 0) + _msg_key(msg), Instr("recv", msg=msg)))
        items.sort(key=lambda x: x[0])
        programs.append([ins for _, ins in items])
    return programs


def check_programs(programs: list[list[Instr]], pp: int, vpp: int) -> None:
    """Static checks (no processes): for every ordered rank pair the send sequence equals the receive sequence,
    every receive is posted before the compute that needs it, and every send after the compute producing it."""
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
    for src in range(pp):
        for dst in range(pp):
            sends = [i.msg for i in programs[src] if i.op == "send" and message_route(i.msg, pp)[1] == dst]
            recvs = [i.msg for i in programs[dst] if i.op == "recv" and message_route(i.msg, pp)[0] == src]
            if sends != recvs:
                raise AssertionError(f"p2p order mismatch {src}->{dst}: sends {sends[:6]}... recvs {recvs[:6]}...")
    # the pair's combined op sequence (both directions) must agree too (single-stream transports such as NCCL)
    for a in range(pp):
        for b in range(a + 1, pp):
            def pair_seq(r: int, peer: int) -> list[Message]:
                return [i.msg for i in programs[r] if i.op in ("send", "recv")
                        and peer in message_route(i.msg, pp) and r in message_route(i.msg, pp)]
            if pair_seq(a, b) != pair_seq(b, a):
                raise AssertionError(f"p2p op order on pair ({a}, {b}) differs between the two ends")


class P2PTransport:
    """Async per-tensor p2p on the default process group (global ranks), counting bytes by kind.

    ``peers[p]`` = global rank of pipeline rank ``p`` in this rank's pipeline (``dims.ranks('pp')``).
    Tag of tensor ``i`` of a message: unique per (kind, boundary, micro-batch, i) within a step.
    """

    def __init__(self, peers: list[int], pp: int, num_boundaries: int, max_items: int, counter: ByteCounter,
                 group: Any = None) -> None:
        self.peers, self.pp, self.nb, self.max_items = peers, pp, max(1, num_boundaries), max_items
        self.counter, self.group = counter, group
        self._sends: list[tuple[int, Any, torch.Tensor]] = []  # (generation, work, buffer)
        self.generation = 0  # bumped by the runner before every compute
        self._recvs: dict[Message, tuple[list[torch.Tensor], list[Any]]] = {}

    def tag(self, msg: Message, i: int) -> int:
        if i >= self.max_items:
            raise ValueError(f"message {msg} has more than {self.max_items} tensors")
        kind = 0 if msg.kind == "act" else 1
        return ((msg.mb * self.nb + msg.stage) * 2 + kind) * self.max_items + i

    def send(self, msg: Message, tensors: list[torch.Tensor], kinds: list[str]) -> None:
        """Post ``isend`` of every tensor of ``msg`` (detached, contiguous) to its destination rank."""
        dst = self.peers[message_route(msg, self.pp)[1]]
        for i, (t, kind) in enumerate(zip(tensors, kinds)):
            t = t.detach().contiguous()
            work = dist.isend(t, dst, group=self.group, tag=self.tag(msg, i))
            self._sends.append((self.generation, work, t))  # keep the buffer alive until the send completes
            self.counter.add_sent(kind, t)

    def post_recv(self, msg: Message, specs: list[tuple[tuple[int, ...], torch.dtype]], kinds: list[str],
                  device: torch.device) -> None:
        """Pre-allocate and post ``irecv`` for every tensor of ``msg``."""
        src = self.peers[message_route(msg, self.pp)[0]]
        bufs, works = [], []
        for i, ((shape, dtype), kind) in enumerate(zip(specs, kinds)):
            buf = torch.empty(shape, dtype=dtype, device=device)
            works.append(dist.irecv(buf, src, group=self.group, tag=self.tag(msg, i)))
            bufs.append(buf)
            self.counter.add_recv(kind, buf)
        self._recvs[msg] = (bufs, works)

    def wait(self, msg: Message) -> list[torch.Tensor]:
        """Block until every tensor of ``msg`` arrived; returns the buffers (wire order)."""
        bufs, works = self._recvs.pop(msg)
        for w in works:
            w.wait()
        return bufs

    def complete_sends(self, upto_generation: int) -> None:
        """Wait for (and release the buffers of) sends posted in generations ``<= upto_generation``.

        Bounds the memory held by in-flight sends (gloo's send work reports completion only through ``wait``).
        Safe at any point of the program: a send posted at simulated time t is matched by a receive its
        destination posts at its own time t, which it reaches without waiting on anything later than t."""
        keep = []
        for gen, work, t in self._sends:
            if gen <= upto_generation:
                work.wait()
            else:
                keep.append((gen, work, t))
        self._sends = keep

    def finish(self) -> None:
        """End of step: wait for outstanding sends; every posted receive must have been consumed."""
        self.complete_sends(self.generation)
        self.generation = 0
        if self._recvs:
            raise RuntimeError(f"unconsumed p2p receives at the end of the step: {sorted(self._recvs)}")
