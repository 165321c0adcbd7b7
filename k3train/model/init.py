"""Name-seeded parameter initialisation: every parameter's values depend only on ``(seed, its FQN)``.

Each parameter is filled from its own ``torch.Generator`` seeded by a stable 64-bit hash of ``"{seed}:{fqn}"``
(blake2b; Python's ``hash`` is salted per process), on the CPU, then copied to the parameter's device/dtype. So a
pipeline chunk, a pruned model or a model built on the meta device and materialised with ``to_empty`` gets exactly
the values the full single-process model gets. Routed-expert stacks ``[E, ., .]`` are seeded per GLOBAL expert
(``"{seed}:{fqn}[{e}]"``), so an expert-parallel shard holding experts ``[e0, e0 + E_local)`` (its
``GroupedExperts.expert_offset = e0``; 0 when absent) gets the slices of the full tensor.

Rules (``std = init_std``, ``L = num_hidden_layers``), decided by module type and parameter name; an unknown
parameter is an error (so a new parameter kind must be given a rule here):

=================================================  ========================================================
RMSNorm / LayerNorm ``weight``                      ones
vision ``pos_embed.weight`` (2D position table)     N(0, vision std)
AttnRes pseudo-query ``query``                      zeros (every aggregation starts as a uniform average)
EAGLE-3 fusion ``eagle3.weight`` (W_E3 [d, 3d])     [0 0 I]: the fused feature starts as the high-level one
KDA ``A_log`` (A_h)                                 zeros (spec: A_h init 0)
KDA ``dt_bias`` (decay bias b_a)                    Mamba/Kimi-Linear style: per channel dt ~ LogUniform[1e-3, 1e-1]
                                                    and b_a chosen so the initial log decay is g = -dt (retention
                                                    e^-dt in [0.905, 0.999]): lower_bounded b = logit(dt/|g_min|),
                                                    softplus b = softplus^-1(dt)
ShortConv ``weight [C, 1, K]``                      U(-1/sqrt(K), 1/sqrt(K)) (nn.Conv1d's default, fan_in = K)
output projections (residual-stream writers):       N(0, std / sqrt(2 L)) (GPT-2/Megatron scaled init: 2 writers
  KDA/MLA ``o_proj``, FFN ``w_down``, LatentMoE      per layer)
  ``latent_up``, routed experts ``w_down``
every other matrix (Linear weights, embedding,      N(0, std)
  router, MTP ``eh_proj``, experts ``w_gate/w_up``)
biases                                              zeros
=================================================  ========================================================

Under ``vision.`` (the MoonViT-V2 tower) ``std = vision.init_std``, ``L = vision.num_hidden_layers`` and the
residual writers are the blocks' ``o_proj`` and ``fc2``.

Buffers are reset too (a meta-built model's buffers are garbage after ``to_empty``): every module owning buffers
must provide ``reset_buffers()`` (Router: zero bias and statistics; MLA: zero ``qk_max``). Parameter attributes the
optimizer reads (per-head Muon marks) are re-applied through each module's ``mark_param_attrs()``, because
``to_empty`` from the meta device creates new Parameter objects and drops them.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
from torch import nn

from k3train.model.attnres import AttnRes
from k3train.model.conv import ShortConv
from k3train.model.eagle3 import Eagle3Fusion
from k3train.model.kda import KDALayer
from k3train.model.norm import RMSNorm
from k3train.model.vit import PositionEmbedding2D

# parameter names (last FQN component, with their owner's attribute name) that write into the residual stream
_OUTPUT_PROJ_OWNERS = ("o_proj", "w_down", "latent_up")
_VISION_OUTPUT_PROJ_OWNERS = ("o_proj", "fc2")  # the vision blocks' residual writers (std / sqrt(2 vision layers))
DT_MIN, DT_MAX = 1e-3, 1e-1


def param_seed(seed: int, fqn: str) -> int:
    """Stable 63-bit generator seed for ``(seed, fqn)``."""
    digest = hashlib.blake2b(f"{seed}:{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _gen(seed: int, fqn: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(param_seed(seed, fqn))
    return g


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)


def decay_bias(n: int, form: str, lower_bound: float, g: torch.Generator) -> torch.Tensor:
    """KDA decay bias b_a ``[n]`` such that at z = b_a (zero projection, A_h = 0) the log decay is ``-dt``,
    ``dt ~ LogUniform[DT_MIN, DT_MAX]``."""
    u = torch.rand(n, dtype=torch.float64, generator=g)
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    if form == "lower_bounded":
        p = dt / abs(lower_bound)  # g = lower_bound * sigmoid(b) = -dt
        return torch.log(p / (1 - p)).float()
    if form == "softplus":
        return (dt + torch.log(-torch.expm1(-dt))).float()  # softplus^-1(dt)
    raise ValueError(f"model.kda_decay_form must be 'lower_bounded' or 'softplus', got {form!r}")


def _rule(module: nn.Module, mod_name: str, pname: str, cfg: Any,
          vcfg: Any = None) -> Callable[[tuple[int, ...], torch.Generator], torch.Tensor]:
    """The fill function for parameter ``pname`` of ``module`` (see the table in the module docstring)."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.num_hidden_layers)
    out_owners = _OUTPUT_PROJ_OWNERS
    if vcfg is not None and mod_name.split(".", 1)[0] == "vision":  # the vision tower: its own std and depth
        std, out_owners = vcfg.init_std, _VISION_OUTPUT_PROJ_OWNERS
        out_std = std / math.sqrt(2 * vcfg.num_hidden_layers)
    owner = mod_name.rsplit(".", 1)[-1]
    if isinstance(module, (RMSNorm, nn.LayerNorm)) and pname == "weight":
        return lambda shape, g: torch.ones(shape)
    if isinstance(module, PositionEmbedding2D) and pname == "weight":
        return lambda shape, g: _normal(shape, std, g)
    if isinstance(module, AttnRes) and pname == "query":
        return lambda shape, g: torch.zeros(shape)
    if isinstance(module, Eagle3Fusion) and pname == "weight":
        return lambda shape, g: Eagle3Fusion.initial_weight(shape)
    if isinstance(module, KDALayer) and pname == "A_log":
        return lambda shape, g: torch.zeros(shape)
    if isinstance(module, KDALayer) and pname == "dt_bias":
        return lambda shape, g: decay_bias(shape[0], cfg.kda_decay_form, cfg.gate_lower_bound, g)
    if isinstance(module, ShortConv) and pname == "weight":
        bound = 1.0 / math.sqrt(module.kernel_size)
        return lambda shape, g: torch.empty(shape).uniform_(-bound, bound, generator=g)
    if pname == "bias":
        return lambda shape, g: torch.zeros(shape)
    if isinstance(module, (nn.Linear, nn.Embedding)) and pname == "weight":
        s = out_std if owner in out_owners else std
        return lambda shape, g: _normal(shape, s, g)
    if type(module).__name__ == "Router" and pname == "weight":
        return lambda shape, g: _normal(shape, std, g)
    if type(module).__name__ == "GroupedExperts" and pname in ("w_gate", "w_up", "w_down"):
        s = out_std if pname in _OUTPUT_PROJ_OWNERS else std
        return lambda shape, g: _normal(shape, s, g)
    raise ValueError(f"init_weights: no initialisation rule for parameter {mod_name + '.' + pname!r} "
                     f"({type(module).__name__}); add one to k3train/model/init.py")


