"""Parameter bookkeeping and model FLOPs per token (for MFU).

``param_breakdown(model, cfg)`` classifies every parameter of a (meta-built) :class:`K3Model` by FQN into
components and computes total and active-per-token counts:

* ``total``: backbone parameters, EXCLUDING the MTP layer, the vision encoder and its projector (the published
  2.78T).
* ``active``: ``total`` minus the input embedding (a lookup, not a matmul) minus the routed experts' unselected
  share (each token uses ``num_experts_per_token / num_experts`` of every routed-expert stack) -- the published
  104.2B.

``model_flops_per_token(cfg, seq_len)`` is an analytic count from the config (tested equal to the module
parameters): ``3 x forward``, forward = ``2 x active matmul parameters`` (incl. the LM head, excl. the embedding)
+ the sequence-mixing terms that do not live in parameters:

* Gated MLA (non-absorbed training form), per token per layer: ``2 H (d_qk + d_v) * ctx`` with the causal mean
  context ``ctx = (seq_len + 1) / 2`` (documents packed into a row are counted as if they were one document, the
  usual MFU convention).
* KDA (chunkwise form, chunk C), per token per head: ``2 C (2 d_k + d_v)`` intra-chunk (q k^T, k k^T, A v) +
  ``6 d_k d_v`` inter-chunk (q S, W S, state update) -- an estimate of the algorithm's matmul work.
* AttnRes aggregations (O(sources x d) elementwise work per sublayer) and norms are not counted.
"""
from __future__ import annotations

from typing import Any

from torch import nn

COMPONENTS = ("embedding", "kda", "mla", "dense_ffn", "shared_experts", "routed_experts", "router",
              "latent_proj", "attnres", "norms", "lm_head", "mtp", "vision", "projector")
NOT_BACKBONE = ("mtp", "vision", "projector")  # listed, but outside total / active (vision: encoder, projector)


def _classify(fqn: str, cfg: Any) -> str:
    """Component name of a parameter FQN of :class:`K3Model`."""
    parts = fqn.split(".")
    head = parts[0]
    if head == "embed_tokens":
        return "embedding"
    if head == "lm_head":
        return "lm_head"
    if head == "mtp":
        return "mtp"
    if head == "vision":
        return "projector" if len(parts) > 1 and parts[1] == "projector" else "vision"
    if head == "final_attnres":
        return "attnres"
    if head == "norm":
        return "norms"
    if head == "layers" and len(parts) >= 4:
        layer, sub = int(parts[1]), parts[2]
        if sub in ("attn_res", "ffn_res"):
            return "attnres"
        if sub in ("attn_norm", "ffn_norm"):
            return "norms"
        if sub == "attn":
            return cfg.layer_kind(layer)
        if sub == "ffn":
            if not cfg.is_moe_layer(layer):
                return "dense_ffn"
            part = parts[3]
            if part == "router":
                return "router"
            if part == "experts":
                return "routed_experts"
            if part == "shared_experts":
                return "shared_experts"
            if part in ("latent_down", "latent_up", "latent_norm"):
                return "latent_proj"
    raise ValueError(f"param_breakdown: cannot classify parameter {fqn!r}")


def param_breakdown(model: nn.Module, cfg: Any) -> dict[str, Any]:
    """``{"total", "active", "total_with_mtp", "breakdown": {component: {"total", "active"}}}`` (ints).

    Works on a meta-device model (only shapes are read). ``vision`` (the MoonViT-V2 encoder) and ``projector``
    are 0 for a text-only model.
    """
    totals = {c: 0 for c in COMPONENTS}
    for fqn, p in model.named_parameters():
        totals[_classify(fqn, cfg)] += p.numel()
    active = dict(totals)
    active["embedding"] = 0
    if cfg.num_experts > 0:
        # integer: every layer's routed stack is num_experts equal experts
        active["routed_experts"] = totals["routed_experts"] // cfg.num_experts * cfg.num_experts_per_token
    backbone = [c for c in COMPONENTS if c not in NOT_BACKBONE]
    return {
        "total": sum(totals[c] for c in backbone),
        "active": sum(active[c] for c in backbone),
        "total_with_mtp": sum(totals[c] for c in backbone) + totals["mtp"],
        "breakdown": {c: {"total": totals[c], "active": active[c] if c not in NOT_BACKBONE else 0}
                      for c in COMPONENTS},
    }


