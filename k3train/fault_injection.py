"""Test-only fault injection: hold a rank at a named point so that a test can kill it inside a window it observes.

``K3TRAIN_FAULT_PAUSE=<point>:<step>:<seconds>`` makes :func:`pause_point` called at ``<point>`` for ``<step>``
(``<step>+``: that step or any later one) append ``<point> <step> rank=<r>`` to the file
``$K3TRAIN_FAULT_PAUSE_LOG`` (when set) and then sleep ``<seconds>``.
Unset -- every real run -- it costs one environment lookup. Points:

``checkpoint_before_complete``
    ``CheckpointManager._finish`` (synchronous and background saves): every rank wrote its DCP shards and rank
    file, ``COMPLETE`` is not written yet.
    A rank killed there must leave the previous checkpoint the one a re-run resumes
    (``tests/train/test_fault_tolerance.py``).
"""
from __future__ import annotations

import os
import time

ENV = "K3TRAIN_FAULT_PAUSE"
LOG_ENV = "K3TRAIN_FAULT_PAUSE_LOG"


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
