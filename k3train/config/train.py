"""The ``train`` section: run length, batch, sequence, numerics, evaluation, kernels, QAT and the objective; and
its checks -- the batch against the layout, the sequence against the model and CP, validation against the data
split, QAT blocks against the experts' widths."""
from __future__ import annotations

from dataclasses import dataclass, field

from k3train.config.data import DataConfig, parse_split
from k3train.config.kernels import check_kernel_names
from k3train.config.model import ModelConfig
from k3train.config.parallel import ParallelConfig
from k3train.config.report import Need, Origin


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


def check_train(t: TrainConfig, m: ModelConfig, p: ParallelConfig, d: DataConfig, need: Need,
                origin: Origin) -> None:
    """The train section, with its cross-section checks where its keys meet other sections."""
    need(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    need(t.stop_at_step >= 0, "train.stop_at_step", f"must be >= 0 (0 = run to train.steps), got {t.stop_at_step}")
    need(t.global_batch_size >= 1, "train.global_batch_size", f"must be >= 1, got {t.global_batch_size}")
    need(t.seq_len >= 1, "train.seq_len", "must be >= 1")
    check_seq_len_against_model_and_cp(t, m, p, need)
    need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    need(t.dtype in ("float32", "bfloat16"), "train.dtype", "must be 'float32' or 'bfloat16'")
    need(t.device in ("auto", "cpu", "cuda"), "train.device", "must be 'auto', 'cpu' or 'cuda'")
    check_batch_against_layout(t, p, need)
    need(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    # non-finite steps (k3train/runtime/nonfinite.py) and validation loss (k3train/evaluate.py)
    need(t.max_skipped_steps >= 1, "train.max_skipped_steps",
         f"must be >= 1 (consecutive non-finite steps before the run stops), got {t.max_skipped_steps}")
    if t.eval_interval > 0:
        check_eval_against_split(t, d, need, origin)
    # CPU threads per rank (k3train/runtime/process_groups.py)
    need(t.num_threads >= 0, "train.num_threads", f"must be >= 0 (0 = automatic), got {t.num_threads}")
    # kernels per op: the backend names here; one forced where it cannot run is a machine check
    # (k3train/preflight.py: check_devices)
    bad_kernel = check_kernel_names(t)
    if bad_kernel is not None:
        need(False, *bad_kernel)
    check_qat(t, m, need)


def check_seq_len_against_model_and_cp(t: TrainConfig, m: ModelConfig, p: ParallelConfig, need: Need) -> None:
    """Cross-section: a sequence fits the model's positions and splits evenly over the CP ranks."""
    need(t.seq_len <= m.max_position_embeddings, "train.seq_len",
         f"seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}")
    need(t.seq_len % p.cp == 0, "train.seq_len", f"seq_len={t.seq_len} not divisible by cp={p.cp}")


def check_batch_against_layout(t: TrainConfig, p: ParallelConfig, need: Need) -> None:
    """Cross-section, once ``parallel.dp`` is known: the global batch is whole micro-batches on every
    data-parallel rank (``train.grad_accum_steps`` derived here), a multiple of pp of them under the interleaved
    pipeline."""
    if p.dp == -1:
        return
    per_step = t.micro_batch_size * p.dp
    need(t.global_batch_size % per_step == 0, "train.global_batch_size",
         f"global_batch_size={t.global_batch_size} not divisible by micro_batch_size*dp = {per_step}",
         "train.global_batch_size", "train.micro_batch_size", "parallel.dp")
    t.grad_accum_steps = t.global_batch_size // per_step
    if p.pp > 1 and p.vpp > 1:
        need(t.grad_accum_steps % p.pp == 0, "train.global_batch_size",
             f"interleaved pipeline needs micro-batches per step ({t.grad_accum_steps}) to be a multiple"
             f" of pp={p.pp}")


def check_eval_against_split(t: TrainConfig, d: DataConfig, need: Need, origin: Origin) -> None:
    """Cross-section: validation every ``train.eval_interval`` steps reads batches of a valid split that has
    weight in ``data.split``."""
    need(t.eval_iters >= 1, "train.eval_iters", f"must be >= 1 when train.eval_interval > 0, got {t.eval_iters}")
    need(parse_split(d.split, f" ({origin('data.split')})")[1] > 0, "train.eval_interval",
         f"validation every {t.eval_interval} steps needs a valid split, but data.split={d.split!r} "
         "gives it weight 0 (e.g. data.split='98,2,0', or train.eval_interval=0)",
         "train.eval_interval", "data.split")


def check_qat(t: TrainConfig, m: ModelConfig, need: Need) -> None:
    """QAT of the routed experts (k3train/quant/qat.py): the formats, and (cross-section) MX blocks of 32 along
    both of the experts' reduction dims (l and f)."""
    need(t.qat in ("none", "mxfp4"), "train.qat", f"must be 'none' or 'mxfp4', got {t.qat!r}")
    need(t.qat_activations in ("none", "mxfp8"), "train.qat_activations",
         f"must be 'none' or 'mxfp8', got {t.qat_activations!r}")
    need(t.qat_activations == "none" or t.qat != "none", "train.qat_activations",
         f"{t.qat_activations} expert inputs are part of QAT: set train.qat=mxfp4 as well",
         "train.qat_activations", "train.qat")
    if t.qat == "none" or not m.has_moe:
        return
    for k, v in (("routed_expert_hidden_size" if m.latent_moe else "hidden_size", m.expert_hidden_size),
                 ("moe_intermediate_size", m.moe_intermediate_size)):
        need(v % 32 == 0, "train.qat",
             f"{t.qat} quantizes the routed experts in blocks of 32 along their reduction dims, but "
             f"model.{k}={v} is not a multiple of 32", "train.qat", f"model.{k}")
