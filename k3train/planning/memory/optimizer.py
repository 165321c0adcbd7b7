"""The optimizer's memory: its state per owned parameter, and the peak temporaries of one update (traced)."""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.optim.muon import HParams, adamw_step_, muon_step_
from k3train.planning.fakerun.known_data import KnownData
from k3train.planning.fakerun.live_bytes import LiveBytes
from k3train.planning.memory.trace import track_existing


def optimizer_state_bytes(infos: list[Any], owned: set[int]) -> int:
    """The optimizer state of the owned parameters: fp32 Muon momentum (one) or AdamW moments (two, and a step
    count), and an fp32 master copy of every non-fp32 weight."""
    opt = 0
    for inf in infos:
        if inf.index in owned:
            n = inf.numel
            opt += n * 4 * (1 if inf.kind == "muon" else 2) + (4 if inf.kind != "muon" else 0)
            if inf.param.dtype != torch.float32:
                opt += n * 4
    return opt


def optimizer_transient(cfg: Config, infos: list[Any], owned: set[int], fake: FakeTensorMode,
                        cache: dict[tuple, int]) -> int:
    """Peak temporaries of one parameter update (the real ``muon_step_``/``adamw_step_`` on fake tensors) --
    the update runs one parameter at a time, so the largest over the owned parameters (``cache``: per kind,
    layout and shape)."""
    hp = HParams.from_config(cfg.optim, 1e-3)
    best = 0
    for inf in infos:
        if inf.index not in owned:
            continue
        key = (inf.kind, inf.layout, tuple(inf.param.shape), inf.heads, inf.segments, inf.param.dtype)
        if key not in cache:
            lb = LiveBytes()
            with fake:
                w = torch.empty(inf.param.shape, dtype=torch.float32)
                st = [torch.zeros_like(w) for _ in range(2)]
            step = torch.zeros(())  # real, as the optimizer keeps it (read on the host every step)
            with fake, KnownData(), lb:
                track_existing(lb, None, [w, step, *st], inf.param, inf.param.grad)
                base = lb.live
                g = inf.param.grad.float() if inf.param.grad is not None else torch.zeros_like(w)
                if inf.kind == "muon":
                    muon_step_(w, g, st[0], hp, inf)
                else:
                    adamw_step_(w, g, st[0], st[1], step, hp, inf.decay)
                cache[key] = lb.peak - base
        best = max(best, cache[key])
    return best
