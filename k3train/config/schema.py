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
import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3train.runtime.bad_input import ConfigError


@functools.lru_cache(maxsize=None)
def _count_fields(cls: type) -> tuple[str, ...]:
    """Field names of a config section that are sizes or counts by name (``validate``: must be >= 0)."""
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.name.endswith(("_size", "_layers", "_heads", "_dim", "steps", "interval"))
                 and f.name not in ("first_k_dense_replace",))


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
HIDDEN_ACTS = ("situ", "silu")  # model.hidden_act: the gate activation of every FFN (k3train/model/ffn.py: glu)
WANDB_MODES = ("online", "offline", "disabled")
RECOMPUTE_GRANULARITIES = ("chunk", "layer", "sublayer")  # parallel.recompute_granularity
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str, where: str = "") -> tuple[float, float, float]:
    """``data.split`` -> its three weights (train, valid, test): exactly three finite non-negative numbers with a
    positive sum, e.g. ``"98,2,0"``. Megatron's own parser picks numbers out with a regex and accepts anything
    (``"98-2"`` would be ``[98, 2, 0]``), so this is the one rule both the config and the dataset builder use."""
    parts = [x.strip() for x in str(split).split(",")]
    # plain decimals only ("1e2" would be read by Megatron's regex as two numbers)
    w = tuple(float(x) for x in parts) if all(re.fullmatch(r"\d+\.?\d*|\.\d+", x) for x in parts) else ()
    if len(w) != 3 or sum(w) <= 0:
        raise ConfigError(f"data.split: cannot parse {split!r}: expected 3 comma-separated non-negative decimal "
                          f"weights (train,valid,test) with a positive sum, e.g. '98,2,0'{where}")
    return w  # type: ignore[return-value]


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


