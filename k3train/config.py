"""Typed run configuration: dataclasses <- YAML <- ``--section.key=value`` overrides.

One YAML file describes one run. Every section is a dataclass; unknown keys, wrong types and inconsistent
values raise :class:`ConfigError` naming the key (and the file). Derived values are computed once, in
:meth:`Config.validate`, and stored on the objects (fields marked ``derived``) so the resolved config written to
the run directory is complete.

Model field names follow the published Hugging Face ``text_config`` of Kimi K3 where a field corresponds, so
checkpoints can be moved between k3train and HF-format tools.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and, when known, the file."""


# --------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------
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
    q_lora_rank: int = 1536  # 0 = no query compression
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the shared "rope" slot of the latent; K3 uses NoPE, so no rotation is applied
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    kda_decay_rank: int = 128  # low-rank decay projection W_a_up W_a_down
    kda_decay_form: str = "lower_bounded"  # "lower_bounded" (K3) | "softplus" (Kimi Linear)
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True
    kda_chunk_size: int = 64
    # layer plan: 1-based layer i is Gated MLA when i % full_attn_interval == 0 or i == num_hidden_layers
    full_attn_interval: int = 4
    # FFN
    intermediate_size: int = 33792  # dense FFN (first_k_dense_replace layers)
    first_k_dense_replace: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # latent width l
    num_shared_experts: int = 2
    shared_expert_intermediate_size: int = 3072  # per shared expert (not published; chosen to match 2.78T/104.2B)
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    # router balancing: "qb" (Quantile Balancing), "sign" (aux-loss-free sign update), "none"
    router_balance: str = "qb"
    qb_estimator: str = "histogram"  # "histogram" | "exact"
    qb_bins: int = 1000
    qb_ema: float = 0.0  # 0 = no EMA; otherwise b <- ema * b_old + (1 - ema) * b_new
    sign_update_rate: float = 1e-3
    # Block Attention Residuals
    attn_res_block_size: int = 12  # layers per block
    attn_res_recompute: bool = True  # wrap AttnRes aggregation in activation checkpointing
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


@dataclass
class ParallelConfig:
    pp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank
    dp: int = -1  # -1: world_size / (pp * cp)
    cp: int = 1
    ep: int = 1  # taken from within dp x cp
    moonep: bool = True
    attnres_comm: str = "cached"  # "cached" | "full"
    schedule: str = "auto"  # "auto" (interleaved 1F1B if vpp > 1 else 1F1B) | "1f1b" | "interleaved" | "afab"
    pp_layers: list[int] = field(default_factory=list)  # explicit layers per virtual stage (pp*vpp entries)
    recompute: bool = False  # full activation recomputation per stage
    zero: int = 1  # 0: plain DP all-reduce, 1: ZeRO-1 optimizer sharding, 2: + gradient sharding
    backend: str = "auto"  # "auto" (nccl if CUDA else gloo) | "nccl" | "gloo"


@dataclass
class TrainConfig:
    steps: int = 100  # length of the run (the LR schedule spans these steps)
    stop_at_step: int = 0  # stop this invocation after this step (checkpointed) without changing the schedule
    seed: int = 1234
    out_dir: str = "runs/default"
    seq_len: int = 128
    global_batch_size: int = 8  # sequences per optimizer step
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank
    grad_clip: float = 1.0
    dtype: str = "float32"  # "float32" | "bfloat16" (parameters stay fp32 masters)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # derived
    grad_accum_steps: int = field(default=0, metadata={"derived": True})


@dataclass
class OptimConfig:
    name: str = "muon"  # "muon" (Muon for matrices + AdamW for the rest) | "adamw"
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"  # "cosine" | "wsd" | "constant"
    warmup_steps: int = 10
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: str = "float32"  # "float32" | "bfloat16"
    per_head_muon: bool = True
    qk_clip_threshold: float = 100.0  # 0 disables QK-Clip
    # parameter-name substrings forced to AdamW even when 2-D (embedding, LM head, ...)
    adamw_param_patterns: list[str] = field(default_factory=lambda: ["embed", "lm_head"])


