"""Shared pieces of the MoonEP distributed tests: a tiny LatentMoE (its config: k3train/config/presets.py) and the
single-process reference."""
from __future__ import annotations

import copy

import torch

from k3train.config.presets import TINY_MOE, tiny_moe_config
from k3train.model.moe import LatentMoE

# the preset's sizes: hidden, latent, expert FFN, routed experts, experts per token
D, L, F, E, K = (TINY_MOE[k] for k in ("hidden_size", "routed_expert_hidden_size", "moe_intermediate_size",
                                       "num_experts", "num_experts_per_token"))


def build_moe(seed: int = 0, **over) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(tiny_moe_config(**over))
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
