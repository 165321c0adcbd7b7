"""Apply the parallel layout to a K3 model from outside: pipeline split (PP/VPP), expert parallel (EP, MoonEP),
context parallel (KCP), and hand the trainer one :class:`ParallelModel`.

The model itself (``k3train/model``) is plain ``nn.Module``s; everything distributed lives in ``parallel/``,
``moonep/`` and ``kcp/`` and is wired here:

* the pipeline runner builds this rank's stage (meta-built, pruned to the owned layers, name-seeded init, so
  values and parameter names match the single-process model) and runs the schedule;
* MoonEP shards each LatentMoE's experts over the ``ep`` group and installs its dispatcher;
* under CP every micro-batch's ``SeqInfo`` carries a :class:`kcp.KCPContext` over the ``cp`` group;
* Pipeline ZeRO-2 (and ZeRO 0 / 1's all-reduce): the runner calls ``optimizer.reduce_chunk_grads`` as each chunk's
  gradients become final.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from k3train.config import Config
from k3train.draft import DraftObjective, draft_modules, freeze_target
from k3train.model.flops import draft_flops_per_token, model_flops_per_token
from k3train.model.model import K3Model
from k3train.model.moe import LatentMoE, Router
from k3train.model.seq import SeqInfo
from k3train.ops.kda import layer_kda_op
from k3train.quant.qat import apply_qat
from kcp import KCPContext
from kcp.vision_cp import VisionCPContext
from moonep import (
    apply_expert_parallel,
    as_expert_dtensor,
    collect_moonep_metrics,
    dcp_state_dict,
    is_expert_param,
    sync_router_balance,
)
from parallel.dims import ParallelDims
from parallel.pipeline.loss_norm import LossNorm
from parallel.pipeline.runner import StepRunner, build_step_runner

log = logging.getLogger(__name__)


def make_seq_builder(cfg: Config, dims: ParallelDims) -> Callable[[Any], SeqInfo]:
    """``batch -> SeqInfo``; attaches a KCP context (collective over ``cp``) when context parallel is on, and
    with vision (``vision.cp_split_min_patches > 0``) the micro-batch's vision CP context to the batch
    (``batch.vision_cp``, collective over ``cp``: the CP ranks share the encoding, kcp/vision_cp.py)."""
    build = seq_builder(cfg, dims.cp, dims)
    v = cfg.vision
    if dims.cp == 1 or not v.enabled or v.cp_split_min_patches == 0:
        return build

    def build_with_vision(b: Any) -> SeqInfo:
        if getattr(b, "media", None) is not None:  # a multimodal run's batches always carry media (maybe none)
            b.vision_cp = VisionCPContext(dims, b.media.grid_thw, v.cp_split_min_patches, v.merge_size)
        return build(b)

    return build_with_vision


def seq_builder(cfg: Config, cp: int, group: Any) -> Callable[[Any], SeqInfo]:
    """``batch -> SeqInfo`` for a CP group of size ``cp`` (``group``: ParallelDims, a process group, or the memory
    estimator's simulated group)."""
    if cp == 1:
        return lambda b: SeqInfo.from_doc_ids(b.doc_ids, b.positions)

    kda_fn = layer_kda_op(cfg.model)  # the layer's op (chunking, gate bound), exactly

    balance = cfg.parallel.mla_cp_balance

    def build(b: Any) -> SeqInfo:
        return SeqInfo.from_doc_ids(b.doc_ids, b.positions,
                                    cp=KCPContext.from_batch(b, group, kda_fn=kda_fn, mla_balance=balance))

    return build


@dataclass
class ParallelModel:
    cfg: Config
    dims: ParallelDims
    runner: StepRunner
    ep_state: Any = None
    flops_per_token: float = 0.0
    draft: Any = None  # train.objective=eagle3: the DraftObjective (k3train/draft/objective.py); the target frozen

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def modules(self) -> list[nn.Module]:
        return self.runner.modules

    def grad_group_fn(self, name: str, param: nn.Parameter) -> str:
        """Which group a parameter's gradient is summed (and its ZeRO owner chosen) over."""
        return "edp" if is_expert_param(param) else "dp_cp"

    def set_chunk_backward_hook(self, optimizer: Any) -> None:
        """Every ZeRO stage starts reducing a virtual chunk's gradients as soon as its last backward is done, so the
        reduction overlaps the rest of the pipeline: ZeRO-2 reduces to owners, ZeRO 0 / 1 all-reduce (async)."""
        self.runner.on_chunk_backward_done = optimizer.reduce_chunk_grads

    def forward_backward(self, micro_batches: list[Any], norm: LossNorm) -> dict[str, Any]:
        return self.runner.forward_backward(micro_batches, norm)

    def sync_router_balance(self) -> tuple[dict[str, float], dict[str, float]]:
        """All-reduce Quantile-Balancing statistics over every rank routing the layer; new biases next step.

        Returns ``(worst, totals)``: worst-case load metrics (to MAX over pipeline ranks) and byte/replica counts
        (to SUM over all ranks). The same keys on every rank (a stage may hold no MoE layer)."""
        if self.cfg.model.num_experts == 0:
            return {}, {}
        if self.draft is not None:  # a frozen target's routers keep their biases: only the draft's is balanced
            m = sync_router_balance(draft_modules(self.model), self.dims)
        else:
            m = sync_router_balance(self.modules, self.dims)
        worst = {"moe_maxvio": float(m.get("router/maxvio_max", 0.0))}
        totals: dict[str, float] = {}
        if self.dims.ep > 1:
            e = collect_moonep_metrics(self.modules)
            worst["ep_load_max_over_mean_before"] = float(e.get("moonep/worst_max_over_mean_before", 0.0))
            worst["ep_load_max_over_mean_after"] = float(e.get("moonep/worst_max_over_mean_after", 0.0))
            totals = {"ep_token_bytes": float(e.get("moonep/token_bytes", 0.0)),
                      "ep_weight_bytes": float(e.get("moonep/weight_bytes", 0.0)),
                      "ep_replicas": float(e.get("moonep/replicas", 0.0))}
        return worst, totals

    def discard_step_statistics(self) -> None:
        """Drop what forwards accumulated since the last :meth:`sync_router_balance` without using it: routers'
        balancing statistics (a skipped non-finite step must not move the biases) and MoonEP dispatch metrics
        (an evaluation's must not count in the next step). No communication."""
        for mod in self.modules:
            for m in mod.modules():
                if isinstance(m, Router):
                    m.reset_balance_state()
        collect_moonep_metrics(self.modules)

    # checkpoints: full-model FQNs; routed-expert shards as DTensors over the EP mesh
    def state_dict(self) -> dict[str, Any]:
        if self.dims.ep > 1:
            sd = dcp_state_dict(self.model, self.dims, self.ep_state)
        else:
            sd = self.model.state_dict()
        # the last stage's copy of the MTP-shared embedding is saved once (by the first stage)
        replica = {id(p) for p in self.runner.replica_params}
        for name, p in self.model.named_parameters():
            if id(p) in replica:
                sd.pop(name, None)
        return sd

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's flat ``{fqn.state_name: tensor}`` dict, with routed-expert entries turned into DTensor
        shards over the EP mesh: every EP rank holds a different slice under the same parameter name, so plain
        tensors would collide in the checkpoint."""
        sd = optimizer.state_dict()
        if self.dims.ep == 1:
            return sd

        mesh = None
        for fqn, p in self.model.named_parameters():
            if not is_expert_param(p) or getattr(p, "_k3_global_shape", None) is None:
                continue
            for key in [k for k in sd if k.startswith(fqn + ".")]:
                if tuple(sd[key].shape) == tuple(p.shape):
                    mesh = mesh or self.ep_state.ep_mesh(self.dims, p.device.type)
                    sd[key] = as_expert_dtensor(sd[key], p, mesh)
        return sd

    @staticmethod
    def local_tensors(sd: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in sd.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """``dcp.load`` already copied into the tensors of :meth:`state_dict` (they share storage with the
        parameters); copy again for safety and refresh the replica embedding from its source."""
        own = self.model.state_dict()
        with torch.no_grad():
            for k, v in sd.items():
                local = v.to_local() if hasattr(v, "to_local") else v
                if k in own and own[k].data_ptr() != local.data_ptr():
                    own[k].copy_(local)
        self.runner.sync_replica_weights()  # collective over the first/last-stage pair (no-op without one)


def cast_params_to_bf16(modules: list[nn.Module]) -> None:
    """``train.dtype=bfloat16``: parameters (and so activations and gradients) in bf16; the optimizer keeps fp32
    master copies of every non-fp32 parameter, sharded with its other state under ZeRO. Buffers stay fp32 (router
    biases and QB statistics need the precision); norms and the KDA core compute in fp32 internally."""
    with torch.no_grad():
        for mod in modules:
            for p in mod.parameters():
                if p.dtype == torch.float32:
                    p.data = p.data.to(torch.bfloat16)


def moe_layers_held(modules: list[nn.Module]) -> tuple[int, int]:
    """``(backbone MoE layers, MTP MoE layers)`` in this rank's modules (the pruned pipeline stage)."""
    names = [n for mod in modules for n, m in mod.named_modules() if isinstance(m, LatentMoE)]
    mtp = sum(1 for n in names if n.startswith("mtp."))
    return len(names) - mtp, mtp


def log_moe_layers(modules: list[nn.Module], dims: ParallelDims, moonep: bool) -> None:
    """Rank 0 logs how many MoE layers every pipeline rank holds (gathered over the default group: one collective
    every rank joins once at build time), so the line agrees with the partition table on every stage."""
    mine = (dims.pp_rank if dims.pp > 1 else 0, *moe_layers_held(modules))
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if dims.rank != 0:
        return
    per_pp = {pr: (b, t) for pr, b, t in every}  # every dp/cp rank of a pipeline rank holds the same layers
    held = ", ".join(f"pp rank {pr}: {b}" + (f" + {t} in the MTP layer" if t else "") for pr, (b, t) in
                     sorted(per_pp.items()))
    log.info("MoE layers held: %s; expert parallel ep=%d%s", held, dims.ep,
             f", moonep={'on' if moonep else 'off'}" if dims.ep > 1 else " (experts not sharded)")


def parallelize(cfg: Config, dims: ParallelDims, device: torch.device) -> ParallelModel:
    """Build this rank's part of the model with every parallel dimension applied (collective). For
    ``train.objective=eagle3`` the model carries the draft's ``W_E3`` and everything but the draft is frozen
    (k3train/draft/objective.py); the target's weights are loaded by the trainer."""
    eagle3 = cfg.train.objective == "eagle3"
    factory = None
    if eagle3:
        def factory() -> nn.Module:
            return K3Model(cfg.model, cfg.vision, eagle3=True)
    runner = build_step_runner(factory, cfg, dims, make_seq=make_seq_builder(cfg, dims), device=device,
                               num_microbatches=cfg.train.grad_accum_steps)
    ep_state = None
    if cfg.model.num_experts > 0:
        paired, why_not = cfg.ep_overlap()  # parallel.overlap_ep: F/B pairing (parallel/pairing.py)
        ep_state = apply_expert_parallel(runner.modules, dims, moonep=cfg.parallel.moonep, paired=paired,
                                         split_wgrad=cfg.parallel.expert_wgrad_split)
        log_moe_layers(runner.modules, dims, cfg.parallel.moonep)
        if paired:
            if dims.cp > 1:  # the paired forward's KCP / MLA-CP / vision-CP exchanges on a CP group of their own
                dims.build_twin_groups("cp", "cp_pair")
            runner.enable_pairing(dims.rank)
        if dims.rank == 0 and dims.ep > 1:
            log.info("overlap_ep: %s", "on (the forward of micro-batch m+1 paired with the backward of m, on a "
                     "second thread and EP group" + (" and CP group)" if dims.cp > 1 else ")") if paired else f"off ({why_not})")
        if cfg.train.qat != "none" or cfg.train.qat_activations != "none":
            n_qat = apply_qat(runner.modules, cfg.train.qat, cfg.train.qat_activations)
            if dims.rank == 0:
                log.info("QAT: routed experts' weights %s, inputs %s (%d expert modules on rank 0)",
                         cfg.train.qat, cfg.train.qat_activations, n_qat)
    if cfg.train.dtype == "bfloat16":
        cast_params_to_bf16(runner.modules)
    if not eagle3:
        flops = model_flops_per_token(cfg.model, cfg.train.seq_len)
        return ParallelModel(cfg=cfg, dims=dims, runner=runner, ep_state=ep_state, flops_per_token=flops)

    freeze_target(runner.model)
    flops = draft_flops_per_token(cfg.model, cfg.train.seq_len, cfg.train.draft_steps)
    return ParallelModel(cfg=cfg, dims=dims, runner=runner, ep_state=ep_state, flops_per_token=flops,
                         draft=DraftObjective(cfg, runner))
