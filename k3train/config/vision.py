"""The ``vision`` section: the MoonViT-V2 encoder + projector (k3train/model/vit.py); and its check, run only
when the encoder is enabled."""
from __future__ import annotations

from dataclasses import dataclass

from k3train.config.model import ModelConfig
from k3train.config.report import Need


@dataclass
class VisionConfig:
    """MoonViT-V2 vision encoder + projector (k3train/model/vit.py, vit_tower.py). Defaults are K3's (seed 000);
    the K2.5-format fields (norm kind, biases, interpolation, projector norm position, final norm) express
    Hugging Face ``kimi_k25``'s MoonViT-3D (k3train/model/vit_hf.py)."""

    enabled: bool = False  # false: a text-only model (no vision parameters, embed() ignores media)
    num_hidden_layers: int = 27
    hidden_size: int = 1024
    num_attention_heads: int = 12
    head_dim: int = 128  # q, k, v are hidden_size -> num_attention_heads * head_dim (1536)
    intermediate_size: int = 4096  # MLP hidden_size -> intermediate_size -> hidden_size
    hidden_act: str = "gelu_tanh"  # encoder MLP activation: "gelu_tanh" | "gelu" (exact erf)
    patch_size: int = 14  # square patches; pixel_values [N, 3, patch_size, patch_size]
    pos_emb_height: int = 64  # learnable 2D position table, interpolated to each media's patch grid
    pos_emb_width: int = 64
    pos_emb_interpolation: str = "bilinear"  # "bilinear" (V2) | "bicubic" (K2.5); align_corners=False
    pos_emb_time: int = 4  # frames of the fixed sinusoidal temporal table: the most frames one clip may have
    rope_theta: float = 10000.0  # 2D RoPE on q, k (half the rotary pairs by column, half by row)
    attention: str = "joint"  # "joint" spatio-temporal per clip (published code) | "factorised" (paper)
    norm: str = "rmsnorm"  # "rmsnorm" (V2) | "layernorm" (K2.5); also the projector's norm
    norm_eps: float = 1e-5
    bias: bool = False  # biases on the patch conv and every linear layer (K2.5: true)
    final_norm: bool = False  # a norm after the last block, before the merge (K2.5: true)
    merge_size: int = 2  # sd2_tpool: merge_size x merge_size neighbours concatenated, mean over frames
    projector_hidden_size: int = 4096  # projector: merged (hidden * merge^2) -> this -> model.hidden_size
    projector_act: str = "gelu"  # "gelu" (exact erf, as kimi_k25's nn.GELU()) | "gelu_tanh"
    projector_norm: str = "post"  # "post": norm(model.hidden_size) after (V2) | "pre": per patch before (K2.5)
    init_std: float = 0.02  # N(0, std) for matrices; output projections (o_proj, fc2) std / sqrt(2 layers)
    # context parallel (cp > 1): media of >= this many patches (t*h*w) are split over the CP group in pairs of
    # patch rows, the others encoded whole by one rank, each media once per CP group (kcp/vision_cp.py);
    # 0: every CP rank encodes every media of its rows (redundantly). 4096 = a 896 x 896 px image
    cp_split_min_patches: int = 4096


def check_vision(v: VisionConfig, m: ModelConfig, need: Need) -> None:
    if not v.enabled:
        return
    for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "intermediate_size",
              "patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time", "projector_hidden_size"):
        need(getattr(v, k) >= 1, f"vision.{k}", f"must be >= 1, got {getattr(v, k)}")
    need(v.head_dim % 4 == 0, "vision.head_dim",
         f"must be a multiple of 4 (2D RoPE: half the rotary pairs by row, half by column), got {v.head_dim}")
    need(v.hidden_size % 2 == 0, "vision.hidden_size",
         f"must be even (the sinusoidal temporal table pairs sin and cos), got {v.hidden_size}")
    need(v.merge_size == 2, "vision.merge_size", f"only the sd2_tpool merge (2) is implemented, got "
         f"{v.merge_size}")
    for k, ok in (("hidden_act", ("gelu_tanh", "gelu")), ("projector_act", ("gelu_tanh", "gelu")),
                  ("pos_emb_interpolation", ("bilinear", "bicubic")), ("attention", ("joint", "factorised")),
                  ("norm", ("rmsnorm", "layernorm")), ("projector_norm", ("post", "pre"))):
        need(getattr(v, k) in ok, f"vision.{k}", f"must be one of {', '.join(ok)}, got {getattr(v, k)!r}")
    for k in ("norm_eps", "rope_theta", "init_std"):
        need(getattr(v, k) > 0, f"vision.{k}", f"must be > 0, got {getattr(v, k)}")
    need(isinstance(v.cp_split_min_patches, int) and v.cp_split_min_patches >= 0,
         "vision.cp_split_min_patches", f"must be an integer >= 0 (0: never split), got "
         f"{v.cp_split_min_patches!r}")
    check_placeholder_id(m, need)


def check_placeholder_id(m: ModelConfig, need: Need) -> None:
    """Cross-section: the encoder's outputs replace the embeddings of ``model.media_placeholder_token_id``,
    which must be a token of the vocabulary."""
    need(0 <= m.media_placeholder_token_id < m.vocab_size, "model.media_placeholder_token_id",
         f"vision.enabled needs a placeholder id in [0, vocab_size={m.vocab_size}), got "
         f"{m.media_placeholder_token_id}", "model.media_placeholder_token_id", "vision.enabled")
