"""Collectives without processes: run the real distributed code of ONE rank for its memory, not its values.

The estimator wants the bytes a rank holds while it runs KCP (or any code written against ``torch.distributed``),
but it has no process group and no peers. :func:`simulated_collectives` patches the ``torch.distributed`` functions
the project calls so that, for a :class:`SimGroup` (a size and a rank, nothing else), each collective does the
local work with the same output shapes and the same in-place writes as the real one:

* ``all_gather_single`` / ``all_gather_into_tensor``: every slot of the output receives THIS rank's input (the
  peers' values are unknown, and only sizes matter for memory) -- unless the group has a :class:`SimBoard`:
  then the ranks are threads of this process (:func:`run_ranks`) and exchange their real values (the estimator
  builds every CP rank's KCP layout this way, so that the layout checks see the real documents);
* ``reduce_scatter_single`` / ``reduce_scatter_tensor``: the output receives this rank's slice of the input;
* ``all_reduce`` / ``broadcast``: nothing changes (the tensor is already the right size);
* ``all_to_all_single``: the output receives the input (balanced routing: a rank receives what it sends) --
  with a :class:`SimBoard`, the real rows every thread-rank addressed to this one;
* point-to-point (``P2POp`` + ``batch_isend_irecv``, ``isend`` / ``irecv``; MoonEP's replica weights and their
  gradients' reduce-back): a send does nothing, a receive zero-fills its tensor (the peer's values are unknown);
* ``get_world_size`` / ``get_rank``: the SimGroup's.

Every call on a real process group (or no group) goes to torch unchanged. Calls made with ``async_op=True`` get a
finished work object. The module never allocates beyond what the real collective's caller already did.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


class SimBoard:
    """Where the thread-ranks of :func:`run_ranks` exchange all-gathered tensors (real values)."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=600)

    def all_gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.detach().clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


class SimGroup:
    """A stand-in process group of ``size`` ranks seen from ``rank`` (for :func:`simulated_collectives`)."""

    def __init__(self, size: int, rank: int, name: str = "sim", board: SimBoard | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"SimGroup: rank {rank} outside a group of {size}")
        self.size, self.rank, self.name, self.board = size, rank, name, board

    def __repr__(self) -> str:
        return f"SimGroup({self.name}: rank {self.rank} of {self.size})"