# --------------------------------------------------------------------------------------------------------------
# analytic counts from the config
# --------------------------------------------------------------------------------------------------------------
def kda_gate_params(cfg: Any) -> int:
    """Parameters of the KDA output gate: full rank ``d x H K`` (K3), or Kimi Linear's rank-K ``g_a`` / ``g_b``."""
    d, hk, K = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_head_dim
    return d * hk if cfg.use_full_rank_gate else d * K + K * hk


def moe_latent_params(cfg: Any) -> int:
    """Parameters of a MoE layer's latent down + up projections (0 without a latent projection)."""
    return 2 * cfg.hidden_size * cfg.routed_expert_hidden_size if cfg.latent_moe else 0


def _kda_matmul(cfg: Any) -> int:
    d, H, K, r = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_decay_rank
    hk = H * K
    return 3 * d * hk + d * H + d * r + r * hk + kda_gate_params(cfg) + hk * d  # q,k,v; beta; decay; gate; out


def _mla_matmul(cfg: Any) -> int:
    d, H = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * H * qk if cfg.q_lora_rank > 0 else d * H * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    gate = d * H * cfg.v_head_dim if cfg.mla_use_output_gate else 0
    return q + kv + gate + H * cfg.v_head_dim * d


def _ffn_matmul(cfg: Any, layer: int) -> int:
    """Active matmul parameters per token of layer ``layer``'s FFN."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * d * cfg.intermediate_size
    lat = cfg.expert_hidden_size
    routed = cfg.num_experts_per_token * 3 * lat * cfg.moe_intermediate_size
    shared = cfg.num_shared_experts * 3 * d * cfg.shared_expert_intermediate_size
    return d * cfg.num_experts + moe_latent_params(cfg) + routed + shared  # router, latent down+up, experts


def active_matmul_params(cfg: Any, include_mtp: bool = True) -> int:
    """Matmul parameters one token passes through (routed experts: only the k selected), incl. the LM head."""
    n = 0
    for i in range(cfg.num_hidden_layers):
        n += (_mla_matmul(cfg) if cfg.layer_kind(i) == "mla" else _kda_matmul(cfg)) + _ffn_matmul(cfg, i)
    n += cfg.hidden_size * cfg.vocab_size  # LM head
    if include_mtp and cfg.num_nextn_predict_layers > 0:
        d = cfg.hidden_size
        n += 2 * d * d + _mla_matmul(cfg) + _ffn_matmul(cfg, cfg.num_hidden_layers - 1) + d * cfg.vocab_size
    return n


def attention_flops_per_token(cfg: Any, seq_len: int, include_mtp: bool = True) -> float:
    """Forward sequence-mixing FLOPs per token not captured by parameters (see module docstring)."""
    ctx = (seq_len + 1) / 2
    mla = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * ctx
    K, V, C = cfg.kda_head_dim, cfg.kda_head_dim, min(cfg.kda_chunk_size, seq_len)
    kda = cfg.kda_num_heads * (2 * C * (2 * K + V) + 6 * K * V)
    n_mla = sum(1 for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "mla")
    n_mla += 1 if include_mtp and cfg.num_nextn_predict_layers > 0 else 0
    return n_mla * mla + (cfg.num_hidden_layers - len(cfg.full_attn_layers)) * kda


def model_flops_per_token(cfg: Any, seq_len: int, include_mtp: bool = True) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token for MFU."""
    return 3.0 * (2.0 * active_matmul_params(cfg, include_mtp) + attention_flops_per_token(cfg, seq_len, include_mtp))


def draft_flops_per_token(cfg: Any, seq_len: int, steps: int) -> float:
    """FLOPs per token of an EAGLE-3 draft training step (``train.objective=eagle3``, k3train/model/eagle3.py):
    the frozen target's forward without its LM head; per draft step the draft layer's forward + backward
    (``3 x``; its Gated MLA attends to ``(seq_len + 1) / 2 + j`` keys at step ``j``), the target's LM head on
    the shifted position (forward) and the shared LM head on the draft (forward + the input gradient of a frozen
    weight: ``2 x``); ``W_E3`` (``3 x``)."""
    d, V = cfg.hidden_size, cfg.vocab_size
    target = 2.0 * (active_matmul_params(cfg, include_mtp=False) - d * V)
    target += attention_flops_per_token(cfg, seq_len, include_mtp=False)
    per_head_key = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    layer = 2.0 * (2 * d * d + _mla_matmul(cfg) + _ffn_matmul(cfg, cfg.num_hidden_layers - 1))
    draft = sum(3.0 * (layer + per_head_key * ((seq_len + 1) / 2 + j)) + 2.0 * d * V * (1 + 2)
                for j in range(steps))
    return target + draft + 3.0 * 2.0 * 3 * d * d


