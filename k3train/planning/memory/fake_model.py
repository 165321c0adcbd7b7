"""The model on fake tensors: the whole model once per ep, each pipeline rank's real stage cut from it."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.model import K3Model
from k3train.model.moe import LatentMoE, LocalDispatcher
from k3train.parallelize import cast_params_to_bf16
from moonep.shard import shard_experts
from parallel.pipeline.stage import prune_to_stage


class _ShardDispatcher:
    """Stand-in for ``EPDispatcher`` at ep > 1 (no process group): the rank's expert shard computes the N*k
    route rows locally, the routes folded onto the shard (``idx mod E/ep``), through the real LocalDispatcher."""

    def __init__(self) -> None:
        self.local = LocalDispatcher()

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: Any) -> Any:
        return self.local(x, topk_idx % experts.num_experts, topk_weight, experts)


def build_full(cfg: Config, ep: int, ep_rank: int, fake: FakeTensorMode) -> nn.Module:
    """The whole model on fake tensors, experts sharded for ``ep_rank``, dtype cast, ``.grad`` pre-set (so a
    trace books only the step's new tensors; the gradient bytes are counted from the parameters)."""
    with fake:
        m = K3Model(cfg.model, cfg.vision)
        if ep > 1:
            for moe in [x for x in m.modules() if isinstance(x, LatentMoE)]:  # in forward order
                shard_experts(moe.experts, ep, ep_rank)
                moe.dispatcher = _ShardDispatcher()
        if cfg.train.dtype == "bfloat16":
            cast_params_to_bf16([m])
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    m.train()
    return m


def build_stage(full: nn.Module, part: Any, pp_rank: int) -> nn.Module:
    """This rank's real stage (``prune_to_stage``) as a shallow copy of ``full`` sharing its layer modules."""
    m = copy.copy(full)
    m._modules = dict(full._modules)
    m.layers = nn.ModuleDict(dict(full.layers.items()))
    return prune_to_stage(m, part, pp_rank)