@dataclass
class DataConfig:
    path: str = "data_cache/corpus_text_document"  # Megatron indexed-dataset prefix (.bin/.idx)
    tokenizer: str = "k3train/data/assets/tokenizer.json"
    split: str = "98,2,0"


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_mode: str = "offline"
    wandb_project: str = "k3train"
    log_interval: int = 1
    peak_flops: float = 0.0  # FLOP/s per rank for MFU; 0 = measure a matmul at start-up
    level: str = "INFO"


@dataclass
class CheckpointConfig:
    interval: int = 0  # 0 = only at the end
    resume: str = "auto"  # "auto" | "none" | path to a step directory
    dir: str = ""  # default: <out_dir>/checkpoints
    keep: int = 2
    save_final: bool = True


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    source: str = field(default="<defaults>", metadata={"derived": True})

    # ----------------------------------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Config":
        """Check consistency and compute derived fields. ``world_size`` (when given) must match the layout."""
        m, p, t, o = self.model, self.parallel, self.train, self.optim
        where = f" (in {self.source})"

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}{where}")

        for sec_name in SECTIONS:
            sec = getattr(self, sec_name)
            for f in dataclasses.fields(sec):
                v = getattr(sec, f.name)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name.endswith(
                    ("_size", "_layers", "_heads", "_dim", "steps", "interval")
                ) and f.name not in ("first_k_dense_replace",):
                    need(v >= 0, f"{sec_name}.{f.name}", f"must be >= 0, got {v}")

        # model
        need(m.num_hidden_layers >= 1, "model.num_hidden_layers", "must be >= 1")
        need(m.hidden_size > 0, "model.hidden_size", "must be > 0")
        need(m.full_attn_interval >= 1, "model.full_attn_interval", "must be >= 1")
        need(m.kda_decay_form in ("lower_bounded", "softplus"), "model.kda_decay_form",
             f"must be 'lower_bounded' or 'softplus', got {m.kda_decay_form!r}")
        need(m.gate_lower_bound < 0, "model.gate_lower_bound", "must be negative")
        need(m.kda_chunk_size % 16 == 0 and m.kda_chunk_size > 0, "model.kda_chunk_size",
             f"must be a positive multiple of 16 (sub-tiles of 16), got {m.kda_chunk_size}")
        need(m.hidden_act == "situ", "model.hidden_act", f"only 'situ' is implemented, got {m.hidden_act!r}")
        need(m.router_balance in ("qb", "sign", "none"), "model.router_balance",
             f"must be 'qb', 'sign' or 'none', got {m.router_balance!r}")
        need(m.qb_estimator in ("histogram", "exact"), "model.qb_estimator", "must be 'histogram' or 'exact'")
        need(0 <= m.qb_ema < 1, "model.qb_ema", "must be in [0, 1)")
        need(m.moe_router_activation_func == "sigmoid", "model.moe_router_activation_func", "only 'sigmoid'")
        need(0 <= m.first_k_dense_replace <= m.num_hidden_layers, "model.first_k_dense_replace",
             "must be between 0 and num_hidden_layers")
        if m.num_experts > 0 and m.first_k_dense_replace < m.num_hidden_layers:
            need(1 <= m.num_experts_per_token < m.num_experts, "model.num_experts_per_token",
                 f"must be in [1, num_experts) (Quantile Balancing routes top-(k+1)), got {m.num_experts_per_token}"
                 f" with num_experts={m.num_experts}")
            need(m.routed_expert_hidden_size > 0, "model.routed_expert_hidden_size", "must be > 0")
        # variants the published configs name but K3 does not use: rejected here, before any work starts
        need(m.mla_use_nope, "model.mla_use_nope", "false (rotary MLA) is not implemented; K3 uses NoPE")
        need(m.use_full_rank_gate, "model.use_full_rank_gate",
             "false (Kimi Linear's low-rank output gate) is not implemented; K3 uses the full-rank gate")
        need(not m.tie_word_embeddings, "model.tie_word_embeddings", "true is not supported (K3 unties them)")
        need(m.attn_res_block_size >= 1, "model.attn_res_block_size", "must be >= 1")
        need(m.num_nextn_predict_layers in (0, 1), "model.num_nextn_predict_layers", "0 or 1 MTP layer")
        if m.q_lora_rank < 0 or m.kv_lora_rank <= 0:
            need(False, "model.kv_lora_rank", "must be > 0 (and q_lora_rank >= 0)")
        need(m.vocab_size > max(0, 1), "model.vocab_size", "must be > 1")
        m.full_attn_layers = [i for i in range(1, m.num_hidden_layers + 1)
                              if i % m.full_attn_interval == 0 or i == m.num_hidden_layers]
        m.kda_layers = [i for i in range(1, m.num_hidden_layers + 1) if i not in set(m.full_attn_layers)]
        m.num_attn_res_blocks = math.ceil(m.num_hidden_layers / m.attn_res_block_size)

        # parallel
        for k in ("pp", "vpp", "cp", "ep"):
            need(getattr(p, k) >= 1, f"parallel.{k}", f"must be >= 1, got {getattr(p, k)}")
        need(p.dp == -1 or p.dp >= 1, "parallel.dp", f"must be >= 1 or -1 (auto), got {p.dp}")
        need(p.attnres_comm in ("cached", "full"), "parallel.attnres_comm", "must be 'cached' or 'full'")
        need(p.schedule in ("auto", "1f1b", "interleaved", "afab"), "parallel.schedule",
             "must be 'auto', '1f1b', 'interleaved' or 'afab'")
        need(p.zero in (0, 1, 2), "parallel.zero", f"must be 0, 1 or 2, got {p.zero}")
        need(p.backend in ("auto", "nccl", "gloo"), "parallel.backend", "must be 'auto', 'nccl' or 'gloo'")
        n_chunks = p.pp * p.vpp
        if p.pp_layers:
            need(len(p.pp_layers) == n_chunks, "parallel.pp_layers",
                 f"has {len(p.pp_layers)} entries but pp*vpp = {n_chunks} virtual stages")
            need(all(n >= 1 for n in p.pp_layers), "parallel.pp_layers", "every virtual stage needs >= 1 layer")
            need(sum(p.pp_layers) == m.num_hidden_layers, "parallel.pp_layers",
                 f"sums to {sum(p.pp_layers)} layers but model.num_hidden_layers = {m.num_hidden_layers}")
        else:
            need(m.num_hidden_layers >= n_chunks, "parallel.pp",
                 f"{m.num_hidden_layers} layers cannot fill pp*vpp = {n_chunks} virtual stages")
        if world_size is not None:
            denom = p.pp * p.cp
            need(world_size % denom == 0, "parallel",
                 f"world size {world_size} is not divisible by pp*cp = {denom}")
            auto_dp = world_size // denom
            if p.dp == -1:
                p.dp = auto_dp
            need(p.dp * denom == world_size, "parallel.dp",
                 f"pp*dp*cp = {p.pp}*{p.dp}*{p.cp} = {p.pp * p.dp * p.cp} != world size {world_size}")
        dp = p.dp if p.dp != -1 else None
        if dp is not None:
            need((dp * p.cp) % p.ep == 0, "parallel.ep", f"ep={p.ep} must divide dp*cp = {dp * p.cp}")
        if p.ep > 1 and m.num_experts > 0:
            need(m.num_experts % p.ep == 0, "parallel.ep",
                 f"num_experts={m.num_experts} not divisible by ep={p.ep}")

        # train
        need(t.seq_len >= 1, "train.seq_len", "must be >= 1")
        need(t.seq_len % p.cp == 0, "train.seq_len", f"seq_len={t.seq_len} not divisible by cp={p.cp}")
        need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
        need(t.dtype in ("float32", "bfloat16"), "train.dtype", "must be 'float32' or 'bfloat16'")
        need(t.device in ("auto", "cpu", "cuda"), "train.device", "must be 'auto', 'cpu' or 'cuda'")
        if dp is not None:
            per_step = t.micro_batch_size * dp
            need(t.global_batch_size % per_step == 0, "train.global_batch_size",
                 f"global_batch_size={t.global_batch_size} not divisible by micro_batch_size*dp = {per_step}")
            t.grad_accum_steps = t.global_batch_size // per_step
            if p.pp > 1 and p.vpp > 1:
                need(t.grad_accum_steps % p.pp == 0, "train.global_batch_size",
                     f"interleaved pipeline needs micro-batches per step ({t.grad_accum_steps}) to be a multiple"
                     f" of pp={p.pp}")
        need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")

        # optim
        need(o.name in ("muon", "adamw"), "optim.name", f"must be 'muon' or 'adamw', got {o.name!r}")
        need(o.schedule in ("cosine", "wsd", "constant"), "optim.schedule", "must be 'cosine', 'wsd' or 'constant'")
        need(o.lr > 0, "optim.lr", "must be > 0")
        need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        need(o.ns_dtype in ("float32", "bfloat16"), "optim.ns_dtype", "must be 'float32' or 'bfloat16'")
        need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Settable fields per section, plus a ``derived`` section (ignored when loaded back)."""
        out: dict[str, Any] = {}
        derived: dict[str, Any] = {}
        for s in SECTIONS:
            sec = getattr(self, s)
            out[s] = {}
            for f in dataclasses.fields(sec):
                v = getattr(sec, f.name)
                v = list(v) if isinstance(v, list) else v
                if f.metadata.get("derived"):
                    derived[f"{s}.{f.name}"] = v
                else:
                    out[s][f.name] = v
        out["derived"] = derived
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats. Strings from the command
    line were already parsed with YAML rules."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}{where}")
        return [_coerce(v, item_tp, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} does not match {tp}{where}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null{where}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}{where}")


def _apply(cfg: Config, data: dict[str, Any], where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections{where}")
    for sec_name, values in data.items():
        if sec_name == "derived":  # written by Config.save for reference; recomputed on load
            continue
        if sec_name not in SECTIONS:
            raise ConfigError(f"unknown section {sec_name!r} (known: {', '.join(SECTIONS)}){where}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{sec_name}: expected a mapping{where}")
        sec = getattr(cfg, sec_name)
        hints = typing.get_type_hints(type(sec))
        fields = {f.name: f for f in dataclasses.fields(sec)}
        for key, value in values.items():
            full = f"{sec_name}.{key}"
            f = fields.get(key)
            if f is None or f.metadata.get("derived"):
                raise ConfigError(f"unknown key {full!r}{where}")
            setattr(sec, key, _coerce(value, hints[key], full, where))


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """``["--model.hidden_size=64", "--train.steps", "5"]`` -> nested dict. Values use YAML scalar rules."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"bad override {a!r}: expected --section.key=value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a!r} has no value")
            k, v = a[2:], args[i + 1]
            i += 1
        sec, _, key = k.partition(".")
        try:
            parsed = yaml.safe_load(v) if v != "" else ""
        except yaml.YAMLError:
            parsed = v
        if isinstance(parsed, str):
            try:
                parsed = float(parsed)  # "1e-3": YAML 1.1 would keep it a string
            except ValueError:
                pass
        out.setdefault(sec, {})[key] = parsed
        i += 1
    return out


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                world_size: int | None = None) -> Config:
    """Load a YAML config, apply command-line overrides and validate. Raises :class:`ConfigError`."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"malformed YAML in {p}: {str(e).splitlines()[0]}") from None
        _apply(cfg, data or {}, f" (in {p})")
        cfg.source = str(p)
    if overrides:
        _apply(cfg, parse_overrides(overrides), " (command-line override)")
    return cfg.validate(world_size)
