"""``SidedGroup`` / ``resolve_group`` (parallel/pairing.py) and ``ParallelDims.sided``: a collective over a sided
group uses the group of the side of the thread that issues it, not of the side that built the object holding it
(a KCP context built by a paired forward on side 1, its backward run on side 0). The multi-process check is
tests/integration/test_overlap_ep.py (cp 2 x ep 2: ``cp`` and ``cp_pair`` both used, traces equal)."""
from __future__ import annotations

import threading

import pytest

from parallel.dims import ParallelDims
from parallel.pairing import PairExecutor, SidedGroup, resolve_group, use_side


def test_resolve_group_follows_the_calling_thread() -> None:
    g0, g1 = object(), object()
    sided = SidedGroup((g0, g1))
    assert resolve_group(sided) is g0
    with use_side(1):
        assert resolve_group(sided) is g1
    assert resolve_group(sided) is g0
    seen: dict[str, object] = {}
    pair = PairExecutor()
    try:  # built on side 0, resolved on the pair worker (side 1) and on the main thread (side 0) at once
        pair.run(lambda: seen.setdefault("worker", resolve_group(sided)),
                 lambda: seen.setdefault("main", resolve_group(sided)), "worker", "main")
    finally:
        pair.close()
    assert seen == {"worker": g1, "main": g0}
    for plain in (None, g0, "sim"):  # anything else passes through
        assert resolve_group(plain) is plain


def test_sided_group_needs_every_side() -> None:
    with pytest.raises(ValueError, match="each side"):
        SidedGroup((object(), None))
    with use_side(2), pytest.raises(RuntimeError, match="side 2"):
        resolve_group(SidedGroup((object(), object())))


def test_dims_sided_only_with_a_twin() -> None:
    dims = ParallelDims(cp=2, world_size=2)
    cp, twin = object(), object()
    dims.groups.update(cp=cp)
    assert dims.sided("cp") is cp  # no twin: the plain group
    assert dims.sided("dp") is None
    dims.groups["cp_pair"] = twin
    s = dims.sided("cp")
    assert isinstance(s, SidedGroup) and s.groups == (cp, twin)
    assert threading.current_thread() is threading.main_thread()