@dataclass
class ParallelConfig:
    pp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank
    dp: int = -1  # -1: world_size / (pp * cp)
    cp: int = 1
    ep: int = 1  # taken from within dp x cp
    moonep: bool = True
    # F/B pairing (parallel/pairing.py): the forward of micro-batch m+1 runs while the backward of micro-batch m
    # does, on a second thread and a second EP group (and CP group under cp > 1), so one side's expert
    # all-to-all and KCP exchanges wait while the other side computes; results are bit-identical to false.
    # Applies where Config.ep_overlap() says (ep > 1, more than one micro-batch per step; at pp > 1 the adjacent F/B computes of each rank's program are paired, see
    # parallel/pipeline/p2p_programs.py: pair_programs); elsewhere this setting changes nothing
    overlap_ep: bool = True
    # the routed experts' backward under EP computes the input gradients first, sends them home by all-to-all and
    # computes the weight gradients while they travel (Megatron's delayed wgrad; moonep/dispatcher.py); results are
    # bit-identical to false
    expert_wgrad_split: bool = True
    attnres_comm: str = "cached"  # "cached" | "full"
    schedule: str = "auto"  # "auto" (interleaved 1F1B if vpp > 1 else 1F1B) | "1f1b" | "interleaved" | "afab"
    pp_layers: list[int] = field(default_factory=list)  # explicit layers per virtual stage (pp*vpp entries)
    recompute: bool = False  # full activation recomputation (what is kept: recompute_granularity)
    # the unit recomputed at once in a backward: "chunk" (a whole virtual stage: only its input is kept, all its
    # layers' activations live together in its backward) | "layer" (each layer's input kept) | "sublayer" (the
    # input of each token mixer and FFN kept; the mixers' head chunks and the MoE token chunks recomputed one at a
    # time: what a 64K-token CP slice of K3 needs, README "Long context")
    recompute_granularity: str = "chunk"
    # context parallel: MLA queries balanced over the CP ranks by half-segment swaps between rank pairs (kcp/mla_cp.py;
    # false: every rank attends its own segment's queries, the last rank doing cp - 1/2 of a mean cp/2)
    mla_cp_balance: bool = True
    # vision at pp > 1: where the first stage runs the encoder's forward / backward (parallel/pipeline/schedules.py):
    # "bubbles" (own actions in the pipeline's idle time) | "before" (all before / after the pipeline) | "inline"
    encoder_schedule: str = "bubbles"
    zero: int = 1  # 0: plain DP all-reduce, 1: ZeRO-1 optimizer sharding, 2: + gradient sharding
    backend: str = "auto"  # "auto" (nccl if CUDA else gloo) | "nccl" | "gloo"
    # seconds a collective / p2p may wait for its peers before this rank fails with a one-line error naming it
    # (a dead or stuck rank never hangs the job); applied to every process group. 0 = by backend: 300 gloo, 600 nccl
    collective_timeout_s: float = 0.0


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
    # a step with a non-finite loss or gradient is skipped (no update); this many in a row stop the run (exit 3)
    max_skipped_steps: int = 5
    eval_interval: int = 0  # validation loss every N steps and at the end of training; 0 = never
    eval_iters: int = 10  # global batches of the data's valid split per evaluation (the same ones every time)
    # torch intra-op threads per CPU rank; 0 = OMP_NUM_THREADS if exported, else this process's cores shared among
    # the ranks on its host (k3train/runtime/process_groups.py: choose_num_threads)
    num_threads: int = 0
    # kernel of each op (k3train/model/kernels.py; the choice is logged at start-up): "auto" picks by device, dtype and
    # what is installed (CPU: always the pure-torch op). kda: "torch" | "fla" (fla chunk_kda, CUDA); mla: "dense" |
    # "blockwise" | "flex" (FlexAttention, CUDA); experts: "grouped_mm" (torch._grouped_mm) | "padded_bmm" | "loop"
    kda_kernel: str = "auto"
    mla_kernel: str = "auto"
    experts_kernel: str = "auto"
    # quantization-aware training of the routed experts (k3train/quant/qat.py): "none" | "mxfp4" (weights: E2M1,
    # one E8M0 scale per 32 along each matmul's reduction dim, straight-through gradient); with it, optionally
    # qat_activations "mxfp8" (the expert matmuls' activation operands in E4M3, 32 per scale)
    qat: str = "none"
    qat_activations: str = "none"
    # what the run trains (k3train/draft/): "lm" (the model on next-token + MTP prediction) | "eagle3" (an EAGLE-3
    # draft fine-tuned from the MTP layer of a trained, frozen target: checkpoint.target; k3train/model/eagle3.py)
    objective: str = "lm"
    draft_loss: str = "lk"  # eagle3: "lk" (-log sum_x min(p, q): the acceptance rate) | "kl" (KL(p || q))
    draft_steps: int = 7  # eagle3: steps of the training-time test (tokens of a drafted chain)
    # eagle3: the completed AttnRes blocks (1-based) whose outputs are the draft's low and middle features; the high
    # feature is the final AttnRes aggregation (what the MTP layer reads). K3: blocks 1 and 4
    draft_feature_blocks: list[int] = field(default_factory=lambda: [1, 4])
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
    # the literal special tokens of data.tokenizer; their ids must equal model.bos/eos/pad/media_placeholder_token_id
    # wherever a run reads the tokenizer (k3train/preflight.py: check_token_ids)
    bos_token: str = "<|bos|>"
    eos_token: str = "<|eos|>"  # appended to every document by tools/prepare_data.py
    pad_token: str = "<|pad|>"
    media_placeholder_token: str = ""  # "" = no vision placeholder (then model.media_placeholder_token_id = -1)
    # "text": data.path is a text dataset (Megatron GPTDataset); "multimodal": data.path was made by
    # tools/prepare_data.py --multimodal (tokens + media store) and batches carry Batch.media (k3train/data/multimodal);
    # "chat": data.path was made by `k3train prepare-data --chat` (tokens + assistant-only loss mask): whole
    # conversations packed into rows, the loss on the assistant's tokens only (k3train/data/chat)
    format: str = "text"
    # chat: a conversation longer than train.seq_len + 1 tokens is dropped, or truncated to its first seq_len + 1
    # tokens ("truncate"); the counts are logged per split
    chat_overlong: str = "drop"
    max_media_pixels: int = 3584 * 3584  # multimodal: largest image / frame (height * width px) a run accepts


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
    # a start that would overwrite or be shadowed by another run's data (resume=none into a used out_dir, or
    # resume=PATH older than checkpoints beside it) is refused; true MOVES that data into previous-N/ instead
    overwrite: bool = False
    async_save: bool = False  # write checkpoints in a background thread (DCP async_save); training goes on
    # train.objective=eagle3: the frozen target, a complete checkpoint (step directory) of a k3train run of this
    # model with an MTP layer; read once at the start (not when the draft run resumes from its own checkpoint)
    target: str = ""
    # on SIGTERM/SIGINT every rank stops at the same step boundary and saves it; if that save has not finished
    # this many seconds after the signal, the rank exits and the last complete checkpoint stays. Keep it under
    # the scheduler's grace period and torchrun's --shutdown-timeout (30 s by default), after which come SIGKILLs
    preempt_timeout_s: float = 25.0
    # a Hugging Face checkpoint directory (config.json + safetensors, kimi_linear / kimi_k3) to START from: a fresh
    # run loads its weights in any parallel layout, each rank only its own tensors (k3train/hf/load.py); a resume
    # ignores it. Checked before anything is built (k3train/preflight.py); write the matching run config with
    # `k3train import-hf HF_DIR -o RUN.yaml`
    load_hf: str = ""


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


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "vision": VisionConfig,
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
    vision: VisionConfig = field(default_factory=VisionConfig)
    source: str = field(default="<defaults>", metadata={"derived": True})
    # "section.key" -> where its value was set ("in FILE:LINE" / "from the command line: --k=v"), for messages
    origins: dict[str, str] = field(default_factory=dict, metadata={"derived": True}, repr=False, compare=False)

    def origin(self, *keys: str) -> str:
        """Where the values of ``keys`` came from, for an error message: the file and line, the command-line
        argument, or the default -- so a bad override is never blamed on the file."""
        found = list(dict.fromkeys(self.origins[k] for k in keys if k in self.origins))
        cli = [o for o in found if o.startswith("from the command line")]
        found = cli or found  # several keys involved: the command line changed what the file had
        if found:
            return "; ".join(found)
        return f"default value; not set in {self.source}" if all("." in k for k in keys) else f"in {self.source}"

    # ----------------------------------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Config":
        """Check consistency and compute derived fields. ``world_size`` (when given) must match the layout."""
        m, p, t, o = self.model, self.parallel, self.train, self.optim

        def need(cond: bool, key: str, msg: str, *src: str) -> None:
            """Raise for ``key`` unless ``cond``; the message names where ``src`` (default: ``key``) was set."""
            if not cond:
                raise ConfigError(f"{key}: {msg} ({self.origin(*(src or (key,)))})")

        for sec_name in SECTIONS:
            sec = getattr(self, sec_name)
            for name in _count_fields(type(sec)):
                v = getattr(sec, name)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    need(v >= 0, f"{sec_name}.{name}", f"must be >= 0, got {v}")

        # model
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
        if m.num_experts > 0 and m.first_k_dense_replace < m.num_hidden_layers:
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
        # variants the published configs name but K3 does not use: rejected here, before any work starts
        need(m.mla_use_nope, "model.mla_use_nope", "false (rotary MLA) is not implemented; K3 uses NoPE")
        need(isinstance(m.mla_block_size, int) and m.mla_block_size > 0, "model.mla_block_size",
             f"must be a positive integer (the blockwise MLA attention's block), got {m.mla_block_size!r}")
        need(isinstance(m.moe_token_chunk, int) and m.moe_token_chunk > 0, "model.moe_token_chunk",
             f"must be a positive integer (tokens per LatentMoE chunk), got {m.moe_token_chunk!r}")
        need(isinstance(m.mixer_head_chunk, int) and m.mixer_head_chunk >= 0, "model.mixer_head_chunk",
             f"must be >= 0 (heads per token-mixer chunk; 0 = all heads), got {m.mixer_head_chunk!r}")
        need(not m.tie_word_embeddings, "model.tie_word_embeddings", "true is not supported (K3 unties them)")
        need(m.attn_res_block_size >= 1, "model.attn_res_block_size", "must be >= 1")
        # residual stream (Block AttnRes or the standard PreNorm ablation)
        need(m.residual in ("attnres", "standard"), "model.residual",
             f"must be 'attnres' or 'standard', got {m.residual!r}")
        need(m.num_nextn_predict_layers in (0, 1), "model.num_nextn_predict_layers", "0 or 1 MTP layer")
        need(m.kv_lora_rank > 0, "model.kv_lora_rank", f"must be > 0, got {m.kv_lora_rank}")
        need(m.vocab_size > max(0, 1), "model.vocab_size", "must be > 1")
        m.full_attn_layers = [i for i in range(1, m.num_hidden_layers + 1)
                              if i % m.full_attn_interval == 0 or i == m.num_hidden_layers]
        full_set = set(m.full_attn_layers)
        m.kda_layers = [i for i in range(1, m.num_hidden_layers + 1) if i not in full_set]
        m.num_attn_res_blocks = math.ceil(m.num_hidden_layers / m.attn_res_block_size)
        # model sizes: every size a layer that exists will use must be positive (a 0 builds empty tensors and
        # fails deep in a forward, or divides by zero); sizes of layer kinds the plan has none of may be 0
        n_kda = len(m.kda_layers)
        has_moe = m.num_experts > 0 and m.first_k_dense_replace < m.num_hidden_layers
        sizes = ["num_attention_heads", "qk_nope_head_dim", "v_head_dim"]  # the last layer is always Gated MLA
        sizes += ["kda_num_heads", "kda_head_dim", "kda_decay_rank", "short_conv_kernel_size"] if n_kda else []
        sizes += ["intermediate_size"] if m.first_k_dense_replace > 0 or m.num_experts == 0 else []
        sizes += ["moe_intermediate_size"] if has_moe else []
        sizes += ["shared_expert_intermediate_size"] if has_moe and m.num_shared_experts > 0 else []
        sizes += ["qb_bins"] if has_moe and m.router_balance == "qb" and m.qb_estimator == "histogram" else []
        for k in sizes:
            need(getattr(m, k) >= 1, f"model.{k}", f"must be >= 1, got {getattr(m, k)}")
        if m.q_lora_rank is None:  # HF's null: no query compression, the same model as 0
            m.q_lora_rank = 0
        for k in ("q_lora_rank", "qk_rope_head_dim", "num_experts", "num_shared_experts"):
            need(getattr(m, k) >= 0, f"model.{k}", f"must be >= 0, got {getattr(m, k)}")
        for k in ("rms_norm_eps", "init_std", "activation_situ_beta", "activation_situ_linear_beta",
                  "routed_scaling_factor"):
            need(getattr(m, k) > 0, f"model.{k}", f"must be > 0, got {getattr(m, k)}")
        need(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", f"must be >= 0, got {m.mtp_loss_weight}")
        need(m.sign_update_rate >= 0, "model.sign_update_rate", f"must be >= 0, got {m.sign_update_rate}")

        # parallel
        for k in ("pp", "vpp", "cp", "ep"):
            need(getattr(p, k) >= 1, f"parallel.{k}", f"must be >= 1, got {getattr(p, k)}")
        need(p.dp == -1 or p.dp >= 1, "parallel.dp", f"must be >= 1 or -1 (auto), got {p.dp}")
        need(p.attnres_comm in ("cached", "full"), "parallel.attnres_comm", "must be 'cached' or 'full'")
        need(p.schedule in ("auto", "1f1b", "interleaved", "afab"), "parallel.schedule",
             "must be 'auto', '1f1b', 'interleaved' or 'afab'")
        need(p.encoder_schedule in ("bubbles", "before", "inline"), "parallel.encoder_schedule",
             f"must be 'bubbles', 'before' or 'inline', got {p.encoder_schedule!r}")
        need(p.zero in (0, 1, 2), "parallel.zero", f"must be 0, 1 or 2, got {p.zero}")
        need(p.recompute_granularity in RECOMPUTE_GRANULARITIES, "parallel.recompute_granularity",
             f"must be one of {', '.join(RECOMPUTE_GRANULARITIES)}, got {p.recompute_granularity!r}")
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
                 f"world size {world_size} is not divisible by pp*cp = {denom}", "parallel.pp", "parallel.cp")
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
        need(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
        need(t.stop_at_step >= 0, "train.stop_at_step", f"must be >= 0 (0 = run to train.steps), got {t.stop_at_step}")
        need(t.global_batch_size >= 1, "train.global_batch_size", f"must be >= 1, got {t.global_batch_size}")
        need(t.seq_len >= 1, "train.seq_len", "must be >= 1")
        need(t.seq_len <= m.max_position_embeddings, "train.seq_len",
             f"seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")
        need(t.seq_len % p.cp == 0, "train.seq_len", f"seq_len={t.seq_len} not divisible by cp={p.cp}")
        need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
        need(t.dtype in ("float32", "bfloat16"), "train.dtype", "must be 'float32' or 'bfloat16'")
        need(t.device in ("auto", "cpu", "cuda"), "train.device", "must be 'auto', 'cpu' or 'cuda'")
        if dp is not None:
            per_step = t.micro_batch_size * dp
            need(t.global_batch_size % per_step == 0, "train.global_batch_size",
                 f"global_batch_size={t.global_batch_size} not divisible by micro_batch_size*dp = {per_step}",
                 "train.global_batch_size", "train.micro_batch_size", "parallel.dp")
            t.grad_accum_steps = t.global_batch_size // per_step
            if p.pp > 1 and p.vpp > 1:
                need(t.grad_accum_steps % p.pp == 0, "train.global_batch_size",
                     f"interleaved pipeline needs micro-batches per step ({t.grad_accum_steps}) to be a multiple"
                     f" of pp={p.pp}")
        need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")

        # non-finite steps and validation loss (k3train/runtime/nonfinite.py, k3train/evaluate.py)
        need(t.max_skipped_steps >= 1, "train.max_skipped_steps",
             f"must be >= 1 (consecutive non-finite steps before the run stops), got {t.max_skipped_steps}")
        if t.eval_interval > 0:
            need(t.eval_iters >= 1, "train.eval_iters", f"must be >= 1 when train.eval_interval > 0, got {t.eval_iters}")
            need(parse_split(self.data.split, f" ({self.origin('data.split')})")[1] > 0, "train.eval_interval",
                 f"validation every {t.eval_interval} steps needs a valid split, but data.split={self.data.split!r} "
                 "gives it weight 0 (e.g. data.split='98,2,0', or train.eval_interval=0)",
                 "train.eval_interval", "data.split")

        # CPU threads per rank (k3train/runtime/process_groups.py)
        need(t.num_threads >= 0, "train.num_threads", f"must be >= 0 (0 = automatic), got {t.num_threads}")

        # kernels per op (k3train/model/kernels.py): the backend names here; one forced where it cannot run is a
        # machine check (k3train/preflight.py: check_devices)
        from k3train.model.kernels import check_kernel_names

        bad_kernel = check_kernel_names(t)
        if bad_kernel is not None:
            need(False, bad_kernel[0], bad_kernel[1])

        # QAT of the routed experts (k3train/quant/qat.py): MX blocks of 32 along both reduction dims (l and f)
        need(t.qat in ("none", "mxfp4"), "train.qat", f"must be 'none' or 'mxfp4', got {t.qat!r}")
        need(t.qat_activations in ("none", "mxfp8"), "train.qat_activations",
             f"must be 'none' or 'mxfp8', got {t.qat_activations!r}")
        need(t.qat_activations == "none" or t.qat != "none", "train.qat_activations",
             f"{t.qat_activations} expert inputs are part of QAT: set train.qat=mxfp4 as well",
             "train.qat_activations", "train.qat")
        if t.qat != "none" and has_moe:
            for k, v in (("routed_expert_hidden_size" if m.latent_moe else "hidden_size", m.expert_hidden_size),
                         ("moe_intermediate_size", m.moe_intermediate_size)):
                need(v % 32 == 0, "train.qat",
                     f"{t.qat} quantizes the routed experts in blocks of 32 along their reduction dims, but "
                     f"model.{k}={v} is not a multiple of 32", "train.qat", f"model.{k}")

        # EAGLE-3 draft training (k3train/draft/, k3train/model/eagle3.py); the target checkpoint itself is checked
        # in preflight (k3train/draft/target.py)
        need(t.objective in ("lm", "eagle3"), "train.objective", f"must be 'lm' or 'eagle3', got {t.objective!r}")
        if t.objective == "eagle3":
            self._validate_eagle3(need)
        else:
            need(not self.checkpoint.target, "checkpoint.target",
                 f"is read only by train.objective=eagle3 (the draft's frozen target), but train.objective="
                 f"{t.objective}", "checkpoint.target", "train.objective")

        # optim
        need(o.name in ("muon", "adamw"), "optim.name", f"must be 'muon' or 'adamw', got {o.name!r}")
        need(o.schedule in ("cosine", "wsd", "constant"), "optim.schedule", "must be 'cosine', 'wsd' or 'constant'")
        need(o.lr > 0, "optim.lr", "must be > 0")
        need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        need(o.ns_dtype in ("float32", "bfloat16"), "optim.ns_dtype", "must be 'float32' or 'bfloat16'")
        need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        for k in ("adam_beta1", "adam_beta2", "muon_momentum"):
            need(0 <= getattr(o, k) < 1, f"optim.{k}", f"must be in [0, 1), got {getattr(o, k)}")
        need(o.adam_eps > 0, "optim.adam_eps", f"must be > 0, got {o.adam_eps}")
        need(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
        need(o.ns_steps >= 1, "optim.ns_steps", f"must be >= 1, got {o.ns_steps}")
        need(0 <= o.wsd_decay_fraction <= 1, "optim.wsd_decay_fraction", "must be in [0, 1]")
        need(o.qk_clip_threshold >= 0, "optim.qk_clip_threshold", "must be >= 0 (0 disables QK-Clip)")

        # token ids and their tokenizer names: the ids are compared with the tokenizer wherever a run reads it
        # (k3train/preflight.py: check_token_ids); a meta-device tool (count, memory, plan) reads none
        names = [self.data.bos_token, self.data.eos_token, self.data.pad_token]
        need(all(names) and len(set(names)) == 3, "data.bos_token",
             f"data.bos_token / eos_token / pad_token must be three different non-empty tokens, got {names}",
             "data.bos_token", "data.eos_token", "data.pad_token")

        # data: the split string (one parser, shared with the dataset builder)
        parse_split(self.data.split, f" ({self.origin('data.split')})")

        # multimodal data (k3train/data/multimodal): the format, the media size limit, the placeholder it needs
        d = self.data
        need(d.format in ("text", "multimodal", "chat"), "data.format",
             f"must be 'text', 'multimodal' or 'chat', got {d.format!r}")
        need(d.chat_overlong in ("drop", "truncate"), "data.chat_overlong",
             f"must be 'drop' or 'truncate', got {d.chat_overlong!r}")
        need(d.max_media_pixels >= 28 * 28, "data.max_media_pixels",
             f"must be >= {28 * 28} (one 28 x 28 px unit), got {d.max_media_pixels}")
        if d.format == "multimodal":
            need(bool(d.media_placeholder_token) and m.media_placeholder_token_id >= 0, "data.format",
                 "multimodal data needs data.media_placeholder_token (e.g. '<|media_pad|>' of "
                 "k3train/data/assets/tokenizer-vl.json) and its id in model.media_placeholder_token_id",
                 "data.format", "data.media_placeholder_token", "model.media_placeholder_token_id")
            # a text-only model would train on bare placeholder tokens and never see the media (the placeholder
            # id's range is checked with the vision section below; the tokenizer's token in preflight.check_data)
            need(self.vision.enabled, "data.format",
                 "multimodal data needs vision.enabled=true (the MoonViT-V2 encoder that turns the media into the "
                 "placeholders' embeddings); with vision.enabled=false the model never sees the media",
                 "data.format", "vision.enabled")

        # logging
        lg = self.logging
        need(lg.log_interval >= 1, "logging.log_interval", f"must be >= 1 (print every N steps), got {lg.log_interval}")
        need(lg.level in LOG_LEVELS, "logging.level", f"must be one of {', '.join(LOG_LEVELS)}, got {lg.level!r}")
        need(lg.wandb_mode in WANDB_MODES, "logging.wandb_mode",
             f"must be one of {', '.join(WANDB_MODES)}, got {lg.wandb_mode!r}")
        need(lg.peak_flops >= 0, "logging.peak_flops", "must be >= 0 (0 = measure at start-up)")

        # fault tolerance: collective timeout, preemption deadline
        need(math.isfinite(p.collective_timeout_s) and p.collective_timeout_s >= 0, "parallel.collective_timeout_s",
             f"must be >= 0 seconds (0 = backend default), got {p.collective_timeout_s}")
        need(math.isfinite(self.checkpoint.preempt_timeout_s) and self.checkpoint.preempt_timeout_s > 0,
             "checkpoint.preempt_timeout_s", f"must be > 0 seconds, got {self.checkpoint.preempt_timeout_s}")

        # checkpoint safety: overwrite only names what a start that is not a plain continuation may move aside
        need(not (self.checkpoint.overwrite and self.checkpoint.resume == "auto"), "checkpoint.overwrite",
             "true needs checkpoint.resume=none (a new run) or a checkpoint path; resume=auto continues the run")

        # vision: the MoonViT-V2 encoder + projector (k3train/model/vit.py); checked only when enabled
        v = self.vision
        if v.enabled:
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
            need(0 <= m.media_placeholder_token_id < m.vocab_size, "model.media_placeholder_token_id",
                 f"vision.enabled needs a placeholder id in [0, vocab_size={m.vocab_size}), got "
                 f"{m.media_placeholder_token_id}", "model.media_placeholder_token_id", "vision.enabled")
        return self

    def _validate_eagle3(self, need: Any) -> None:
        """``train.objective=eagle3``: what the draft needs of the config (the target checkpoint is preflight's)."""
        m, t, p = self.model, self.train, self.parallel
        need(bool(self.checkpoint.target), "checkpoint.target",
             "train.objective=eagle3 needs the frozen target: checkpoint.target=PATH, a complete checkpoint (step "
             "directory) of a trained k3train run of this model", "train.objective", "checkpoint.target")
        need(t.draft_loss in ("lk", "kl"), "train.draft_loss", f"must be 'lk' or 'kl', got {t.draft_loss!r}")
        need(t.draft_steps >= 1, "train.draft_steps", f"must be >= 1, got {t.draft_steps}")
        need(m.num_nextn_predict_layers == 1, "model.num_nextn_predict_layers",
             "train.objective=eagle3 fine-tunes the MTP layer into the draft: the model needs one (1)",
             "model.num_nextn_predict_layers", "train.objective")
        need(m.residual == "attnres", "model.residual",
             "train.objective=eagle3 reads the draft's features from the AttnRes blocks (model.residual=attnres)",
             "model.residual", "train.objective")
        blocks, done = t.draft_feature_blocks, m.num_hidden_layers // m.attn_res_block_size
        need(len(blocks) == 2 and all(1 <= b <= done for b in blocks), "train.draft_feature_blocks",
             f"needs two completed AttnRes blocks in 1..{done} ({m.num_hidden_layers} layers in blocks of "
             f"{m.attn_res_block_size}), got {blocks}", "train.draft_feature_blocks", "model.attn_res_block_size")
        need(p.cp == 1, "parallel.cp", "train.objective=eagle3 (the draft's training-time test) does not run under "
             "context parallelism; use parallel.cp=1", "parallel.cp", "train.objective")

    def ep_overlap(self) -> tuple[bool, str]:
        """Whether ``parallel.overlap_ep`` pairs the forward of micro-batch m+1 with the backward of micro-batch m
        in this run (validated config), and why not when it does not (for the log line)."""
        why = "parallel.overlap_ep=false" if not self.parallel.overlap_ep else self.pairing_blocker()
        return not why, why

    def pairing_blocker(self) -> str:
        """Why F/B pairing cannot apply to this layout whatever ``parallel.overlap_ep`` says ("" when it can)."""
        m, p, t = self.model, self.parallel, self.train
        return ("no expert parallelism (ep = 1 or no routed experts)" if p.ep == 1 or m.num_experts == 0
                else "one micro-batch per step" if t.grad_accum_steps < 2
                else "train.objective=eagle3 runs its own step" if t.objective != "lm"
                else "")

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
