"""What the step-time model reads of a config once: its parameters per piece (from the meta-device model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k3train.model.model import K3Model
from k3train.optim.newton_schulz import ns_flops
from k3train.optim.param_groups import build_param_infos
from moonep.shard import is_expert_param, mark_expert_params


@dataclass
class ParamFacts:
    """Per piece (``'embed'``, layer index, ``'head'``): ``(dense numel, expert numel, muon NS FLOPs dense,
    expert NS FLOPs, largest dense numel)`` and the ``ParamInfo`` list (cpu optimizer timing)."""
    pieces: dict[Any, list[float]]
    infos: list[Any]
    piece_of: dict[str, Any]

    @classmethod
    def build(cls, cfg: Any) -> "ParamFacts":
        with torch.device("meta"):
            m = K3Model(cfg.model, cfg.vision)
        mark_expert_params(m)
        infos = build_param_infos([m], cfg.optim)
        pieces: dict[Any, list[float]] = {}
        piece_of = {}
        for inf in infos:
            head = inf.fqn.split(".")
            # the vision tower lives with the embedding on the first stage (its own key: the last stage's MTP
            # copy of the shared embedding holds embed_tokens only)
            key: Any = int(head[1]) if head[0] == "layers" else (
                "embed" if head[0] == "embed_tokens" else "vision" if head[0] == "vision" else "head")
            piece_of[inf.fqn] = key
            p = pieces.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0.0])
            ex = is_expert_param(inf.param)
            ns = sum(ns_flops(s, cfg.optim.ns_steps) for s in inf.ns_shapes())
            p[1 if ex else 0] += inf.numel
            p[3 if ex else 2] += ns
            if not ex:
                p[4] = max(p[4], inf.numel)
        return cls(pieces=pieces, infos=infos, piece_of=piece_of)

    def stage_keys(self, part: Any, pp_rank: int) -> list[Any]:
        keys: list[Any] = []
        for v in part.local_stages(pp_rank):
            s, e = part.bounds[v]
            keys += list(range(s, e))
            if v == 0:
                keys += ["embed", "vision"]
            if v == part.num_stages - 1:
                keys.append("head")
                if part.pp > 1 and "embed" not in keys:
                    keys.append("embed")  # the MTP's copy of the shared embedding (stage.shares_embedding)
        return keys

    def chunk_numel(self, part: Any, v: int, ep: int) -> float:
        """Parameters (experts: this rank's 1/ep) of virtual stage ``v``."""
        s, e = part.bounds[v]
        keys: list[Any] = list(range(s, e)) + (["embed", "vision"] if v == 0 else [])
        if v == part.num_stages - 1:
            keys += ["head"] + (["embed"] if part.pp > 1 and v != 0 else [])
        return sum(self.pieces.get(k, [0.0] * 5)[0] + self.pieces.get(k, [0.0] * 5)[1] / ep for k in keys)

    def stage_numel(self, part: Any, pp_rank: int, ep: int) -> tuple[float, float, float]:
        """``(dense, expert on this rank, largest dense parameter)``."""
        d = e = big = 0.0
        for k in self.stage_keys(part, pp_rank):
            p = self.pieces.get(k, [0.0] * 5)
            d, e, big = d + p[0], e + p[1] / ep, max(big, p[4])
        return d, e, big


def opt_sig(inf: Any) -> str:
    """The signature of a parameter's update (kind, layout, shape, heads, segments): what its time depends on."""
    return f"{inf.kind}|{inf.layout}|{tuple(inf.param.shape)}|{inf.heads}|{tuple(inf.segments)}"
