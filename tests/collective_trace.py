"""Record the torch.distributed collectives / p2p each rank calls, and check that the ranks agree.

The rule of ``kcp/``, ``moonep/`` and ``parallel/``: every rank of a group joins the same collectives in the same
order whatever its data. A test that only checks values can pass while one data layout would hang a real run
(gloo and NCCL match collectives by call order); this utility makes the rule itself testable::

    def _body(rank, world_size):                 # inside tests/dist_helpers.run_distributed
        with trace_collectives() as trace:
            ...forward + backward...
        assert_collectives_match(trace)          # collective over the world: call it on every rank
        assert trace.count("all_gather_single", group=dims.ranks("cp")) == 2

While the block is open, the public ``torch.distributed`` functions (both the package names and those of
``torch.distributed.distributed_c10d``, so ``P2POp`` keeps validating; a package name already wrapped by someone
else is wrapped on top) are wrapped: every call resolved through either namespace at call time (``dist.X(...)``,
what k3train, parallel/, moonep/ and kcp/ do) is seen; a function bound by ``from ... import X`` before the block
is not. Only the outermost call is recorded (``all_gather_object`` calling
``all_gather`` is one event). An event holds the op name, the group's global ranks, and the tensors' shapes and
dtypes; p2p events (``send``/``recv``/``isend``/``irecv``, each op of ``batch_isend_irecv``) hold the peer.

:func:`assert_collectives_match` gathers every rank's events (``all_gather_object`` over the world, outside the
traced block) and asserts that (1) for every group, each member rank made the same sequence of group collectives
(op, and the shapes/dtypes that must agree across ranks for that op), and (2) for every ordered pair of ranks, the
sends of one match the receives of the other, in order, by shape and dtype.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# group collectives -> the parameters whose shapes/dtypes must be identical on every member rank
# (None: only the dtypes of all tensor arguments must agree, shapes legitimately differ by rank)
_COLLECTIVES: dict[str, tuple[str, ...] | None] = {
    "all_reduce": ("tensor",),
    "all_gather": ("tensor",),
    "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "all_gather_single": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output",),
    "reduce_scatter_tensor": ("output", "input"),
    "reduce_scatter_single": ("output", "input"),
    "all_to_all": None,
    "all_to_all_single": None,
    "broadcast": ("tensor",),
    "reduce": ("tensor",),
    "gather": ("tensor",),
    "scatter": ("tensor",),
    "barrier": (),
    "monitored_barrier": (),
    "all_gather_object": (),
    "broadcast_object_list": (),
    "gather_object": (),
    "scatter_object_list": (),
}
_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}  # name -> direction
_PEER = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"), "recv": ("src", "group_src"),
         "irecv": ("src", "group_src")}


@dataclass
class Event:
    """One recorded call. ``group``: global ranks; ``sig``: what must match across ranks (collectives);
    ``p2p``: ``[(direction, peer global rank, shape, dtype)]`` for p2p calls (one entry per op of a batch)."""

    op: str
    group: tuple[int, ...]
    sig: tuple = ()
    p2p: list[tuple[str, int, tuple[int, ...], str]] = field(default_factory=list)
    desc: str = ""  # the group's name (``group_desc``): two groups over the same ranks (e.g. ``ep`` and the
    #                 F/B-pairing twin ``ep_pair``) are different groups, each with its own call order

    def describe(self) -> str:
        name = f" {self.desc!r}" if self.desc else ""
        return f"{self.op}(group={list(self.group)}{name}, {self.sig or self.p2p})"


class CollectiveTrace:
    """The events of one rank, in call order (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def add(self, ev: Event) -> None:
        with self._lock:
            self.events.append(ev)

    def count(self, op: str, group: list[int] | tuple[int, ...] | None = None) -> int:
        """Number of ``op`` calls (over ``group``'s global ranks if given)."""
        return sum(1 for e in self.events if e.op == op and (group is None or e.group == tuple(group)))

    def collectives(self) -> list[Event]:
        return [e for e in self.events if not e.p2p]


def _group_ranks(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _group_desc(group: Any) -> str:
    if group is None or group is dist.group.WORLD:
        return ""
    return str(getattr(group, "group_desc", "") or "")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _meta(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def _peer(args: dict[str, Any], global_name: str, group_name: str) -> int:
    if args.get(group_name) is not None:
        return dist.get_global_rank(args.get("group"), args[group_name])
    return int(args[global_name])


def _event(name: str, args: dict[str, Any]) -> Event:
    if name == "batch_isend_irecv":
        ops = []
        for p in args["p2p_op_list"]:
            op_name = getattr(p.op, "__name__", "")
            if op_name not in _P2P:  # wrapped by something without functools.wraps: identify by object
                op_name = "isend" if p.op in (dist.isend, c10d.isend) else "irecv"
            peer = (dist.get_global_rank(p.group, p.group_peer) if getattr(p, "group_peer", None) is not None
                    else int(p.peer))
            ops.append((_P2P[op_name], peer) + _meta(p.tensor))
        descs = {_group_desc(p.group) for p in args["p2p_op_list"]}
        return Event(name, (), p2p=ops, desc=descs.pop() if len(descs) == 1 else "")
    if name in _P2P:
        return Event(name, (), p2p=[(_P2P[name], _peer(args, *_PEER[name])) + _meta(args["tensor"])],
                     desc=_group_desc(args.get("group")))
    keys = _COLLECTIVES[name]
    if keys is None:
        sig = tuple(_meta(t)[1] for v in args.values() for t in _tensors(v))
    else:
        sig = tuple(_meta(t) for k in keys for t in _tensors(args.get(k)))
    return Event(name, _group_ranks(args.get("group")), sig=sig, desc=_group_desc(args.get("group")))


_STATE = threading.local()


def _wrap(name: str, fn: Callable, trace: CollectiveTrace) -> Callable:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        depth = getattr(_STATE, "depth", 0)
        if depth == 0:
            bound = sig.bind(*a, **kw)
            bound.apply_defaults()
            trace.add(_event(name, dict(bound.arguments)))
        _STATE.depth = depth + 1
        try:
            return fn(*a, **kw)
        finally:
            _STATE.depth = depth

    return wrapper


@contextmanager
def trace_collectives() -> Iterator[CollectiveTrace]:
    """Record this rank's collectives and p2p calls while the block is open (see the module docstring)."""
    trace = CollectiveTrace()
    saved: list[tuple[Any, str, Any]] = []
    names = list(_COLLECTIVES) + list(_P2P) + ["batch_isend_irecv"]
    try:
        for n in names:
            fn = getattr(c10d, n, None)
            if fn is None:
                continue
            w = _wrap(n, fn, trace)
            saved.append((c10d, n, fn))
            setattr(c10d, n, w)
            pkg = getattr(dist, n, None)
            if pkg is not None:  # the same wrapper where both names are one function (P2POp validation)
                saved.append((dist, n, pkg))
                setattr(dist, n, w if pkg is fn else _wrap(n, pkg, trace))
        yield trace
    finally:
        for mod, n, fn in reversed(saved):
            setattr(mod, n, fn)


def _check_groups(traces: list[list[Event]]) -> list[str]:
    """Per group (ranks and name): every member rank's sequence of collectives on that group must be identical."""
    errors = []
    groups = {(e.group, e.desc) for evs in traces for e in evs if not e.p2p}
    for grp, desc in sorted(groups):
        seqs = {r: [e for e in traces[r] if not e.p2p and e.group == grp and e.desc == desc] for r in grp}
        ref_rank = grp[0]
        ref = seqs[ref_rank]
        for r in grp[1:]:
            seq = seqs[r]
            for i in range(max(len(ref), len(seq))):
                a = ref[i].describe() if i < len(ref) else "<nothing>"
                b = seq[i].describe() if i < len(seq) else "<nothing>"
                if a != b:
                    errors.append(f"group {list(grp)}: collective #{i} is {a} on rank {ref_rank} but {b} on "
                                  f"rank {r} ({len(ref)} vs {len(seq)} collectives in all)")
                    break
    return errors


def _check_p2p(traces: list[list[Event]]) -> list[str]:
    """Per ordered pair (a -> b) and group name: a's sends to b match b's receives from a, in order, by shape and
    dtype."""
    errors = []
    sends: dict[tuple[int, int, str], list] = {}
    recvs: dict[tuple[int, int, str], list] = {}
    for r, evs in enumerate(traces):
        for e in evs:
            for direction, peer, shape, dtype in e.p2p:
                if direction == "send":
                    sends.setdefault((r, peer, e.desc), []).append((shape, dtype))
                else:
                    recvs.setdefault((peer, r, e.desc), []).append((shape, dtype))
    for key in sorted(set(sends) | set(recvs)):
        if sends.get(key, []) != recvs.get(key, []):
            a, b, desc = key
            name = f" (group {desc!r})" if desc else ""
            errors.append(f"p2p {a} -> {b}{name}: sent {sends.get(key, [])} but received {recvs.get(key, [])}")
    return errors


def check_traces(traces: list[list[Event]]) -> list[str]:
    """The mismatches between the ranks' traces (``traces[r]`` = rank r's events); empty if they agree."""
    return _check_groups(traces) + _check_p2p(traces)


def assert_collectives_match(trace: CollectiveTrace) -> list[list[Event]]:
    """Gather every rank's trace over the world and assert they agree (collective: call on every rank, outside
    the traced block). Returns all ranks' events."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, trace.events)
    errors = check_traces(everyone)
    if errors:
        raise AssertionError("ranks disagree on their collectives:\n  " + "\n  ".join(errors[:10]))
    return everyone
