"""K2.5-format (Hugging Face ``kimi_k25``) vision towers in k3train: the config fields and the weight names.

The start of the HF import: :func:`vision_overrides_from_hf` turns a ``Kimi_K25VisionConfig`` (as a dict) into
``vision`` section values (MoonViT-3D: LayerNorm with biases, bicubic position interpolation, a final LayerNorm,
the projector's per-patch pre-norm, exact GELU in the projector), and :func:`hf_vision_state_dict` renames a
checkpoint's ``vision_tower.*`` / ``mm_projector.*`` tensors to K3Model FQNs (``vision.encoder.*`` /
``vision.projector.*``). The patch conv ``[D, 3, p, p]`` becomes our ``[D, 3 p p]`` matmul weight. Tested against
transformers' own modules (tests/model/test_vit_hf.py).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from torch import Tensor

_HF_ACT = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}

# (HF name pattern after the prefix, our name relative to K3Model.vision)
_TOWER_RULES = (
    (r"patch_embed\.proj\.(weight|bias)", r"encoder.patch_embed.\1"),
    (r"patch_embed\.pos_emb\.position_embeddings", r"encoder.pos_embed.weight"),
    (r"layers\.(\d+)\.(norm1|norm2)\.(weight|bias)", r"encoder.blocks.\1.\2.\3"),
    (r"layers\.(\d+)\.attn\.(q_proj|k_proj|v_proj)\.(weight|bias)", r"encoder.blocks.\1.attn.\2.\3"),
    (r"layers\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.blocks.\1.attn.o_proj.\2"),
    (r"layers\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"encoder.blocks.\1.mlp.\2.\3"),
    (r"final_layernorm\.(weight|bias)", r"encoder.final_norm.\1"),
)
_PROJECTOR_RULES = ((r"(pre_norm|in_proj|out_proj)\.(weight|bias)", r"projector.\1.\2"),)


def vision_overrides_from_hf(hf_vision: Mapping[str, Any], projection_layer_norm_eps: float = 1e-5) -> dict[str, Any]:
    """``vision`` section values for a K2.5-format tower from its HF ``vision_config`` (a dict)."""
    D, H = int(hf_vision["hidden_size"]), int(hf_vision["num_attention_heads"])
    merge = list(hf_vision.get("merge_kernel_size", (2, 2)))
    if merge != [2, 2]:
        raise ValueError(f"kimi_k25 merge_kernel_size {merge}: only (2, 2) (sd2_tpool) is supported")
    rope = hf_vision.get("rope_parameters") or {}
    act = hf_vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _HF_ACT:
        raise ValueError(f"kimi_k25 hidden_act {act!r} is not supported (known: {', '.join(_HF_ACT)})")
    return {
        "enabled": True, "num_hidden_layers": int(hf_vision["num_hidden_layers"]), "hidden_size": D,
        "num_attention_heads": H, "head_dim": D // H, "intermediate_size": int(hf_vision["intermediate_size"]),
        "hidden_act": _HF_ACT[act], "patch_size": int(hf_vision["patch_size"]),
        "pos_emb_height": int(hf_vision["pos_emb_height"]), "pos_emb_width": int(hf_vision["pos_emb_width"]),
        "pos_emb_interpolation": "bicubic", "pos_emb_time": int(hf_vision["pos_emb_time"]),
        "rope_theta": float(rope.get("rope_theta", 10000.0)), "attention": "joint",
        "norm": "layernorm", "norm_eps": float(projection_layer_norm_eps), "bias": True, "final_norm": True,
        "merge_size": 2, "projector_hidden_size": 4 * D, "projector_act": "gelu", "projector_norm": "pre",
    }


def _rename(name: str, rules: tuple[tuple[str, str], ...]) -> str | None:
    for pat, repl in rules:
        if re.fullmatch(pat, name):
            return re.sub(pat, repl, name)
    return None


def hf_vision_state_dict(sd: Mapping[str, Tensor], prefix: str = "vision.") -> dict[str, Tensor]:
    """HF ``kimi_k25`` vision tensors -> K3Model names (``prefix`` + ``encoder.*`` / ``projector.*``).

    Accepts the full checkpoint's ``model.vision_tower.* / model.mm_projector.*`` (other tensors are skipped) or
    the modules' own state dicts prefixed ``vision_tower.`` / ``mm_projector.``. A vision tensor no rule maps
    is a ``ValueError`` (a silently dropped weight would be a wrong model)."""
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        base = name[len("model."):] if name.startswith("model.") else name
        for head, rules in (("vision_tower.", _TOWER_RULES), ("mm_projector.", _PROJECTOR_RULES)):
            if base.startswith(head):
                ours = _rename(base[len(head):], rules)
                if ours is None:
                    raise ValueError(f"hf_vision_state_dict: no mapping for {name!r}")
                if ours == "encoder.patch_embed.weight":
                    t = t.reshape(t.shape[0], -1)  # conv [D, 3, p, p] -> matmul [D, 3 p p]
                out[prefix + ours] = t
    return out
