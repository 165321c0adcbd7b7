"""Apply expert parallelism to a (possibly pipeline-pruned) model: shard routed experts, install the dispatcher.

``apply_expert_parallel(model, dims, moonep=True)``: for every ``LatentMoE``, keep experts
``[e0, e0 + n)`` (``n = E/ep``, ``e0 = ep_rank * n``) as the parameters -- FQNs unchanged,
``...experts.w_gate`` now ``[n, l, f]`` -- and set ``LatentMoE.dispatcher`` to an :class:`EPDispatcher`.

Gradient reduction. Routed-expert parameters are marked ``param._k3_expert_parallel = True``; their gradients are
complete for the EP group after the MoE backward (the dispatcher brings every route's gradient to the owner) and
must be SUM-reduced over ``dims.group('edp')`` only -- :func:`param_reduce_group` says which group for any
parameter (everything else: ``dp_cp``).

Checkpoints. Each shard records ``_k3_global_shape`` and ``_k3_shard_offset`` (and ``GroupedExperts.expert_offset``
for the name-seeded init). For DCP, :func:`dcp_state_dict` wraps every expert shard as a ``DTensor`` with
``Shard(0)`` over the EP group's mesh (sharing the parameter's storage): DCP writes each expert slice once
(EDP replicas are de-duplicated) and reloads into any other ``ep`` -- or a single process -- by resharding.
:func:`as_expert_dtensor` does the same for optimizer state of the same shape.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3train.model.moe import GroupedExperts, LatentMoE
from moonep.comm import CommBuffers
from moonep.dispatcher import EPDispatcher, EPSide
from moonep.replica_pool import ReplicaPool

logger = logging.getLogger(__name__)

EXPERT_PARAM_NAMES = ("w_gate", "w_up", "w_down")


@dataclass
class ExpertParallelState:
    """What :func:`apply_expert_parallel` built (shared by every MoE layer of this rank)."""

    buffers: CommBuffers
    weight_group: Any = None
    pool: ReplicaPool = field(default_factory=ReplicaPool)  # MoonEP replica banks shared by every MoE layer
    dispatchers: dict[str, EPDispatcher] = field(default_factory=dict)
    pair_side: EPSide | None = None  # side 1 of F/B pairing (parallel.overlap_ep), shared by every MoE layer
    _mesh: Any = None

    def ep_mesh(self, dims: Any, device_type: str) -> Any:
        """1-D ``DeviceMesh`` over this rank's EP group (built once; None when ep == 1)."""
        if self._mesh is None and dims.group("ep") is not None:
            self._mesh = DeviceMesh.from_group(dims.group("ep"), device_type)
        return self._mesh


