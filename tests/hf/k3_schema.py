"""A tiny checkpoint written to the published Kimi K3 key schema, independently of k3train/hf/names.py: the names
and shape rules as SGLang's ``models/kimi_k3.py`` / ``kimi_k3_vl.py`` and Megatron-Bridge's ``kimi_k3_bridge.py``
load them -- ``language_model.`` prefix, per-sublayer AttnRes ``*_res_proj [1, d]`` / ``*_res_norm``, the final
``output_attn_res_*``, KDA ``A_log`` zero-padded to ``head_dim``, ``[C, 1, K]`` short convs, the full-rank
``g_proj`` gates (KDA and MLA), the latent MoE ``routed_expert_{down,up}_proj`` / ``routed_expert_norm``, one shared-
expert MLP of ``num_shared_experts * moe_intermediate_size``, routed experts per expert in compressed-tensors
``mxfp4-pack-quantized`` (``w1/w2/w3.weight_packed`` uint8 ``[out, in/2]`` + ``weight_scale`` uint8 ``[out, in/32]``),
and the MoonViT3d tower (``vision_tower.*``, fused ``wqkv``, ``mm_projector.proj.0/2`` + ``post_norm``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

L, D, V, H, K = 4, 64, 256, 2, 16  # layers (KDA 1-3, MLA 4), hidden, vocab, KDA heads, KDA head dim
E, F, LAT, NS = 4, 32, 32, 2  # experts, expert width, latent width, shared experts
VIS = dict(layers=1, hidden=32, heads=2, qkv=32, inter=64, patch=14, pos=4, time=2, mm=32)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_value(code: int) -> float:
    """The E2M1 (OCP MX FP4) value of a 4-bit code, from the format's table (sign in bit 3)."""
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def config_json() -> dict:
    full, kda = [4], [1, 2, 3]
    text = {"model_type": "kimi_linear", "vocab_size": V, "hidden_size": D, "num_hidden_layers": L,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
            "mla_use_output_gate": True, "intermediate_size": 96, "first_k_dense_replace": 1, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "num_experts": E,
            "num_experts_per_token": 2, "num_shared_experts": NS, "moe_intermediate_size": F,
            "routed_expert_hidden_size": LAT, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True, "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1,
            "topk_group": 1, "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "attn_res_block_size": 2,
            "tie_word_embeddings": False, "max_position_embeddings": 4096, "num_nextn_predict_layers": 0,
            "linear_attn_config": {"num_heads": H, "head_dim": K, "short_conv_kernel_size": 4,
                                   "use_full_rank_gate": True, "gate_lower_bound": -5.0, "kda_layers": kda,
                                   "full_attn_layers": full},
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    v = VIS
    vision = {"model_type": "kimi_k3_vision", "patch_size": v["patch"], "init_pos_emb_height": v["pos"],
              "init_pos_emb_width": v["pos"], "init_pos_emb_time": v["time"], "pos_emb_type": "divided_fixed",
              "vt_num_attention_heads": v["heads"], "vt_num_hidden_layers": v["layers"], "vt_hidden_size": v["hidden"],
              "vt_intermediate_size": v["inter"], "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
              "mm_projector_type": "patchmergerv2", "mm_hidden_size": v["mm"], "projector_hidden_act": "gelu",
              "projector_ln_eps": 1e-5, "qkv_hidden_size": v["qkv"], "norm_type": "rmsnorm", "attn_bias": False,
              "patch_embed_proj_bias": False, "linear_bias": False, "activation_func": "gelu_pytorch_tanh",
              "pos_emb_interpolation_mode": "bilinear", "text_hidden_size": D}
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["re:.*experts.*"],
                                           "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                       "strategy": "group", "symmetric": True}}}}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "vision_config": vision, "media_placeholder_token_id": 5, "quantization_config": quant}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (bf16 weights; fp32 A_log / dt_bias / convs / router, as published)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    P = "language_model.model."
    t: dict[str, torch.Tensor] = {P + "embed_tokens.weight": w(V, D), "language_model.lm_head.weight": w(V, D),
                                  P + "norm.weight": ones(D), P + "output_attn_res_proj.weight": w(1, D),
                                  P + "output_attn_res_norm.weight": ones(D)}
    hk = H * K
    for i in range(L):
        b = f"{P}layers.{i}."
        t.update({b + "input_layernorm.weight": ones(D), b + "post_attention_layernorm.weight": ones(D),
                  b + "self_attention_res_proj.weight": w(1, D), b + "self_attention_res_norm.weight": ones(D),
                  b + "mlp_res_proj.weight": w(1, D), b + "mlp_res_norm.weight": ones(D)})
        a = b + "self_attn."
        if i < 3:  # KDA
            for n in ("q", "k", "v"):
                t[f"{a}{n}_proj.weight"] = w(hk, D)
                t[f"{a}{n}_conv1d.weight"] = w(hk, 1, 4, dtype=torch.float32)
            a_log = torch.zeros(K)  # K3 stores A_log as [head_dim], the heads first, zero-padded
            a_log[:H] = torch.randn(H, generator=g)
            t.update({a + "A_log": a_log, a + "dt_bias": w(hk, dtype=torch.float32), a + "f_a_proj.weight": w(K, D),
                      a + "f_b_proj.weight": w(hk, K), a + "b_proj.weight": w(H, D), a + "g_proj.weight": w(hk, D),
                      a + "o_norm.weight": ones(K), a + "o_proj.weight": w(D, hk)})
        else:  # Gated MLA
            t.update({a + "q_a_proj.weight": w(16, D), a + "q_a_layernorm.weight": ones(16),
                      a + "q_b_proj.weight": w(2 * 24, 16), a + "kv_a_proj_with_mqa.weight": w(16 + 8, D),
                      a + "kv_a_layernorm.weight": ones(16), a + "kv_b_proj.weight": w(2 * 32, 16),
                      a + "g_proj.weight": w(2 * 16, D), a + "o_proj.weight": w(D, 2 * 16)})
        if i == 0:
            t.update({b + "mlp.gate_proj.weight": w(96, D), b + "mlp.up_proj.weight": w(96, D),
                      b + "mlp.down_proj.weight": w(D, 96)})
            continue
        m = b + "block_sparse_moe."
        t.update({m + "gate.weight": w(E, D, dtype=torch.float32),
                  m + "gate.e_score_correction_bias": w(E, dtype=torch.float32),
                  m + "routed_expert_down_proj.weight": w(LAT, D), m + "routed_expert_norm.weight": ones(LAT),
                  m + "routed_expert_up_proj.weight": w(D, LAT),
                  m + "shared_experts.gate_proj.weight": w(NS * F, D),
                  m + "shared_experts.up_proj.weight": w(NS * F, D),
                  m + "shared_experts.down_proj.weight": w(D, NS * F)})
        for e in range(E):
            for name, out, inn in (("w1", F, LAT), ("w2", LAT, F), ("w3", F, LAT)):
                codes = torch.randint(0, 16, (out, inn), generator=g, dtype=torch.uint8)
                if e % 2:  # magnitudes <= 3 only: the OCP rule would pick a smaller scale for the same values
                    codes = (codes & 8) | (codes & 7) % 6
                t[f"{m}experts.{e}.{name}.weight_packed"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
                t[f"{m}experts.{e}.{name}.weight_scale"] = torch.randint(118, 126, (out, inn // 32), generator=g,
                                                                         dtype=torch.uint8)
    v = VIS
    vt, dv = "vision_tower.", v["hidden"]
    t.update({vt + "patch_embed.proj.weight": w(dv, 3, v["patch"], v["patch"]),
              vt + "patch_embed.pos_emb.weight": w(v["pos"], v["pos"], dv),
              vt + "encoder.final_layernorm.weight": ones(dv),
              "mm_projector.proj.0.weight": w(4 * v["mm"], 4 * v["mm"]),
              "mm_projector.proj.2.weight": w(D, 4 * v["mm"]),
              "mm_projector.post_norm.weight": ones(D)})
    for n in range(v["layers"]):
        b = f"{vt}encoder.blocks.{n}."
        t.update({b + "norm0.weight": ones(dv), b + "norm1.weight": ones(dv), b + "wqkv.weight": w(3 * v["qkv"], dv),
                  b + "wo.weight": w(dv, v["qkv"]), b + "mlp.fc0.weight": w(v["inter"], dv),
                  b + "mlp.fc1.weight": w(dv, v["inter"])})
    return t


def write_checkpoint(d: Path, shard_tensors: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write the checkpoint (config.json, shards of ``shard_tensors`` tensors, the index) into ``d``."""
    from safetensors.torch import save_file

    t = tensors(seed)
    keys = sorted(t)
    shards = [keys[i:i + shard_tensors] for i in range(0, len(keys), shard_tensors)]
    weight_map = {}
    for j, ks in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: t[k] for k in ks}, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in ks})
    total = sum(x.numel() * x.element_size() for x in t.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(config_json(), indent=2))
    return t