@torch.no_grad()
def init_model_weights(model: nn.Module, cfg: Any, seed: int) -> None:
    """Initialise every parameter of ``model`` by the rules above and reset every buffer (no communication).
    A model with a vision tower carries its VisionConfig as ``model.vision_cfg`` (its std and depth)."""
    vcfg = getattr(model, "vision_cfg", None)
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if p.is_meta:
                raise ValueError(f"init_weights: parameter {fqn!r} is on the meta device; call to_empty() first")
            fill = _rule(module, mod_name, pname, cfg, vcfg)
            if type(module).__name__ == "GroupedExperts":
                offset = int(getattr(module, "expert_offset", 0))
                for e in range(p.shape[0]):
                    p[e].copy_(fill(tuple(p.shape[1:]), _gen(seed, f"{fqn}[{offset + e}]")))
            else:
                p.copy_(fill(tuple(p.shape), _gen(seed, fqn)))
        mark = getattr(module, "mark_param_attrs", None)
        if mark is not None:  # optimizer tags (per-head Muon) live on Parameter objects, which to_empty replaces
            mark()
        if any(True for _ in module.named_buffers(recurse=False)):
            reset = getattr(module, "reset_buffers", None)
            if reset is None:
                names = [n for n, _ in module.named_buffers(recurse=False)]
                raise ValueError(f"init_weights: module {mod_name!r} ({type(module).__name__}) has buffers {names} "
                                 "but no reset_buffers()")
            reset()
