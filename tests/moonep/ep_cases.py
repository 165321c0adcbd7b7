"""Shared pieces of the MoonEP distributed tests: a tiny LatentMoE config and the single-process reference."""
from __future__ import annotations

import copy

import torch

from k3train.config import ModelConfig
from k3train.model.moe import LatentMoE

D, L, F, E, K = 32, 16, 16, 8, 2


def tiny_cfg(**over) -> ModelConfig:
    kw = dict(hidden_size=D, routed_expert_hidden_size=L, moe_intermediate_size=F, num_experts=E,
              num_experts_per_token=K, num_shared_experts=1, shared_expert_intermediate_size=16, qb_bins=64)
    kw.update(over)
    return ModelConfig(**kw)


def build_moe(seed: int = 0, **over) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(tiny_cfg(**over))
    with torch.no_grad():  # larger router weights so routing is decisive and varied
        moe.router.weight.normal_(0.0, 0.5)
    return moe


def skew_router(moe: LatentMoE, experts: list[int]) -> None:
    """Bias the router so every token picks ``experts`` (selection only; mixing weights unchanged)."""
    with torch.no_grad():
        moe.router.bias.zero_()
        moe.router.bias[experts] = 100.0


def clone(moe: LatentMoE) -> LatentMoE:
    return copy.deepcopy(moe)
