"""Test-only fault injection: hold a rank at a named point so that a test can kill it inside a window it observes,
or make a named point raise.

``K3TRAIN_FAULT_PAUSE=<point>:<step>:<seconds>`` makes :func:`pause_point` called at ``<point>`` for ``<step>``
(``<step>+``: that step or any later one) append ``<point> <step> rank=<r>`` to the file
``$K3TRAIN_FAULT_PAUSE_LOG`` (when set) and then sleep ``<seconds>``.
Unset -- every real run -- it costs one environment lookup. Points:

``checkpoint_before_complete``
    ``CheckpointManager._finish`` (synchronous and background saves): every rank wrote its DCP shards and rank
    file, ``COMPLETE`` is not written yet.
    A rank killed there must leave the previous checkpoint the one a re-run resumes
    (``tests/train/test_fault_tolerance.py``).

``K3TRAIN_FAULT_RAISE=<point>:<index>[:<rank>]`` makes :func:`raise_point` called at ``<point>`` with ``<index>``
raise :class:`InjectedFault` (on global rank ``<rank>`` only, when given). Points:

``pair_forward`` / ``pair_backward``
    the start of the forward / backward of micro-batch ``<index>`` inside a paired action of F/B pairing
    (``parallel.overlap_ep``, parallel/pipeline/runner.py): the forward runs on the pair worker thread
    (``tests/parallel/test_overlap_ep.py``).
"""
from __future__ import annotations

import os
import time

ENV = "K3TRAIN_FAULT_PAUSE"
LOG_ENV = "K3TRAIN_FAULT_PAUSE_LOG"
RAISE_ENV = "K3TRAIN_FAULT_RAISE"


class InjectedFault(RuntimeError):
    """Raised by :func:`raise_point` (tests only)."""


def pause_point(point: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, want, seconds = spec.split(":")
    hit = step >= int(want[:-1]) if want.endswith("+") else step == int(want)
    if name != point or not hit:
        return
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{point} {step} rank={os.environ.get('RANK', '0')}\n")
    time.sleep(float(seconds))


def raise_point(point: str, index: int) -> None:
    spec = os.environ.get(RAISE_ENV)
    if not spec:
        return
    name, want, *rank = spec.split(":")
    if name != point or int(want) != index or (rank and int(rank[0]) != int(os.environ.get("RANK", "0"))):
        return
    raise InjectedFault(f"fault injection: {point} {index} ({RAISE_ENV}={spec})")