def _modules(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _latent_moes(model: nn.Module | Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    return [(name, m) for _, name, m in _latent_moes_by_chunk(model)]


def _latent_moes_by_chunk(model: nn.Module | Iterable[nn.Module]) -> list[tuple[int, str, nn.Module]]:
    """``(chunk index, name, LatentMoE)`` in module (= forward) order."""
    return [(c, name, m) for c, mod in enumerate(_modules(model)) for name, m in mod.named_modules()
            if isinstance(m, LatentMoE)]


def _build_weight_group(dims: Any, desc: str = "ep_weights") -> Any:
    """A second process group per EP group (collective: every rank of the world calls it in the same order), so
    replica weights move concurrently with the token all-to-all."""
    if not dist.is_initialized() or dims.ep == 1:
        return None
    mine = None
    for ranks in dims.all_group_ranks("ep"):
        g = dims.new_group(ranks, desc)  # the layout's backend and collective timeout
        if dims.rank in ranks:
            mine = g
    return mine


def mark_expert_params(model: nn.Module | Iterable[nn.Module]) -> int:
    """(Re)set ``_k3_expert_parallel``, ``_k3_global_shape``, ``_k3_shard_offset`` on every routed-expert
    parameter, from its ``GroupedExperts`` (``expert_offset``, ``num_global_experts``). Idempotent; call it again
    after anything that replaces Parameter objects (``to_empty``, ``load_state_dict(assign=True)``), which drops
    Python attributes. Returns the number of parameters marked."""
    marked = 0
    for mod in _modules(model):
        for m in mod.modules():
            if not isinstance(m, GroupedExperts):
                continue
            num_global = getattr(m, "num_global_experts", None) or m.num_experts
            for pname in EXPERT_PARAM_NAMES:
                p = getattr(m, pname)
                p._k3_expert_parallel = True
                p._k3_global_shape = (num_global,) + tuple(p.shape[1:])
                p._k3_shard_offset = int(getattr(m, "expert_offset", 0))
                marked += 1
    return marked


def shard_experts(experts: nn.Module, ep: int, ep_rank: int) -> None:
    """Keep experts ``[ep_rank*n, (ep_rank+1)*n)`` of a ``GroupedExperts`` as its parameters (new Parameters,
    same names; works on the meta device)."""
    if getattr(experts, "num_global_experts", None) is not None:
        raise ValueError("apply_expert_parallel: experts are already sharded")
    num = experts.num_experts
    if num % ep != 0:
        raise ValueError(f"parallel.ep={ep} must divide model.num_experts={num}")
    n = num // ep
    e0 = ep_rank * n
    for pname in EXPERT_PARAM_NAMES:
        old = getattr(experts, pname)
        setattr(experts, pname, nn.Parameter(old.data[e0:e0 + n].clone(), requires_grad=old.requires_grad))
    experts.num_experts = n
    experts.expert_offset = e0
    experts.num_global_experts = num
    mark_expert_params(experts)


def _build_pair_side(dims: Any, moonep: bool, separate_weight_group: bool) -> EPSide:
    """Side 1 of F/B pairing: a second EP group over the same ranks (``dims``' ``ep_pair`` groups), its own
    replica-weight group, token buffers and replica pool (collective: every rank calls it in the same order)."""
    ep_group = dims.build_twin_groups("ep", "ep_pair")
    weights = _build_weight_group(dims, "ep_weights_pair") if separate_weight_group and moonep else None
    return EPSide(ep_group=ep_group, weight_group=weights if weights is not None else ep_group,
                  buffers=CommBuffers(), pool=ReplicaPool())


def apply_expert_parallel(model: nn.Module | Iterable[nn.Module], dims: Any, moonep: bool = True,
                          impl: str = "auto", separate_weight_group: bool = True,
                          paired: bool = False, split_wgrad: bool = True) -> ExpertParallelState:
    """Shard every ``LatentMoE``'s routed experts over ``dims.group('ep')`` and install :class:`EPDispatcher`.

    ``model``: a module or the list of this rank's model chunks, possibly on the meta device (then materialise
    with ``to_empty`` + ``init_weights``, which seeds per global expert via ``expert_offset``, and call
    :func:`mark_expert_params` again: ``to_empty`` drops the marks). Collective when ``separate_weight_group``
    (it creates process groups): call it on every rank. With ``ep == 1`` only the parameter marks are set (the
    ``edp`` group then equals ``dp_cp``) and the local dispatcher stays. ``paired``: also build side 1 of F/B
    pairing (``parallel.overlap_ep``, :mod:`parallel.pairing`) for every dispatcher (collective too).
    ``split_wgrad``: the dispatchers compute the own experts' weight gradients while the input gradients'
    all-to-all travels (``parallel.expert_wgrad_split``, :class:`moonep.dispatcher.EPDispatcher`).
    """
    state = ExpertParallelState(buffers=CommBuffers())
    if dims.ep > 1 and separate_weight_group and moonep:
        state.weight_group = _build_weight_group(dims)
    if dims.ep > 1 and paired:
        state.pair_side = _build_pair_side(dims, moonep, separate_weight_group)
    order = {}
    for chunk, name, moe in _latent_moes_by_chunk(model):
        if dims.ep == 1:
            mark_expert_params(moe)
            continue
        num_experts = moe.experts.num_experts
        shard_experts(moe.experts, dims.ep, dims.ep_rank)
        disp = EPDispatcher(num_experts=num_experts, ep_group=dims.group("ep"), ep_ranks=dims.ranks("ep"),
                            ep_rank=dims.ep_rank, moonep=moonep, weight_group=state.weight_group,
                            buffers=state.buffers, name=name, impl=impl, pool=state.pool, chunk=chunk,
                            order=order.setdefault(chunk, 0), pair_side=state.pair_side,
                            split_wgrad=split_wgrad)
        order[chunk] += 1
        moe.dispatcher = disp
        state.dispatchers[name] = disp
    # per rank, so debug: rank 0 logs every pipeline rank's count (k3train/parallelize.py: log_moe_layers)
    logger.debug("expert parallel: %d MoE layers sharded on this rank, ep=%d, moonep=%s", len(state.dispatchers),
                 dims.ep, moonep)
    return state


def is_expert_param(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_k3_expert_parallel", False))


def param_reduce_group(name: str, param: torch.Tensor, dims: Any) -> Any:
    """The group over which ``param``'s gradient is SUM-reduced: ``edp`` for routed experts, else ``dp_cp``.
    ``name`` is unused (kept so callers can pass FQNs uniformly)."""
    return dims.group("edp") if is_expert_param(param) else dims.group("dp_cp")


def as_expert_dtensor(tensor: torch.Tensor, param: torch.Tensor, mesh: Any) -> Any:
    """``tensor`` (this rank's ``[n, ...]`` shard of an expert param or its optimizer state) as a ``DTensor``
    ``Shard(0)`` of the global ``[E, ...]`` over ``mesh``; shares storage. Returns ``tensor`` for unsharded."""
    global_shape = getattr(param, "_k3_global_shape", None)
    if mesh is None or global_shape is None or tuple(global_shape) == tuple(tensor.shape):
        return tensor
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                              stride=stride)


def dcp_state_dict(model: nn.Module, dims: Any, state: ExpertParallelState | None = None) -> dict[str, Any]:
    """``model.state_dict()`` with routed-expert shards as ``DTensor(Shard(0))`` over the EP mesh (storage
    shared with the parameters, so ``dcp.load`` into it loads the model). Collective the first time (mesh)."""
    sd = model.state_dict()
    params = dict(model.named_parameters())
    mesh = None
    for key, val in sd.items():
        p = params.get(key)
        if p is None or not is_expert_param(p) or getattr(p, "_k3_global_shape", None) is None:
            continue
        if mesh is None:
            holder = state if state is not None else ExpertParallelState(buffers=CommBuffers())
            mesh = holder.ep_mesh(dims, val.device.type)
        sd[key] = as_expert_dtensor(val, p, mesh)
    return sd


def gather_full_experts(experts: nn.Module, dims: Any, grads: bool = False) -> tuple[torch.Tensor, ...]:
    """All-gather the EP shards (or their ``.grad``) of a sharded ``GroupedExperts`` into full ``[E, ...]``
    tensors on every rank of the EP group (tests, checkpoint conversion). Collective over ``ep``."""
    out = []
    for pname in EXPERT_PARAM_NAMES:
        p = getattr(experts, pname)
        t = p.grad if grads else p.data
        if t is None:
            t = torch.zeros_like(p)
        group = dims.group("ep")
        if group is None:
            out.append(t.clone())
            continue
        parts = [torch.empty_like(t) for _ in range(dims.ep)]
        dist.all_gather(parts, t.contiguous(), group=group)
        out.append(torch.cat(parts))
    return tuple(out)
