"""The ``parallel`` section: the layout (pp, vpp, dp, cp, ep), schedules, recomputation, ZeRO, the backend, and
its checks -- the layout against the model's layers and against the world size (which resolves ``dp = -1``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3train.config.model import ModelConfig
from k3train.config.report import Need

RECOMPUTE_GRANULARITIES = ("chunk", "layer", "sublayer")  # parallel.recompute_granularity


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
    # time: what a 64K-token CP slice of K3 needs, docs/long-context.md)
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


def check_parallel(p: ParallelConfig, m: ModelConfig, world_size: int | None, need: Need) -> None:
    """The parallel section's own settings, then the layout against the model and the world size."""
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
    check_stages_against_model(p, m, need)
    check_layout_against_world(p, m, world_size, need)


def check_stages_against_model(p: ParallelConfig, m: ModelConfig, need: Need) -> None:
    """Cross-section: the model's layers fill the ``pp * vpp`` virtual stages (``parallel.pp_layers`` when
    given: one entry per stage, summing to ``model.num_hidden_layers``)."""
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


def check_layout_against_world(p: ParallelConfig, m: ModelConfig, world_size: int | None, need: Need) -> None:
    """Cross-section: ``pp * dp * cp`` is the world size when one is given (``dp = -1`` resolved from it here);
    ``ep`` divides ``dp * cp`` and ``model.num_experts``."""
    if world_size is not None:
        denom = p.pp * p.cp
        need(world_size % denom == 0, "parallel",
             f"world size {world_size} is not divisible by pp*cp = {denom}", "parallel.pp", "parallel.cp")
        auto_dp = world_size // denom
        if p.dp == -1:
            p.dp = auto_dp
        need(p.dp * denom == world_size, "parallel.dp",
             f"pp*dp*cp = {p.pp}*{p.dp}*{p.cp} = {p.pp * p.dp * p.cp} != world size {world_size}")
    if p.dp != -1:
        need((p.dp * p.cp) % p.ep == 0, "parallel.ep", f"ep={p.ep} must divide dp*cp = {p.dp * p.cp}")
    if p.ep > 1 and m.num_experts > 0:
        need(m.num_experts % p.ep == 0, "parallel.ep",
             f"num_experts={m.num_experts} not divisible by ep={p.ep}")


def check_collective_timeout(p: ParallelConfig, need: Need) -> None:
    """Fault tolerance: how long a collective may wait for its peers."""
    need(math.isfinite(p.collective_timeout_s) and p.collective_timeout_s >= 0, "parallel.collective_timeout_s",
         f"must be >= 0 seconds (0 = backend default), got {p.collective_timeout_s}")
