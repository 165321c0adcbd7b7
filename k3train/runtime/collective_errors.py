"""Name the collective and the process group a rank was in when a peer died or stalled: one line, not a traceback.

gloo reports a dead peer as ``RuntimeError: [.../pair.cc:537] Read error [127.0.0.1]:40866: Connection reset by
peer`` (a stuck one as ``Timed out waiting 300000ms for recv operation``) without saying which collective or which
group -- with pp, dp_cp, ep, edp, ... groups and asynchronous p2p, the first question of whoever reads the log.
:class:`CollectiveWatch` wraps the public collectives of the ``torch.distributed`` package namespace (what every
``dist.X(...)`` call of k3train, parallel/, moonep/ and kcp/ resolves at call time) to remember the last one the
rank entered and its group (named by ``group_desc``, which ``ParallelDims.new_group`` sets: ``pp``, ``dp_cp``, ...).
For asynchronous ops the returned work's ``wait`` is wrapped too, since that is where their failure surfaces. A
failing call is recorded and its exception re-raised unchanged (callers, and DCP's own error gathering, keep their
handling); the entry point turns it into one line with :meth:`CollectiveWatch.failure_line`.

Installed once by the command-line entry point for the life of the process -- not by ``Trainer``, because
in-process tests and tracing utilities wrap the same functions and must not be stacked under it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

# the public torch.distributed calls that wait on other ranks
WATCHED_OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)
_P2P_OPS = ("isend", "irecv")
_PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
# what a backend says when a peer is gone, or too late: marks an exception as a distributed failure even when it
# was raised outside a watched call (e.g. re-wrapped by DCP, or from a work's destructor)
_BACKEND_TEXT = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Timed out waiting|Socket Timeout"
                           r"|NCCL (error|communicator)|Watchdog caught collective operation timeout", re.I)


@dataclass
class Call:
    """One watched call: the op, the group object (None = world) and, for p2p, the peer's global rank."""

    op: str
    group: Any = None
    peer: int | None = None

    def group_name(self) -> str:
        g = self.group
        if g is None or g is dist.group.WORLD:
            return "world"
        desc = getattr(g, "group_desc", "") or ""
        return desc if desc and desc != "undefined" else "unnamed"

    def group_ranks(self) -> list[int]:
        try:
            return dist.get_process_group_ranks(self.group or dist.group.WORLD)
        except (RuntimeError, ValueError):  # torch.distributed already torn down
            return []


class _WatchedWork:
    """A ``Work`` whose ``wait`` records a failure against the call that produced it."""

    __slots__ = ("_work", "_call", "_watch")

    def __init__(self, work: Any, call: Call, watch: "CollectiveWatch") -> None:
        self._work, self._call, self._watch = work, call, watch

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._watch.last = self._call
        try:
            return self._work.wait(*args, **kwargs)
        except BaseException as e:
            self._watch.record_failure(self._call, e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveWatch:
    """See the module docstring. ``last``: the call most recently entered (or waited on); ``failed``: the first
    call that raised, with its exception."""

    def __init__(self) -> None:
        self.last: Call | None = None
        self.failed: tuple[Call, BaseException] | None = None
        self._originals: dict[str, Callable] = {}

    # ------------------------------------------------------------------------------------------------------
    def install(self) -> "CollectiveWatch":
        for name in WATCHED_OPS:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._originals:
                self._originals[name] = fn
                wrapped = self._wrap(name, fn)
                setattr(dist, name, wrapped)
                # ``P2POp`` validates its op against the module globals of distributed_c10d: the wrapped
                # isend/irecv must be those globals too, or every ``dist.P2POp(dist.isend, ...)`` is rejected
                if name in _P2P_OPS and getattr(_c10d, name, None) is fn:
                    setattr(_c10d, name, wrapped)
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            if name in _P2P_OPS and getattr(getattr(_c10d, name, None), "__wrapped__", None) is fn:
                setattr(_c10d, name, fn)
            setattr(dist, name, fn)
        self._originals.clear()

    def record_failure(self, call: Call, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = (call, exc)

    def _wrap(self, name: str, fn: Callable) -> Callable:
        peer_arg = _PEER_ARG.get(name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            call = _describe_call(name, peer_arg, args, kwargs)
            self.last = call
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                self.record_failure(call, e)
                raise
            if isinstance(out, dist.Work):
                return _WatchedWork(out, call, self)
            if name == "batch_isend_irecv":
                return [_WatchedWork(w, call, self) for w in out]
            return out

        watched.__wrapped__ = fn  # type: ignore[attr-defined]
        watched.__name__ = name
        watched.__doc__ = fn.__doc__
        return watched

    # ------------------------------------------------------------------------------------------------------
    def failure_line(self, exc: BaseException, rank: int) -> str | None:
        """``k3train: error: rank R: collective OP on group G (ranks [...]) failed: REASON`` when ``exc`` comes from
        a collective whose peer died or timed out; None for any other exception."""
        if self.failed is not None:
            call, cause = self.failed
            what = "failed"
        elif self.last is not None and _looks_distributed(exc):
            call, cause = self.last, _root_distributed(exc)
            what = "failed (the last collective this rank entered)"
        else:
            return None
        ranks = call.group_ranks()
        where = f"group {call.group_name()}" + (f" (ranks {ranks})" if ranks else "")
        peer = call.peer if call.peer is not None else _only_peer(ranks, rank)
        return f"k3train: error: rank {rank}: collective {call.op} on {where} {what}: {_reason(cause, peer)}"


def _describe_call(name: str, peer_arg: str | None, args: tuple, kwargs: dict) -> Call:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        first = ops[0] if ops else None
        return Call(name, getattr(first, "group", None), getattr(first, "peer", None))
    group = kwargs.get("group")
    if group is None:  # positional: group follows the tensor(s)/op for the calls above; find it by type
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    peer = None
    if peer_arg is not None:
        peer = kwargs.get(peer_arg, args[1] if len(args) > 1 and isinstance(args[1], int) else None)
    return Call(name, group, peer)


def _only_peer(ranks: list[int], rank: int) -> int | None:
    others = [r for r in ranks if r != rank]
    return others[0] if len(others) == 1 else None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < 32:
        e = todo.pop()
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        todo += [v for v in (getattr(e, "failures", None) or {}).values() if isinstance(v, BaseException)]
    return out


def _looks_distributed(exc: BaseException) -> bool:
    return any(isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _BACKEND_TEXT.search(str(e)))
               for e in _chain(exc))


def _root_distributed(exc: BaseException) -> BaseException:
    for e in _chain(exc):
        if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _BACKEND_TEXT.search(str(e))):
            return e
    return exc


def _reason(cause: BaseException, peer: int | None) -> str:
    text = " ".join(str(cause).split())
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # "[/path/pair.cc:537] " source location
    text = text.split(". This is typically caused")[0]
    if len(text) > 240:
        text = text[:237] + "..."
    who = f"peer rank {peer}" if peer is not None else "a peer rank"
    m = re.search(r"Timed out waiting (\d+)ms", text)
    if m or "timed out" in text.lower():
        secs = f" {int(m.group(1)) / 1000:g} s" if m else ""
        return (f"{who} did not answer within{secs} (parallel.collective_timeout_s): it is stuck or dead "
                f"[{type(cause).__name__}: {text}]")
    if re.search(r"Connection (reset|closed) by peer|Broken pipe|EOF", text, re.I):
        return f"{who} closed the connection: it died [{type(cause).__name__}: {text}]"
    return f"{type(cause).__name__}: {text}"
