"""Building this rank's pipeline stage model and grouping its parameters by local chunk.

Construction (``build_stage_model``): the full model is built on the ``meta`` device (no memory, any size), pruned
to what this pipeline rank owns, materialised with ``to_empty`` on the target device and initialised with
``init_weights(seed)``. K3Model initialises every parameter from a generator seeded by (seed, FQN), so the values
are identical to the single-process model's whatever the layout. Owned parameters keep their full-model FQNs
(``layers`` is keyed by the global layer index; pruned top-level parts are set to ``None``), so checkpoints are
layout-independent. A model *instance* can be passed instead; it is pruned in place (already initialised).

What a rank keeps: the layers of its virtual stages; ``embed_tokens`` (and any other top-level part that is not
one of the head parts, e.g. a vision encoder) on the first stage; ``final_attnres, norm, lm_head, mtp`` (and the
EAGLE-3 draft's ``eagle3``) on the last stage. The MTP layer embeds token t+1 with the backbone's (shared)
``embed_tokens``, so the last stage also keeps a copy; the two copies' gradients are summed over the ``embd`` group
(first + last pipeline rank) before the optimizer sees them, as Megatron does for tied embeddings, and both copies
then take identical steps.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.pipeline.partition import PipelinePartition

HEAD_PARTS = ("final_attnres", "norm", "lm_head", "mtp", "eagle3")
EMBED = "embed_tokens"


def owned_layers(part: PipelinePartition, pp_rank: int) -> set[int]:
    return {i for s, e in part.local_chunks(pp_rank) for i in range(s, e)}


def prune_to_stage(model: nn.Module, part: PipelinePartition, pp_rank: int) -> nn.Module:
    """Drop (in place) every layer and top-level part this pipeline rank does not run. Returns ``model``.
    The last stage keeps ``embed_tokens`` when the model has an MTP layer (which embeds token t+1)."""
    if part.pp == 1:
        return model
    first, last = pp_rank == part.placement.first_rank, pp_rank == part.placement.last_rank
    keep = owned_layers(part, pp_rank)
    layers = model.layers
    if isinstance(layers, nn.ModuleDict):
        for key in list(layers.keys()):
            if int(key) not in keep:
                del layers[key]
    else:
        raise TypeError(f"pipeline pruning needs model.layers to be an nn.ModuleDict keyed by the global layer "
                        f"index (to keep FQNs), got {type(layers).__name__}")
    has_mtp = shares_embedding(model, part)
    for name, child in list(model.named_children()):
        if name == "layers" or child is None:
            continue
        if name in HEAD_PARTS:
            needed = last
        elif name == EMBED:
            needed = first or (last and has_mtp)
        else:
            needed = first  # other inputs-side parts (e.g. a vision encoder) feed the embedding
        if not needed:
            setattr(model, name, None)
    if any(True for _ in model.named_parameters(recurse=False)):
        raise TypeError("pipeline pruning: parameters directly on the model (not in a submodule) are not supported")
    return model


def build_stage_model(model: nn.Module | Callable[[], nn.Module], part: PipelinePartition, pp_rank: int,
                      seed: int, device: torch.device) -> nn.Module:
    """This rank's pruned model (see module docstring). ``model``: an instance (pruned in place, no re-init) or
    a zero-argument factory (built on meta, pruned, materialised on ``device``, ``init_weights(seed)``)."""
    if isinstance(model, nn.Module):
        return prune_to_stage(model, part, pp_rank)
    with torch.device("meta"):
        m = model()
    prune_to_stage(m, part, pp_rank)
    m.to_empty(device=device)
    m.init_weights(seed)
    return m


def shares_embedding(model: nn.Module, part: PipelinePartition) -> bool:
    """Whether the embedding lives on both the first and the last stage (pp > 1 and the model has an MTP layer).
    Decided from the model's config (``num_nextn_predict_layers``), which pruning does not change."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "num_nextn_predict_layers"):
        return part.pp > 1 and cfg.num_nextn_predict_layers > 0
    return part.pp > 1 and getattr(model, "mtp", None) is not None


def chunk_param_groups(model: nn.Module, part: PipelinePartition, pp_rank: int,
                       separate_embedding: bool) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """Parameters of each local chunk (by FQN) and, separately, the shared embedding (when
    ``separate_embedding``; its gradient is complete only after the cross-stage sum). Every parameter of
    ``model`` appears exactly once."""
    chunk_of_layer = {}
    for c, (s, e) in enumerate(part.local_chunks(pp_rank)):
        for i in range(s, e):
            chunk_of_layer[i] = c
    pl = part.placement
    first_chunk = pl.chunk_of(0) if pp_rank == pl.first_rank else 0
    last_chunk = pl.last_chunk() if pp_rank == pl.last_rank else 0
    groups: list[list[nn.Parameter]] = [[] for _ in range(part.vpp)]
    shared: list[nn.Parameter] = []
    for fqn, p in model.named_parameters():
        head = fqn.split(".", 1)[0]
        if head == "layers":
            groups[chunk_of_layer[int(fqn.split(".")[1])]].append(p)
        elif head == EMBED:
            if separate_embedding:
                shared.append(p)
            else:
                groups[first_chunk if pp_rank == pl.first_rank else last_chunk].append(p)
        elif head in HEAD_PARTS:
            groups[last_chunk].append(p)
        else:
            groups[first_chunk].append(p)
    return groups, shared


def run_maybe_recomputed(fn: Callable[[], Any], recompute: bool) -> Any:
    """``fn()``, under full activation recomputation (non-reentrant checkpoint) when ``recompute``.

    Running statistics updated in the forward (the MoE router's Quantile-Balancing counts) must not count the
    recomputation twice: the router skips its statistics while autograd runs a backward pass (tested in
    tests/parallel/test_pipeline_inprocess.py against a single forward pass)."""
    if not recompute or not torch.is_grad_enabled():
        return fn()

    return checkpoint(fn, use_reentrant=False)


def recompute_unit(cfg: Any, recompute: bool) -> str | None:
    """What the model recomputes itself (``K3Model.set_recompute``): ``"layer"`` / ``"sublayer"`` under
    ``parallel.recompute`` with that ``recompute_granularity``, else None."""
    gran = getattr(cfg.parallel, "recompute_granularity", "chunk")
    return gran if recompute and gran in ("layer", "sublayer") else None


def recompute_chunk(cfg: Any, recompute: bool) -> bool:
    """Whether the runner recomputes each chunk whole (:func:`run_maybe_recomputed`): ``parallel.recompute`` with
    ``recompute_granularity: chunk``."""
    return recompute and recompute_unit(cfg, recompute) is None
