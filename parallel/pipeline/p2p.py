"""Point-to-point transport of the pipeline: the executor's send/recv primitives (the per-rank *programs* that
order them, and their checks, are in p2p_programs.py, re-exported here).

Why not ``batch_isend_irecv``: with gloo, batched p2p between a pair of ranks that are both the previous and the
next neighbour (pp = 2) can match the wrong messages (megatron-core's batched p2p gives silently wrong gradients
at pp=2 on gloo). Here every tensor is its own ``isend``/``irecv`` with a tag unique to (message, tensor index)
within the step, so gloo can never confuse two messages, whatever the order they are posted in.

Receives are posted ahead (one compute before their consumer): the transport keeps each posted buffer alive until
``wait`` hands it out, and each sent tensor until its send completed (gloo reads both asynchronously).
Shapes are static (from the config and the micro-batch shape), so receivers pre-allocate their buffers.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from parallel.comm_stats import ByteCounter
from parallel.pipeline.placement import Placement
from parallel.pipeline.p2p_programs import Instr, build_programs, check_programs, recv_lead, run_programs
from parallel.pipeline.schedules import Message, message_route

__all__ = ["Instr", "P2PTransport", "build_programs", "check_programs", "recv_lead", "run_programs"]


class P2PTransport:
    """Async per-tensor p2p on the default process group (global ranks), counting bytes by kind.

    ``peers[p]`` = global rank of pipeline rank ``p`` in this rank's pipeline (``dims.ranks('pp')``).
    Tag of tensor ``i`` of a message: unique per (kind, boundary, micro-batch, i) within a step.
    """

    def __init__(self, peers: list[int], pp: int, num_boundaries: int, max_items: int, counter: ByteCounter,
                 group: Any = None, placement: Placement | None = None) -> None:
        self.peers, self.pp, self.nb, self.max_items = peers, pp, max(1, num_boundaries), max_items
        self.placement = placement or Placement.of(pp, max(1, (num_boundaries + 1) // pp))
        self.counter, self.group = counter, group
        self._sends: list[tuple[int, Any, torch.Tensor]] = []  # (generation, work, buffer)
        self.generation = 0  # bumped by the runner before every compute
        self._recvs: dict[Message, tuple[list[torch.Tensor], list[Any]]] = {}
        self.wait_s = 0.0  # seconds blocked in wait() this step (receives not yet arrived)
        # F/B pairing (parallel/pairing.py): wait() may run on two threads at once, and a pair's first compute
        # posts its sends / receives from its own thread while the other side waits for a receive
        self._lock = threading.Lock()

    def tag(self, msg: Message, i: int) -> int:
        if i >= self.max_items:
            raise ValueError(f"message {msg} has more than {self.max_items} tensors")
        kind = 0 if msg.kind == "act" else 1
        return ((msg.mb * self.nb + msg.stage) * 2 + kind) * self.max_items + i

    def send(self, msg: Message, tensors: list[torch.Tensor], kinds: list[str]) -> None:
        """Post ``isend`` of every tensor of ``msg`` (detached, contiguous) to its destination rank."""
        dst = self.peers[message_route(msg, self.placement)[1]]
        with self._lock:
            for i, (t, kind) in enumerate(zip(tensors, kinds)):
                t = t.detach().contiguous()
                work = dist.isend(t, dst, group=self.group, tag=self.tag(msg, i))
                self._sends.append((self.generation, work, t))  # keep the buffer alive until the send completes
                self.counter.add_sent(kind, t)

    def post_recv(self, msg: Message, specs: list[tuple[tuple[int, ...], torch.dtype]], kinds: list[str],
                  device: torch.device) -> None:
        """Pre-allocate and post ``irecv`` for every tensor of ``msg``."""
        src = self.peers[message_route(msg, self.placement)[0]]
        bufs, works = [], []
        with self._lock:
            for i, ((shape, dtype), kind) in enumerate(zip(specs, kinds)):
                buf = torch.empty(shape, dtype=dtype, device=device)
                works.append(dist.irecv(buf, src, group=self.group, tag=self.tag(msg, i)))
                bufs.append(buf)
                self.counter.add_recv(kind, buf)
            self._recvs[msg] = (bufs, works)

    def wait(self, msg: Message) -> list[torch.Tensor]:
        """Block until every tensor of ``msg`` arrived; returns the buffers (wire order)."""
        with self._lock:
            bufs, works = self._recvs.pop(msg)
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        with self._lock:
            self.wait_s += time.perf_counter() - t0
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
