"""The ``model`` section: the Kimi K3 backbone (KDA + Gated MLA layer plan, LatentMoE, Block AttnRes, MTP), and
its check.

Field names follow the published Hugging Face ``text_config`` of Kimi K3 where a field corresponds, so
checkpoints can be moved between k3train and HF-format tools.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3train.config.report import Need

HIDDEN_ACTS = ("situ", "silu")  # model.hidden_act: the gate activation of every FFN (k3train/model/ffn.py: glu)


@dataclass
class ModelConfig:
    # backbone
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    # Gated MLA (DeepSeek-style latent KV, NoPE)
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536  # null (HF) or 0: no query compression, q = W_q x (Kimi Linear); saved as 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the shared "rope" slot of the latent; K3 uses NoPE, so no rotation is applied
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # query/key block of the blockwise MLA attention (k3train/ops/mla_blockwise.py): the per-block transient is
    # ~H x block^2 fp32 scores; blocks the causal + document mask empties are skipped
    mla_block_size: int = 512
    # heads per chunk of the KDA and Gated MLA token mixers (0: all heads at once). The heads of a chunk run up to
    # their share of the output projection (summed in fp32 over the chunks); under parallel.recompute_granularity
    # = sublayer each chunk is recomputed on its own, so one chunk's activations live at a time (long context)
    mixer_head_chunk: int = 0
    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    kda_decay_rank: int = 128  # low-rank decay projection W_a_up W_a_down
    kda_decay_form: str = "lower_bounded"  # "lower_bounded" (K3) | "softplus" (Kimi Linear)
    gate_lower_bound: float = -5.0
    # KDA output gate: true = K3's full-rank g_proj (d -> H*K); false = Kimi Linear's low-rank g_b_proj g_a_proj
    # (d -> kda_head_dim -> H*K, the published rank)
    use_full_rank_gate: bool = True
    kda_chunk_size: int = 64
    # layer plan: 1-based layer i is Gated MLA when i % full_attn_interval == 0 or i == num_hidden_layers
    full_attn_interval: int = 4
    # FFN
    intermediate_size: int = 33792  # dense FFN (first_k_dense_replace layers)
    first_k_dense_replace: int = 1
    hidden_act: str = "situ"  # every FFN (dense, shared, routed experts): "situ" (SiTU-GLU, K3) | "silu" (SwiGLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    # latent width l; null (HF): no latent projection, the routed experts work in the model width d (Kimi Linear)
    routed_expert_hidden_size: int | None = 3584
    num_shared_experts: int = 2
    shared_expert_intermediate_size: int = 3072  # per shared expert (not published; chosen to match 2.78T/104.2B)
    latent_moe_use_norm: bool = True
    # tokens per chunk of a LatentMoE layer (routing, dispatch / experts / combine, shared experts): the EP token
    # buffers and the dispatch transients hold one chunk; under parallel.recompute_granularity = sublayer each chunk
    # is recomputed on its own
    moe_token_chunk: int = 4096
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True  # HF norm_topk_prob: mixing weights of the k routes divided by their sum
    routed_scaling_factor: float = 1.0
    # grouped top-k (DeepSeek-V3 / Kimi Linear; HF n_group / num_expert_group, topk_group): the experts form
    # num_expert_group equal groups, a token picks its topk_group groups by the sum of each group's two best
    # biased scores, then its k experts among them. 1 group: plain top-k
    num_expert_group: int = 1
    topk_group: int = 1
    # router balancing: "qb" (Quantile Balancing), "sign" (aux-loss-free sign update), "none"
    router_balance: str = "qb"
    qb_estimator: str = "histogram"  # "histogram" | "exact"
    qb_bins: int = 1000
    qb_ema: float = 0.0  # 0 = no EMA; otherwise b <- ema * b_old + (1 - ema) * b_new
    sign_update_rate: float = 1e-3
    # Block Attention Residuals
    attn_res_block_size: int = 12  # layers per block
    # AttnRes aggregation + pre-norm (standard residual: the pre-norm) keep only per-token scalars for backward
    # (k3train/model/attnres_fused.py); false: the plain autograd reference, every intermediate kept
    attn_res_recompute: bool = True
    # residual stream: "attnres" (Block AttnRes, above) | "standard" (PreNorm h = h + f(norm(h)); the ablation)
    residual: str = "attnres"
    # MTP
    num_nextn_predict_layers: int = 0
    mtp_loss_weight: float = 0.3
    # misc
    max_position_embeddings: int = 1048576
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    media_placeholder_token_id: int = 163605
    # derived
    kda_layers: list[int] = field(default_factory=list, metadata={"derived": True})
    full_attn_layers: list[int] = field(default_factory=list, metadata={"derived": True})
    num_attn_res_blocks: int = field(default=0, metadata={"derived": True})

    def layer_kind(self, i: int) -> str:
        """'kda' or 'mla' for 0-based layer index ``i``."""
        return "mla" if (i + 1) in self.full_attn_layers else "kda"

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def latent_moe(self) -> bool:
        """Whether the MoE projects to a latent width for the routed experts (``routed_expert_hidden_size`` set)."""
        return self.routed_expert_hidden_size is not None

    @property
    def expert_hidden_size(self) -> int:
        """The width the routed experts work in (and the expert-parallel dispatch moves): the latent width, or the
        model width ``hidden_size`` without a latent projection."""
        return self.routed_expert_hidden_size if self.routed_expert_hidden_size is not None else self.hidden_size

    @property
    def has_moe(self) -> bool:
        """Whether any layer is a MoE layer (routed experts, and layers past the ``first_k_dense_replace`` dense
        ones)."""
        return self.num_experts > 0 and self.first_k_dense_replace < self.num_hidden_layers


def check_model(m: ModelConfig, need: Need) -> None:
    """The model section: names and ranges, the MoE routing, the variants K3 does not use, the layer plan (derived
    here), and every size a layer that exists will use."""
    check_model_settings(m, need)
    if m.has_moe:
        check_routing(m, need)
    check_model_variants(m, need)
    derive_layer_plan(m)
    check_model_sizes(m, need)


def check_model_settings(m: ModelConfig, need: Need) -> None:
    need(m.num_hidden_layers >= 1, "model.num_hidden_layers", "must be >= 1")
    need(m.hidden_size > 0, "model.hidden_size", "must be > 0")
    need(m.full_attn_interval >= 1, "model.full_attn_interval", "must be >= 1")
    need(m.kda_decay_form in ("lower_bounded", "softplus"), "model.kda_decay_form",
         f"must be 'lower_bounded' or 'softplus', got {m.kda_decay_form!r}")
    need(m.gate_lower_bound < 0, "model.gate_lower_bound", "must be negative")
    need(m.kda_chunk_size % 16 == 0 and m.kda_chunk_size > 0, "model.kda_chunk_size",
         f"must be a positive multiple of 16 (sub-tiles of 16), got {m.kda_chunk_size}")
    need(m.hidden_act in HIDDEN_ACTS, "model.hidden_act",
         f"must be one of {', '.join(HIDDEN_ACTS)} (SiTU-GLU, SwiGLU), got {m.hidden_act!r}")
    need(m.router_balance in ("qb", "sign", "none"), "model.router_balance",
         f"must be 'qb', 'sign' or 'none', got {m.router_balance!r}")
    need(m.qb_estimator in ("histogram", "exact"), "model.qb_estimator", "must be 'histogram' or 'exact'")
    need(0 <= m.qb_ema < 1, "model.qb_ema", "must be in [0, 1)")
    need(m.moe_router_activation_func == "sigmoid", "model.moe_router_activation_func", "only 'sigmoid'")
    need(0 <= m.first_k_dense_replace <= m.num_hidden_layers, "model.first_k_dense_replace",
         "must be between 0 and num_hidden_layers")


def check_routing(m: ModelConfig, need: Need) -> None:
    """The routed experts of a model with MoE layers: top-k, the latent projection, grouped top-k."""
    need(1 <= m.num_experts_per_token < m.num_experts, "model.num_experts_per_token",
         f"must be in [1, num_experts) (Quantile Balancing routes top-(k+1)), got {m.num_experts_per_token}"
         f" with num_experts={m.num_experts}")
    need(m.routed_expert_hidden_size is None or m.routed_expert_hidden_size > 0,
         "model.routed_expert_hidden_size", "must be > 0, or null (no latent projection)")
    need(m.latent_moe or not m.latent_moe_use_norm, "model.latent_moe_use_norm",
         "true needs a latent projection (model.routed_expert_hidden_size), which is null: the latent norm "
         "would not exist; set latent_moe_use_norm=false", "model.latent_moe_use_norm",
         "model.routed_expert_hidden_size")
    G = m.num_expert_group
    need(isinstance(G, int) and G >= 1 and m.num_experts % G == 0, "model.num_expert_group",
         f"must be >= 1 and divide num_experts={m.num_experts}, got {G}")
    need(G == 1 or m.num_experts // G >= 2, "model.num_expert_group",
         f"grouped top-k scores a group by its two best experts: needs >= 2 experts per group, got "
         f"{m.num_experts // G}")
    need(1 <= m.topk_group <= G, "model.topk_group", f"must be in [1, num_expert_group={G}], got "
         f"{m.topk_group}", "model.topk_group", "model.num_expert_group")
    need(m.topk_group * (m.num_experts // G) > m.num_experts_per_token, "model.topk_group",
         f"topk_group={m.topk_group} groups of {m.num_experts // G} experts leave fewer than "
         f"num_experts_per_token + 1 = {m.num_experts_per_token + 1} experts to route over (Quantile "
         f"Balancing routes top-(k+1))", "model.topk_group", "model.num_expert_group",
         "model.num_experts_per_token")


def check_model_variants(m: ModelConfig, need: Need) -> None:
    """Variants the published configs name but K3 does not use, rejected before any work starts; the chunking
    knobs; the residual stream (Block AttnRes or the standard PreNorm ablation)."""
    need(m.mla_use_nope, "model.mla_use_nope", "false (rotary MLA) is not implemented; K3 uses NoPE")
    need(isinstance(m.mla_block_size, int) and m.mla_block_size > 0, "model.mla_block_size",
         f"must be a positive integer (the blockwise MLA attention's block), got {m.mla_block_size!r}")
    need(isinstance(m.moe_token_chunk, int) and m.moe_token_chunk > 0, "model.moe_token_chunk",
         f"must be a positive integer (tokens per LatentMoE chunk), got {m.moe_token_chunk!r}")
    need(isinstance(m.mixer_head_chunk, int) and m.mixer_head_chunk >= 0, "model.mixer_head_chunk",
         f"must be >= 0 (heads per token-mixer chunk; 0 = all heads), got {m.mixer_head_chunk!r}")
    need(not m.tie_word_embeddings, "model.tie_word_embeddings", "true is not supported (K3 unties them)")
    need(m.attn_res_block_size >= 1, "model.attn_res_block_size", "must be >= 1")
    need(m.residual in ("attnres", "standard"), "model.residual",
         f"must be 'attnres' or 'standard', got {m.residual!r}")
    need(m.num_nextn_predict_layers in (0, 1), "model.num_nextn_predict_layers", "0 or 1 MTP layer")
    need(m.kv_lora_rank > 0, "model.kv_lora_rank", f"must be > 0, got {m.kv_lora_rank}")
    need(m.vocab_size > max(0, 1), "model.vocab_size", "must be > 1")


def derive_layer_plan(m: ModelConfig) -> None:
    """The derived layer plan: 1-based Gated MLA layers (every ``full_attn_interval``-th and the last), the KDA
    layers, and the number of AttnRes blocks."""
    m.full_attn_layers = [i for i in range(1, m.num_hidden_layers + 1)
                          if i % m.full_attn_interval == 0 or i == m.num_hidden_layers]
    full_set = set(m.full_attn_layers)
    m.kda_layers = [i for i in range(1, m.num_hidden_layers + 1) if i not in full_set]
    m.num_attn_res_blocks = math.ceil(m.num_hidden_layers / m.attn_res_block_size)


def check_model_sizes(m: ModelConfig, need: Need) -> None:
    """Every size a layer that exists will use must be positive (a 0 builds empty tensors and fails deep in a
    forward, or divides by zero); sizes of layer kinds the plan has none of may be 0. HF's null
    ``q_lora_rank`` (no query compression) becomes 0, the same model."""
    n_kda = len(m.kda_layers)
    has_moe = m.has_moe
    sizes = ["num_attention_heads", "qk_nope_head_dim", "v_head_dim"]  # the last layer is always Gated MLA
    sizes += ["kda_num_heads", "kda_head_dim", "kda_decay_rank", "short_conv_kernel_size"] if n_kda else []
    sizes += ["intermediate_size"] if m.first_k_dense_replace > 0 or m.num_experts == 0 else []
    sizes += ["moe_intermediate_size"] if has_moe else []
    sizes += ["shared_expert_intermediate_size"] if has_moe and m.num_shared_experts > 0 else []
    sizes += ["qb_bins"] if has_moe and m.router_balance == "qb" and m.qb_estimator == "histogram" else []
    for k in sizes:
        need(getattr(m, k) >= 1, f"model.{k}", f"must be >= 1, got {getattr(m, k)}")
    if m.q_lora_rank is None:
        m.q_lora_rank = 0
    for k in ("q_lora_rank", "qk_rope_head_dim", "num_experts", "num_shared_experts"):
        need(getattr(m, k) >= 0, f"model.{k}", f"must be >= 0, got {getattr(m, k)}")
    for k in ("rms_norm_eps", "init_std", "activation_situ_beta", "activation_situ_linear_beta",
              "routed_scaling_factor"):
        need(getattr(m, k) > 0, f"model.{k}", f"must be > 0, got {getattr(m, k)}")
    need(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", f"must be >= 0, got {m.mtp_loss_weight}")
    need(m.sign_update_rate >= 0, "model.sign_update_rate", f"must be >= 0, got {m.sign_update_rate}")
