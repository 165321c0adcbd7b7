"""Expert sharding without processes: a meta-built tiny K3Model, sharded, materialised and name-seed initialised
holds exactly the slices of the full model's expert stacks, with the marks the gradient reduction and the
checkpoint need."""
from __future__ import annotations

import torch

from k3train.config import load_config
from k3train.model import K3Model
from moonep import is_expert_param, mark_expert_params, param_reduce_group
from moonep.shard import EXPERT_PARAM_NAMES, shard_experts


class _Dims:  # the two groups param_reduce_group asks for
    def group(self, name: str) -> str:
        return name


def test_meta_shard_materialise_init() -> None:
    cfg = load_config("configs/tiny.yaml", []).model
    full = K3Model(cfg)
    full.init_weights(3)
    ep, rank = 4, 3
    with torch.device("meta"):
        model = K3Model(cfg)
    moes = [m for m in model.modules() if type(m).__name__ == "LatentMoE"]
    for m in moes:
        shard_experts(m.experts, ep, rank)
    model = model.to_empty(device="cpu")
    model.init_weights(3)
    assert mark_expert_params(model) == 3 * len(moes)
    n = cfg.num_experts // ep
    full_p = dict(full.named_parameters())
    for name, p in model.named_parameters():
        if name.split(".")[-1] in EXPERT_PARAM_NAMES and ".experts." in name:
            assert is_expert_param(p) and p._k3_shard_offset == rank * n
            assert p._k3_global_shape == tuple(full_p[name].shape)
            assert torch.equal(p, full_p[name][rank * n:(rank + 1) * n])
            assert param_reduce_group(name, p, _Dims()) == "edp"
        else:
            assert not is_expert_param(p) and torch.equal(p, full_p[name]), name
            assert param_reduce_group(name, p, _Dims()) == "dp_cp"
