"""Hugging Face ``config.json`` <-> k3train's ``model`` and ``vision`` sections (the import / export of configs).

Two published formats, told apart by ``model_type``:

* ``kimi_linear`` (Kimi Linear, e.g. Kimi-Linear-48B-A3B): the text config at the top level; standard pre-norm
  residual, SwiGLU, MoE in the model width, grouped top-k routing, KDA with the softplus decay and the low-rank
  output gate, MLA without an output gate. Field names as the Hub's ``config.json`` writes them (and transformers
  5.24's ``KimiLinearConfig`` saves through its ``attribute_map``): ``num_experts``, ``num_experts_per_token``,
  ``num_shared_experts``, ``moe_renormalize``, ``num_expert_group``, ``topk_group``, ``model_max_length``,
  ``linear_attn_config {head_dim, num_heads, short_conv_kernel_size, kda_layers, full_attn_layers}`` (1-based).
  transformers' in-memory names (``n_group``, ``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``,
  ``norm_topk_prob``, ``max_position_embeddings``) are read as well.
* ``kimi_k3`` (Kimi K3, ``KimiK3ForConditionalGeneration``): ``text_config`` (model_type ``kimi_linear`` with K3's
  fields: ``attn_res_block_size``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``, ``activation_situ_*``,
  ``mla_use_output_gate``, ``linear_attn_config.{use_full_rank_gate, gate_lower_bound}``) and ``vision_config``
  (MoonViT3d: ``vt_hidden_size``, ``vt_num_attention_heads``, ``qkv_hidden_size``, ...), as SGLang's
  ``configs/kimi_k3.py`` and Megatron-Bridge's ``kimi_k3_bridge`` read them.

The one rule both directions use: :func:`model_from_text_config` maps a text config to ``model`` values and
:func:`text_config_from_model` writes them back; what k3train cannot represent (rotary MLA, a layer plan that is not
"every ``full_attn_interval``-th layer and the last", ``moe_layer_freq`` != 1, a decay rank other than the head
dim, ...) is a :class:`ConfigError` naming the field -- one line, before anything is built.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3train.config import Config, ConfigError, load_config

HF_FORMATS = ("kimi_linear", "kimi_k3")
# k3train model keys a run may set differently from the checkpoint's config.json (everything else must agree)
RUN_MAY_DIFFER = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "init_std",
                  "media_placeholder_token_id")


def hf_format(cfg: Config) -> str:
    """The published format a k3train model is exported in: ``kimi_k3`` (Block AttnRes) or ``kimi_linear``."""
    return "kimi_k3" if cfg.model.residual == "attnres" else "kimi_linear"


def read_config_json(hf_dir: str | Path, key: str = "checkpoint.load_hf") -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{key}: {path} not found (a Hugging Face checkpoint directory holds config.json and "
                          f"*.safetensors)")
    try:
        cj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(cj, dict):
        raise ConfigError(f"{key}: {path} must hold a JSON object")
    return cj


def _get(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def config_format(cj: dict[str, Any], where: str) -> str:
    mt = cj.get("model_type")
    if mt not in HF_FORMATS:
        raise ConfigError(f"{where}: model_type {mt!r} cannot be mapped to a k3train model (known: "
                          f"{', '.join(HF_FORMATS)})")
    return mt


def _full_attn_interval(full: list[int], kda: list[int], L: int, where: str) -> int:
    """The k3train layer plan (MLA at every ``interval``-th layer and the last) that gives ``full``."""
    if sorted(set(full) | set(kda)) != list(range(1, L + 1)) or set(full) & set(kda):
        raise ConfigError(f"{where}: linear_attn_config.kda_layers and full_attn_layers must split layers 1..{L}")
    for interval in range(1, L + 1):
        if [i for i in range(1, L + 1) if i % interval == 0 or i == L] == sorted(full):
            return interval
    raise ConfigError(f"{where}: linear_attn_config.full_attn_layers {sorted(full)} is not a k3train layer plan "
                      f"(full attention at every N-th layer and at the last)")


LAYER_KINDS = {"linear_attention": "kda_layers", "full_attention": "full_attn_layers"}


def linear_attn_config_of(tc: dict[str, Any], L: int, where: str) -> dict[str, Any]:
    """The published ``linear_attn_config`` (1-based ``kda_layers`` / ``full_attn_layers``, ``head_dim``,
    ``num_heads``, ``short_conv_kernel_size``), also from the form transformers' ``KimiLinearConfig`` writes
    (``layer_types`` of ``linear_attention`` / ``full_attention``, ``linear_head_dim``, ``linear_num_heads``,
    ``linear_conv_kernel_dim``); where both are given, ``linear_attn_config`` wins (as transformers reads it)."""
    lac = dict(tc.get("linear_attn_config") or {})
    kinds = tc.get("layer_types")
    if (lac.get("kda_layers") is None or lac.get("full_attn_layers") is None) and kinds is not None:
        if not (isinstance(kinds, list) and len(kinds) == L and all(k in LAYER_KINDS for k in kinds)):
            raise ConfigError(f"{where}: layer_types: must list {L} entries of 'linear_attention' / 'full_attention'"
                              f", got {kinds!r}")
        for kind, key in LAYER_KINDS.items():
            lac[key] = [i + 1 for i, k in enumerate(kinds) if k == kind]
    for key, native in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                        ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if lac.get(key) is None and tc.get(native) is not None:
            lac[key] = tc[native]
    return lac


def first_k_dense_of(tc: dict[str, Any], L: int, where: str) -> int:
    """``first_k_dense_replace``, or the dense prefix of transformers' ``mlp_layer_types`` (``dense`` then
    ``sparse``; any other order is not a k3train layer plan)."""
    kinds = tc.get("mlp_layer_types")
    if tc.get("first_k_dense_replace") is not None or kinds is None:
        return int(tc.get("first_k_dense_replace", 0))
    k = next((i for i, t in enumerate(kinds) if t != "dense"), len(kinds)) if isinstance(kinds, list) else -1
    if k < 0 or len(kinds) != L or any(t != "sparse" for t in kinds[k:]):
        raise ConfigError(f"{where}: mlp_layer_types: k3train's layer plan is dense layers first, then MoE layers "
                          f"('dense' ... 'sparse' ..., {L} entries), got {kinds!r}")
    return k


def _require(cond: bool, where: str, field: str, msg: str) -> None:
    """Raise ConfigError naming the HF config field unless ``cond``."""
    if not cond:
        raise ConfigError(f"{where}: {field}: {msg}")


def _check_supported(tc: dict[str, Any], lac: Any, where: str) -> tuple[int, str]:
    """The text config's variants k3train maps (a layer plan, one KV head per query head, NoPE, untied
    embeddings, sigmoid routing, SwiGLU / SiTU-GLU), checked before anything is read; returns the number of
    attention heads and the hidden activation."""
    plan = isinstance(lac, dict) and lac.get("kda_layers") is not None and lac.get("full_attn_layers") is not None
    _require(plan, where, "linear_attn_config", "needs kda_layers and full_attn_layers (the KDA / MLA layer plan)")
    H = int(tc["num_attention_heads"])
    _require(int(_get(tc, "num_key_value_heads", default=H)) == H, where, "num_key_value_heads",
             "MLA has one key/value head per query head (num_key_value_heads = num_attention_heads)")
    _require(bool(tc.get("mla_use_nope", True)), where, "mla_use_nope", "false (rotary MLA) is not implemented")
    _require(not tc.get("tie_word_embeddings", False), where, "tie_word_embeddings", "true is not supported")
    _require(int(tc.get("moe_layer_freq", 1)) == 1, where, "moe_layer_freq",
             "only 1 (every layer after the dense ones)")
    act = tc.get("moe_router_activation_func", "sigmoid")
    _require(act == "sigmoid", where, "moe_router_activation_func", f"only sigmoid routing, got {act!r}")
    hidden_act = tc.get("hidden_act", "silu")
    _require(hidden_act in ("silu", "situ"), where, "hidden_act",
             f"only silu (SwiGLU) and situ (SiTU-GLU), got {hidden_act!r}")
    return H, hidden_act


def _mapped_fields(tc: dict[str, Any], lac: dict[str, Any], L: int, H: int, hidden_act: str,
                   where: str) -> dict[str, Any]:
    """The ``model`` fields read one to one (under their published names) from the text config."""
    num_experts = int(_get(tc, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    grouped = bool(tc.get("use_grouped_topk", True))
    return {
        "vocab_size": int(tc["vocab_size"]), "hidden_size": int(tc["hidden_size"]), "num_hidden_layers": L,
        "rms_norm_eps": float(tc.get("rms_norm_eps", 1e-5)), "tie_word_embeddings": False,
        "init_std": float(tc.get("initializer_range", 0.02)),
        "num_attention_heads": H, "q_lora_rank": tc.get("q_lora_rank"), "kv_lora_rank": int(tc["kv_lora_rank"]),
        "qk_nope_head_dim": int(tc["qk_nope_head_dim"]), "qk_rope_head_dim": int(tc["qk_rope_head_dim"]),
        "v_head_dim": int(tc["v_head_dim"]), "mla_use_nope": True,
        "mla_use_output_gate": bool(tc.get("mla_use_output_gate", False)),
        "kda_num_heads": int(lac["num_heads"]), "kda_head_dim": int(lac["head_dim"]),
        "short_conv_kernel_size": int(lac.get("short_conv_kernel_size", 4)),
        "kda_decay_rank": int(lac["head_dim"]),  # f_a_proj: hidden -> head_dim in both formats
        "use_full_rank_gate": bool(lac.get("use_full_rank_gate", False)),
        "full_attn_interval": _full_attn_interval(list(lac["full_attn_layers"]), list(lac["kda_layers"]), L, where),
        "intermediate_size": int(tc.get("intermediate_size", 0)),
        "first_k_dense_replace": first_k_dense_of(tc, L, where),
        "hidden_act": hidden_act,
        "num_experts": num_experts,
        "num_experts_per_token": int(_get(tc, "num_experts_per_token", "num_experts_per_tok", default=1)),
        "moe_intermediate_size": int(tc.get("moe_intermediate_size") or 0),
        "routed_expert_hidden_size": tc.get("routed_expert_hidden_size"),
        "latent_moe_use_norm": bool(tc.get("latent_moe_use_norm", False)),
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": bool(_get(tc, "moe_renormalize", "norm_topk_prob", default=True)),
        "routed_scaling_factor": float(tc.get("routed_scaling_factor", 1.0)),
        "num_expert_group": int(_get(tc, "num_expert_group", "n_group", default=1)) if grouped else 1,
        "topk_group": int(_get(tc, "topk_group", default=1)) if grouped else 1,
        "num_nextn_predict_layers": int(tc.get("num_nextn_predict_layers", 0)),
        "max_position_embeddings": int(_get(tc, "model_max_length", "max_position_embeddings", default=1048576)),
    }


def _set_shared_experts(tc: dict[str, Any], m: dict[str, Any], where: str) -> None:
    """The published shared-expert MLP is ONE SwiGLU/SiTU-GLU of width moe_intermediate_size * num_shared_experts:
    k3train holds it as num_shared_experts FFNs of width moe_intermediate_size (k3train/hf/names.py splits it), or
    -- when k3train wrote the checkpoint and recorded its own split (shared_expert_intermediate_size, a field
    transformers keeps and ignores) -- as that many FFNs of that width: the same tensors, the run's own shapes."""
    n_shared = int(_get(tc, "num_shared_experts", "n_shared_experts", default=0))
    m["num_shared_experts"] = n_shared
    m["shared_expert_intermediate_size"] = m["moe_intermediate_size"]
    width, own = n_shared * m["moe_intermediate_size"], tc.get("shared_expert_intermediate_size")
    if own is not None and n_shared:
        _require(isinstance(own, int) and own > 0 and width % own == 0, where, "shared_expert_intermediate_size",
                 f"{own!r} does not divide the published shared-expert width {width} (moe_intermediate_size * "
                 "num_shared_experts)")
        m["num_shared_experts"], m["shared_expert_intermediate_size"] = width // own, own