class _Done:
    """The work object of a simulated async collective (already complete)."""

    def wait(self, *_: Any, **__: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _group_of(args: tuple, kwargs: dict, pos: int) -> Any:
    return kwargs.get("group", args[pos] if len(args) > pos else None)


def _gather(out: torch.Tensor, inp: torch.Tensor, g: SimGroup) -> None:
    if g.board is not None:
        out.view(g.size, -1).copy_(torch.stack([t.reshape(-1) for t in g.board.all_gather(g.rank, inp)]))
    else:
        out.view(g.size, -1).copy_(inp.reshape(1, -1).expand(g.size, -1))


def _scatter(out: torch.Tensor, inp: torch.Tensor, g: SimGroup) -> None:
    out.view(-1).copy_(inp.reshape(g.size, -1)[g.rank])


def _all_to_all(g: SimGroup, out: torch.Tensor, inp: torch.Tensor, out_splits: Any = None,
                in_splits: Any = None) -> None:
    if g.board is not None:  # thread-ranks: the real rows every rank addressed to this one, in rank order
        rows = inp.shape[0]
        splits = torch.tensor(list(in_splits) if in_splits is not None else [rows // g.size] * g.size)
        inputs = g.board.all_gather(g.rank, inp)
        every = g.board.all_gather(g.rank, splits)
        pieces = [x.split(sp.tolist(), dim=0)[g.rank] for x, sp in zip(inputs, every)]
        out.copy_(torch.cat(pieces).view(out.shape))
    elif out.numel() == inp.numel():
        out.view(-1).copy_(inp.reshape(-1))
    else:  # unbalanced splits: the size came from the (simulated) split exchange; values are irrelevant
        out.zero_()


# name -> (position of the ``group`` argument, local action(args) for a SimGroup)
_SIMULATED: dict[str, tuple[int, Any]] = {
    "all_gather_single": (2, lambda g, out, inp, *a, **k: _gather(out, inp, g)),
    "all_gather_into_tensor": (2, lambda g, out, inp, *a, **k: _gather(out, inp, g)),
    "reduce_scatter_single": (3, lambda g, out, inp, *a, **k: _scatter(out, inp, g)),
    "reduce_scatter_tensor": (3, lambda g, out, inp, *a, **k: _scatter(out, inp, g)),
    "all_reduce": (2, lambda g, t, *a, **k: None),
    "broadcast": (2, lambda g, t, *a, **k: None),
    "all_to_all_single": (4, lambda g, out, inp, o_sp=None, i_sp=None, *a, **k: _all_to_all(
        g, out, inp, k.get("output_split_sizes", o_sp), k.get("input_split_sizes", i_sp))),
    "barrier": (0, lambda g, *a, **k: None),
}


class _SimP2POp:
    """``dist.P2POp`` on a :class:`SimGroup` (torch's own resolves the peer through a real process group)."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0,
                 group_peer: int | None = None) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def _is_recv(op: Any) -> bool:
    return getattr(op, "__name__", "") == "irecv"


@contextmanager
def simulated_collectives(p2p_log: list[tuple[int, int]] | None = None) -> Iterator[None]:
    """Patch ``torch.distributed`` so that calls on a :class:`SimGroup` run locally (see the module docstring).
    ``p2p_log``: every simulated point-to-point call (a ``batch_isend_irecv`` batch, or one ``isend`` / ``irecv``)
    appends ``(1, bytes)``, the larger of what it sends and receives (links are full duplex) -- the calls a rank's
    code makes, and their bytes, are what the planner's link model charges (k3train/planning/calibration/layer_bench.py)."""
    saved: dict[str, Any] = {}

    def wrap(name: str, pos: int, action: Any) -> Any:
        orig = getattr(dist, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            g = _group_of(args, kwargs, pos)
            if not isinstance(g, SimGroup):
                return orig(*args, **kwargs)
            action(g, *args, **{k: v for k, v in kwargs.items() if k != "group"})
            return _Done() if kwargs.get("async_op") else None
        return call

    def size_or_rank(name: str) -> Any:
        orig = getattr(dist, name)

        def call(group: Any = None, *args: Any, **kwargs: Any) -> int:
            if isinstance(group, SimGroup):
                return group.size if name == "get_world_size" else group.rank
            return orig(group, *args, **kwargs)
        return call

    def p2p_op(orig: Any) -> Any:
        def make(op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0,
                 group_peer: int | None = None) -> Any:
            cls = _SimP2POp if isinstance(group, SimGroup) else orig
            return cls(op, tensor, peer, group, tag, group_peer)
        return make

    def batch_p2p(orig: Any) -> Any:
        def call(ops: list[Any]) -> list[Any]:
            sim = [isinstance(o, _SimP2POp) for o in ops]
            if not any(sim):
                return orig(ops)
            if not all(sim):
                raise RuntimeError("simulated_collectives: one batch_isend_irecv mixes simulated and real groups")
            moved = {True: 0, False: 0}  # bytes received, sent
            for o in ops:
                if _is_recv(o.op):
                    o.tensor.zero_()
                moved[_is_recv(o.op)] += o.tensor.numel() * o.tensor.element_size()
            if p2p_log is not None:
                p2p_log.append((1, max(moved.values())))
            return [_Done() for _ in ops]
        return call

    def single_p2p(name: str, orig: Any) -> Any:
        @functools.wraps(orig)  # keeps __name__: a P2POp built with the patched irecv is still a receive
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(_group_of(args, kwargs, 1), SimGroup):
                return orig(tensor, *args, **kwargs)
            if name == "irecv":
                tensor.zero_()
            if p2p_log is not None:
                p2p_log.append((1, tensor.numel() * tensor.element_size()))
            return _Done()
        return call

    for name, (pos, action) in _SIMULATED.items():
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, pos, action))
    saved["P2POp"], saved["batch_isend_irecv"] = dist.P2POp, dist.batch_isend_irecv
    dist.P2POp, dist.batch_isend_irecv = p2p_op(dist.P2POp), batch_p2p(dist.batch_isend_irecv)
    for name in ("isend", "irecv"):
        saved[name] = getattr(dist, name)
        setattr(dist, name, single_p2p(name, saved[name]))
    for name in ("get_world_size", "get_rank"):
        saved[name] = getattr(dist, name)
        setattr(dist, name, size_or_rank(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def run_ranks(size: int, fn: Callable[[SimGroup], Any], name: str = "sim") -> list[Any]:
    """``[fn(group of rank r) for r in range(size)]`` with the ranks as threads exchanging real values through one
    :class:`SimBoard` (call inside :func:`simulated_collectives`); a rank's exception is re-raised."""
    board = SimBoard(size)
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(r: int) -> None:
        try:
            out[r] = fn(SimGroup(size, r, name, board))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out
