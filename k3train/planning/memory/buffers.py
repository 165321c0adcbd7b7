"""Buffers computed from the code's own size formulas (no process group to trace them): the pipeline's AttnRes
payloads, the EP token buffers and MoonEP's replica pool, the ZeRO reduction's bucket copy."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from k3train.config import Config
from k3train.model.moe import LatentMoE
from k3train.planning.dtypes import dtype_bytes
from moonep.comm import token_buffer_rows
from moonep.replica_pool import NUM_BANKS


def payload_tensors(plan: Any, boundary: int) -> int:
    """Hidden-state-sized tensors of the cached AttnRes plan's payload across ``boundary`` (one micro-batch)."""
    return len(plan.payload(boundary).items())


def plan_bytes(plan: Any, boundary: int, B: int, T: int, d: int, dtype: torch.dtype) -> int:
    """Bytes of the p2p payload across ``boundary`` for one micro-batch (AttnRes cached plan)."""
    if plan is None or boundary < 0:
        return 0
    n = payload_tensors(plan, boundary)
    return n * B * T * d * torch.empty((), dtype=dtype).element_size()


def ep_buffers(cfg: Config, model: nn.Module, ep: int, B: int, T: int) -> tuple[int, int, int]:
    """``(persistent buffers, bytes of one MoE layer's replicas, MoE layers held)``: the EP token send/receive
    buffers and MoonEP's replica pool (``moonep.replica_pool``: NUM_BANKS banks of ``[E/ep, l, f] x 3`` shared by
    every MoE layer, allocated at the first dispatch)."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if ep == 1 or not moes:
        return 0, 0, len(moes)
    m = cfg.model
    es = dtype_bytes(cfg)
    n = m.num_experts // ep
    # one dispatch per token chunk of a LatentMoE (model.moe_token_chunk): the buffers hold one chunk's rows
    n_tok = min(B * T, m.moe_token_chunk) if m.moe_token_chunk > 0 else B * T
    send, recv = token_buffer_rows(n_tok, m.num_experts_per_token, ep, n, cfg.parallel.moonep)
    persistent = (send + recv) * m.expert_hidden_size * es
    replica = 3 * n * m.expert_hidden_size * m.moe_intermediate_size * es if cfg.parallel.moonep else 0
    if replica:
        persistent += NUM_BANKS * replica
    return persistent, replica, len(moes)


def bucket_transient(infos: list[Any], owned: set[int], zero: int) -> int:
    """The reduction's flat bucket copy (``DistributedOptimizer._launch``: up to 64 MiB, torch.cat)."""
    cap = 64 * 2**20
    biggest = max((inf.numel * inf.param.element_size() for inf in infos), default=0)
    return min(cap, biggest) if zero < 2 else 0