def _set_variants(tc: dict[str, Any], lac: dict[str, Any], m: dict[str, Any], fmt: str, where: str) -> None:
    """The fields that tell the formats apart: the KDA decay form, SiTU-GLU's betas, the residual stream (Block
    AttnRes for ``kimi_k3``, none for ``kimi_linear``); and the special token ids."""
    if "gate_lower_bound" in lac and lac["gate_lower_bound"] is not None:
        m["kda_decay_form"], m["gate_lower_bound"] = "lower_bounded", float(lac["gate_lower_bound"])
    else:
        m["kda_decay_form"] = "softplus"
    if m["hidden_act"] == "situ":
        m["activation_situ_beta"] = float(tc.get("activation_situ_beta") or 4.0)
        m["activation_situ_linear_beta"] = float(tc.get("activation_situ_linear_beta") or 25.0)
    if tc.get("attn_res_block_size") is not None:
        m["residual"], m["attn_res_block_size"] = "attnres", int(tc["attn_res_block_size"])
    else:
        m["residual"] = "standard"
    _require((m["residual"] == "attnres") == (fmt == "kimi_k3"), where, "attn_res_block_size",
             f"{fmt} checkpoints {'need' if fmt == 'kimi_k3' else 'have no'} Block AttnRes in k3train's mapping")
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "pad_token_id")):
        v = tc.get(name)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            m[key] = int(v)


