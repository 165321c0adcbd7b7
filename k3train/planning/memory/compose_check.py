"""``tools/memory.py --check-compose``: the per-layer composition against whole-chunk traces."""
from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.planning.fakerun.synthetic import trace_batch
from k3train.planning.memory.chunk import trace_chunk
from k3train.planning.memory.fake_model import build_full
from parallel.pipeline.partition import build_partition


def compose_check(cfg: Config) -> list[dict[str, Any]]:
    """The per-layer composition (what K3-length sequences use) against a whole-chunk trace, for a config short
    enough to trace whole: per pipeline stage and CP rank, ``(saved, f_peak, b_peak)`` both ways, on synthetic
    rows (one document per row). ``tools/memory.py --check-compose``."""
    part = build_partition(cfg.model, cfg.parallel, cfg.train.seq_len)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    full = build_full(cfg, cfg.parallel.ep, 0, fake)
    C, B = cfg.parallel.cp, cfg.train.micro_batch_size
    T = cfg.train.seq_len // C
    row = [trace_batch(cfg, B, T, r)[0] for r in range(C)]
    cache: dict = {}
    out = []
    for cr in range(C):
        for v in range(part.num_stages):
            whole = trace_chunk(cfg, full, part, None, v, 0, row[cr], fake, None, None, cr, (row, None))
            comp = trace_chunk(cfg, full, part, None, v, 0, row[cr], fake, cache, None, cr, whole=False)
            out.append({"stage": v, "cp_rank": cr, "whole": [whole.saved, whole.f_peak, whole.b_peak],
                        "composed": [comp.saved, comp.f_peak, comp.b_peak]})
    return out