# --------------------------------------------------------------------------------------------------------------
# vision (MoonViT-V2 + projector), per media
# --------------------------------------------------------------------------------------------------------------
VISION_PARTS = ("patch_embed", "attn_proj", "attn_scores", "mlp", "merge", "projector")


def vision_flops_detail(grid: Any, vcfg: Any, d_model: int) -> dict[str, dict[str, int]]:
    """Forward and backward FLOPs of the vision tower on one media of ``grid = (t, h, w)`` patches (``vcfg`` a
    VisionConfig, ``d_model`` the LM width), per part: ``{part: {"forward", "backward"}}`` for
    :data:`VISION_PARTS` plus ``"total"``. ``n = t h w`` patches, ``hd = heads x head_dim``, ``L`` blocks:

    * ``patch_embed``: ``2 n (3 p^2) D``; backward the weight gradient only (the pixels need none): 1 x forward;
    * ``attn_proj`` (q, k, v, o): ``L 2 n 4 D hd``; ``factorised`` clips run them a second time (temporal pass);
    * ``attn_scores`` (``q k^T`` and ``P v``, the quadratic term): ``L 4 hd`` per (query, key) pair: ``joint``
      all ``n^2`` pairs of the media; ``factorised`` ``t (h w)^2`` within frames + ``h w t^2`` across frames
      (clips); backward ``dQ, dK, dV, dP``: 2 x forward (a flash kernel's recomputed ``q k^T`` not counted);
    * ``mlp``: ``L 2 n 2 D I``;
    * ``merge`` (``sd2_tpool``): the 2 x 2 concatenation is a reshape; the mean over the ``t`` frames of a clip is
      ``n D`` (0 for an image), its backward ``n D``;
    * ``projector``: ``2 M (m^2 D P + P d_model)`` over the ``M = (h/m)(w/m)`` merged tokens.

    Matmul backward = 2 x forward (input and weight gradients). Norms, softmax, RoPE, activations and the
    position-table interpolation are not counted (elementwise, O(n D))."""
    t, h, w = (int(x) for x in grid)
    D, hd, L = vcfg.hidden_size, vcfg.num_attention_heads * vcfg.head_dim, vcfg.num_hidden_layers
    m = vcfg.merge_size
    n, hw, merged = t * h * w, h * w, (h // m) * (w // m)
    proj_passes = 2 if vcfg.attention == "factorised" and t > 1 else 1
    pairs = n * n if vcfg.attention == "joint" else t * hw * hw + (hw * t * t if t > 1 else 0)
    fwd = {
        "patch_embed": 2 * n * 3 * vcfg.patch_size ** 2 * D,
        "attn_proj": L * proj_passes * 2 * n * 4 * D * hd,
        "attn_scores": L * 4 * hd * pairs,
        "mlp": L * 2 * n * 2 * D * vcfg.intermediate_size,
        "merge": n * D if t > 1 else 0,
        "projector": 2 * merged * (m * m * D * vcfg.projector_hidden_size + vcfg.projector_hidden_size * d_model),
    }
    bwd_factor = {"patch_embed": 1, "merge": 1}
    out = {k: {"forward": f, "backward": bwd_factor.get(k, 2) * f} for k, f in fwd.items()}
    out["total"] = {d: sum(out[k][d] for k in VISION_PARTS) for d in ("forward", "backward")}
    return out


def vision_flops(grid: Any, vcfg: Any, d_model: int, projector: bool = True) -> int:
    """Forward FLOPs of the vision tower on one media of ``grid = (t, h, w)`` patches: the sum of
    :func:`vision_flops_detail`'s forward parts (the planner's cost of a media; backward is about 2 x this).
    ``projector=False``: the encoder only (patch embedding, blocks, merge)."""
    det = vision_flops_detail(grid, vcfg, d_model)
    return sum(det[k]["forward"] for k in VISION_PARTS if projector or k != "projector")