def model_from_text_config(tc: dict[str, Any], fmt: str, where: str) -> dict[str, Any]:
    """k3train ``model`` section values from a HF text config (a dict). Raises ConfigError naming the field."""
    L = int(tc["num_hidden_layers"])
    lac = linear_attn_config_of(tc, L, where)
    H, hidden_act = _check_supported(tc, lac, where)
    m = _mapped_fields(tc, lac, L, H, hidden_act, where)
    _set_shared_experts(tc, m, where)
    _set_variants(tc, lac, m, fmt, where)
    if m["num_experts"] and m["first_k_dense_replace"] < L:
        _require(m["num_experts_per_token"] >= 1, where, "num_experts_per_token", "must be >= 1")
    return m


def vision_from_config(vc: dict[str, Any], where: str) -> dict[str, Any]:
    """k3train ``vision`` values from K3's ``vision_config`` (MoonViT3d as SGLang's ``kimi_k3_vl.py`` builds it:
    RMSNorm blocks, a final norm, bias-free linears, the PatchMergerMLPV2 projector with its post norm)."""
    D = int(_get(vc, "vt_hidden_size", "hidden_size"))
    heads = int(_get(vc, "vt_num_attention_heads", "num_attention_heads"))
    qkv = int(_get(vc, "qkv_hidden_size", default=D))
    biases = {bool(vc.get(k, False)) for k in ("attn_bias", "linear_bias", "patch_embed_proj_bias")}
    if len(biases) != 1:
        raise ConfigError(f"{where}: vision_config: attn_bias, linear_bias and patch_embed_proj_bias must agree "
                          f"(k3train's vision.bias is one switch)")
    act = vc.get("activation_func", "gelu_pytorch_tanh")
    acts = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    merge = list(vc.get("merge_kernel_size", (2, 2)))
    for ok, field, msg in ((act in acts, "activation_func", f"{act!r} is not supported"),
                           (merge == [2, 2] and vc.get("merge_type", "sd2_tpool") == "sd2_tpool", "merge_kernel_size",
                            "only the (2, 2) sd2_tpool merge"),
                           (vc.get("pos_emb_type", "divided_fixed") == "divided_fixed", "pos_emb_type",
                            "only divided_fixed"),
                           (qkv % heads == 0, "qkv_hidden_size", "must be a multiple of the heads")):
        if not ok:
            raise ConfigError(f"{where}: vision_config.{field}: {msg}")
    mm = int(_get(vc, "mm_hidden_size", default=D))
    return {
        "enabled": True, "num_hidden_layers": int(_get(vc, "vt_num_hidden_layers", "num_hidden_layers")),
        "hidden_size": D, "num_attention_heads": heads, "head_dim": qkv // heads,
        "intermediate_size": int(_get(vc, "vt_intermediate_size", "intermediate_size")), "hidden_act": acts[act],
        "patch_size": int(vc.get("patch_size", 14)), "pos_emb_height": int(vc.get("init_pos_emb_height", 64)),
        "pos_emb_width": int(vc.get("init_pos_emb_width", 64)), "pos_emb_time": int(vc.get("init_pos_emb_time", 4)),
        "pos_emb_interpolation": vc.get("pos_emb_interpolation_mode", "bilinear"), "attention": "joint",
        "norm": vc.get("norm_type", "rmsnorm"), "norm_eps": float(vc.get("projector_ln_eps", 1e-5)),
        "bias": biases.pop(), "final_norm": True, "merge_size": 2, "projector_hidden_size": 4 * mm,
        "projector_act": "gelu", "projector_norm": "post",
    }


def sections_from_config_json(cj: dict[str, Any], where: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(format, model values, vision values)`` of a checkpoint's ``config.json`` (vision: {} without a tower)."""
    fmt = config_format(cj, where)
    if fmt == "kimi_linear":  # text only: no media placeholder
        return fmt, {**model_from_text_config(cj, fmt, where), "media_placeholder_token_id": -1}, {}
    tc = cj.get("text_config")
    if not isinstance(tc, dict):
        raise ConfigError(f"{where}: kimi_k3 config.json needs a text_config object")
    model = model_from_text_config(tc, fmt, where)
    if cj.get("media_placeholder_token_id") is not None:
        model["media_placeholder_token_id"] = int(cj["media_placeholder_token_id"])
    vc = cj.get("vision_config")
    return fmt, model, (vision_from_config(vc, where) if isinstance(vc, dict) else {})


# ------------------------------------------------------------------------------------------------------------------
# k3train -> config.json
# ------------------------------------------------------------------------------------------------------------------
def text_config_from_model(cfg: Config) -> dict[str, Any]:
    """The published text config of a k3train model (the inverse of :func:`model_from_text_config`)."""
    m = cfg.model
    fmt = hf_format(cfg)
    where = "export-hf"
    if m.kda_layers and m.kda_decay_rank != m.kda_head_dim:
        raise ConfigError(f"{where}: model.kda_decay_rank={m.kda_decay_rank}: the published KDA decay projection "
                          f"has rank kda_head_dim={m.kda_head_dim}")
    # the published shared expert is ONE MLP of width moe_intermediate_size * num_shared_experts: k3train's
    # num_shared_experts FFNs of width shared_expert_intermediate_size are its blocks (k3train/hf/names.py), so the
    # published count is their total width over moe_intermediate_size; a split other than the published one is
    # recorded in shared_expert_intermediate_size (read back by model_from_text_config)
    width = m.num_shared_experts * m.shared_expert_intermediate_size
    if m.num_shared_experts and (not m.moe_intermediate_size or width % m.moe_intermediate_size):
        raise ConfigError(f"{where}: model.shared_expert_intermediate_size={m.shared_expert_intermediate_size} x "
                          f"num_shared_experts={m.num_shared_experts}: the published shared expert is one MLP of "
                          f"moe_intermediate_size * num_shared_experts, so the total width {width} must be a multiple "
                          f"of moe_intermediate_size={m.moe_intermediate_size}")
    published_shared = width // m.moe_intermediate_size if m.num_shared_experts else 0
    lac: dict[str, Any] = {"head_dim": m.kda_head_dim, "num_heads": m.kda_num_heads,
                           "short_conv_kernel_size": m.short_conv_kernel_size,
                           "kda_layers": list(m.kda_layers), "full_attn_layers": list(m.full_attn_layers)}
    if m.use_full_rank_gate or fmt == "kimi_k3":
        lac["use_full_rank_gate"] = bool(m.use_full_rank_gate)
    if m.kda_decay_form == "lower_bounded":
        lac["gate_lower_bound"] = float(m.gate_lower_bound)
    tc: dict[str, Any] = {
        "model_type": "kimi_linear", "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads, "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": bool(m.mla_use_output_gate), "intermediate_size": m.intermediate_size,
        "first_k_dense_replace": m.first_k_dense_replace, "hidden_act": m.hidden_act, "moe_layer_freq": 1,
        "num_experts": m.num_experts, "num_experts_per_token": m.num_experts_per_token,
        "num_shared_experts": published_shared, "moe_intermediate_size": m.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": bool(m.moe_renormalize),
        "routed_scaling_factor": m.routed_scaling_factor, "use_grouped_topk": m.num_expert_group > 1,
        "num_expert_group": m.num_expert_group, "topk_group": m.topk_group, "topk_method": "noaux_tc",
        "rms_norm_eps": m.rms_norm_eps, "initializer_range": m.init_std, "tie_word_embeddings": False,
        "num_nextn_predict_layers": m.num_nextn_predict_layers, "linear_attn_config": lac,
        "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id, "pad_token_id": m.pad_token_id,
    }
    if m.num_shared_experts and m.shared_expert_intermediate_size != m.moe_intermediate_size:
        tc["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
    if fmt == "kimi_linear":
        tc["model_max_length"] = m.max_position_embeddings
    else:
        tc.update(max_position_embeddings=m.max_position_embeddings, attn_res_block_size=m.attn_res_block_size)
    if m.latent_moe or fmt == "kimi_k3":
        tc.update(routed_expert_hidden_size=m.routed_expert_hidden_size,
                  latent_moe_use_norm=bool(m.latent_moe_use_norm))
    if m.hidden_act == "situ":
        tc.update(activation_situ_beta=m.activation_situ_beta,
                  activation_situ_linear_beta=m.activation_situ_linear_beta)
    return tc


def vision_config_from_vision(cfg: Config) -> dict[str, Any]:
    v = cfg.vision
    if v.attention != "joint" or v.projector_norm != "post" or not v.final_norm or v.projector_act != "gelu" \
            or v.merge_size != 2 or v.projector_hidden_size % 4:
        raise ConfigError("export-hf: the vision tower must be K3's MoonViT3d (vision.attention=joint, "
                          "projector_norm=post, final_norm=true, projector_act=gelu, merge_size=2) to be written in "
                          "the published kimi_k3 layout")
    acts = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
    return {"model_type": "kimi_k3_vision", "patch_size": v.patch_size, "init_pos_emb_height": v.pos_emb_height,
            "init_pos_emb_width": v.pos_emb_width, "init_pos_emb_time": v.pos_emb_time,
            "pos_emb_type": "divided_fixed", "vt_num_attention_heads": v.num_attention_heads,
            "vt_num_hidden_layers": v.num_hidden_layers, "vt_hidden_size": v.hidden_size,
            "vt_intermediate_size": v.intermediate_size, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmergerv2", "mm_hidden_size": v.projector_hidden_size // 4,
            "projector_hidden_act": "gelu", "projector_ln_eps": v.norm_eps,
            "qkv_hidden_size": v.num_attention_heads * v.head_dim, "norm_type": v.norm, "attn_bias": v.bias,
            "patch_embed_proj_bias": v.bias, "mlp_type": "mlp2", "linear_bias": v.bias,
            "activation_func": acts[v.hidden_act], "pos_emb_interpolation_mode": v.pos_emb_interpolation,
            "text_hidden_size": cfg.model.hidden_size}


def config_json_from_config(cfg: Config, source: dict[str, Any] | None = None,
                            quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of an export: the published fields of ``cfg``; a ``source`` config.json (the imported
    checkpoint's) contributes its other fields (auto_map, dtype, ...), ours win where both have one."""
    fmt = hf_format(cfg)
    tc = text_config_from_model(cfg)
    if fmt == "kimi_linear":
        out = dict(source or {})
        out.update(tc)
        out.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"])
    else:
        out = dict(source or {})
        src_tc = dict((source or {}).get("text_config") or {})
        src_tc.update(tc)
        out.update(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"], text_config=src_tc,
                   media_placeholder_token_id=cfg.model.media_placeholder_token_id)
        if cfg.vision.enabled:
            out["vision_config"] = vision_config_from_vision(cfg)
        else:
            out.pop("vision_config", None)
    out.pop("quantization_config", None)
    if fmt == "kimi_k3" and "quantization_config" in out.get("text_config", {}):
        out["text_config"].pop("quantization_config")
    if quantization is not None:
        out["quantization_config"] = quantization
    return out


def check_run_matches(cfg: Config, model: dict[str, Any], vision: dict[str, Any], where: str) -> None:
    """A run that loads a HF checkpoint must be the checkpoint's model: every mapped ``model`` (and ``vision``)
    value must equal the run's (except :data:`RUN_MAY_DIFFER`). One ConfigError naming the first key that differs."""
    for key, want in model.items():
        if key in RUN_MAY_DIFFER:
            continue
        have = getattr(cfg.model, key)
        if key == "q_lora_rank":
            want = want or 0
        if have != want:
            raise ConfigError(f"{where}: model.{key}={have!r} but the checkpoint's config.json gives {want!r} "
                              f"({cfg.origin('model.' + key)}); write the run config with `k3train import-hf`")
    if bool(vision) != cfg.vision.enabled:
        raise ConfigError(f"{where}: vision.enabled={cfg.vision.enabled} but the checkpoint "
                          f"{'has' if vision else 'has no'} vision tower")
    for key, want in vision.items():
        have = getattr(cfg.vision, key)
        if have != want and key != "norm_eps":
            raise ConfigError(f"{where}: vision.{key}={have!r} but the checkpoint's config.json gives {want!r}")


def _as_text(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def hf_overrides(hf_dir: str | Path, key: str = "checkpoint.load_hf") -> list[str]:
    """``--model.k=v`` / ``--vision.k=v`` overrides of the checkpoint's config.json, and ``--checkpoint.load_hf``."""
    cj = read_config_json(hf_dir, key)
    _, model, vision = sections_from_config_json(cj, f"{key}: {Path(hf_dir) / 'config.json'}")
    over = [f"--model.{k}={_as_text(v)}" for k, v in model.items()]
    over += [f"--vision.{k}={_as_text(v)}" for k, v in vision.items()]
    return over + [f"--checkpoint.load_hf={hf_dir}"]


def config_from_hf(hf_dir: str | Path, overrides: list[str] | None = None, world_size: int | None = None) -> Config:
    """A validated run Config whose model (and vision) is the checkpoint's (the other sections at their defaults,
    then ``overrides``)."""
    return load_config(None, hf_overrides(hf_dir) + list(overrides or []), world_size)
