"""ZeRO-1 / Pipeline ZeRO-2 around the Muon + AdamW update rules.

Ownership. Muon's Newton-Schulz needs a WHOLE matrix (a head block, an expert), so optimizer state is not cut
into equal flat slices as in classic ZeRO: each rank of a parameter's reduction group OWNS whole parameters.
Owners are chosen by a greedy longest-processing-time assignment that balances the sum of two normalised costs,
optimizer-state bytes and Newton-Schulz FLOPs (:func:`assign_owners`): parameters sorted by cost (ties by
FQN order), each given to the currently least-loaded rank. It depends only on shapes and the group layout, so
every rank computes the same table with no communication. Groups are assigned largest first (dense ``dp_cp``
before routed-expert ``edp``) so the dense table never depends on the expert shards of other EP ranks.
Imbalance is bounded by the largest single parameter (the embedding / LM head at full K3 scale) -- accepted for
one code path and a checkpoint keyed by FQN that re-shards freely.

Per step (``zero`` = ``parallel.zero``):
    0: gradients SUM-all-reduced over the group; every rank updates every parameter (replicated state).
    1: gradients SUM-all-reduced; only the owner updates (state only on owners); then each owner broadcasts
       its new parameters to the group, bucketed per owner (one broadcast per owner and bucket -- an all-gather
       would need equal-size shards, which whole-parameter ownership does not give).
    2: as 1, but gradients are ``dist.reduce``-d (bucketed, async) to the owner and dropped (``.grad = None``)
       on every other rank as soon as they are packed: :meth:`reduce_chunk_grads` is called by the pipeline
       runner when a virtual chunk has finished the backward of its last micro-batch, so a rank holds full
       gradients only for chunks still in flight plus 1/DP of the rest. Anything not reduced by :meth:`step` is
       reduced there (zero=2 also works without a pipeline).
A parameter whose ``.grad`` is None on a rank contributes zeros (every rank must join the same collectives), and
it is still stepped (momentum / weight decay), unlike ``torch.optim`` which skips grad-less parameters.
Gradients are SUMMED across ranks by default (``grad_reduce='sum'``): the trainer divides every micro-batch loss
by the GLOBAL token count, so each rank's gradient is already its share of the global mean. ``'mean'`` divides by
the group size for callers that normalise per rank.

Groups: ``group_fn(fqn, param) -> name`` (a ``ParallelDims`` group name; default ``'dp_cp'`` -- CP ranks hold
partial gradients of the same parameters, so they reduce with DP). Routed experts under EP return ``'edp'``.
Global grad norm: owners' squared norms summed over ``norm_groups`` (default ``[dp_cp, pp]``), see ``clip.py``.
QK-Clip: ``qk_max`` MAX-all-reduced over ``qk_clip_group`` (default ``dp_cp``); owners scale their (master)
weights before the broadcast.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .clip import clip_coefficient, global_norm, local_sq_norm, scale_grads_
from .muon import HParams, adamw_step_, muon_step_
from .newton_schulz import ns_flops
from .param_groups import ParamInfo, build_param_infos, describe_params
from .qk_clip import all_reduce_qk_max, clip_factors, find_qk_clip_modules, qk_clip_targets, scale_target_

log = logging.getLogger(__name__)

GROUP_NAMES = ("pp", "dp", "cp", "dp_cp", "ep", "edp")


def assign_owners(infos: Sequence[ParamInfo], ns_steps: int) -> dict[int, float]:
    """Set ``info.owner`` for every parameter (greedy, deterministic); returns the cost load per global rank.

    Cost of a parameter = its share of the group's optimizer-state bytes + its share of the group's
    Newton-Schulz FLOPs. Needs ``info.group_ranks`` filled in.
    """
    load: dict[int, float] = defaultdict(float)
    names = sorted({i.group for i in infos}, key=lambda n: (-len(next(i for i in infos if i.group == n)
                                                                  .group_ranks), n))
    for name in names:
        items = [i for i in infos if i.group == name]
        byts = {i.index: i.state_numel() * 4 for i in items}
        flops = {i.index: sum(ns_flops(s, ns_steps) for s in i.ns_shapes()) for i in items}
        tb, tf = max(1, sum(byts.values())), max(1, sum(flops.values()))
        cost = {i.index: byts[i.index] / tb + flops[i.index] / tf for i in items}
        for inf in sorted(items, key=lambda i: (-cost[i.index], i.index)):
            r = min(inf.group_ranks, key=lambda rk: (load[rk], rk))
            inf.owner = r
            load[r] += cost[inf.index]
    return dict(load)


class _Pending:
    """One in-flight bucket collective. ``keep``: this rank keeps the result (the parameters' ``.grad`` are
    already views into ``flat``); otherwise ``flat`` is only held until the collective completes."""

    def __init__(self, work: Any, flat: torch.Tensor, keep: bool, divisor: int):
        self.work, self.flat, self.keep, self.divisor = work, flat, keep, divisor

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.keep and self.divisor != 1:
            self.flat.div_(self.divisor)


class DistributedOptimizer:
    """Muon + AdamW with ZeRO-0/1/2 over ``ParallelDims`` groups. Build it with ``k3train.optim.build_optimizer``.

    Public API: :meth:`step`, :meth:`zero_grad`, :meth:`reduce_chunk_grads`, :meth:`clip_grad_norm_`,
    :meth:`state_dict`, :meth:`load_state_dict`, :meth:`state_bytes`, :meth:`grad_bytes`, :meth:`describe`.
    """

    def __init__(self, modules: Sequence[nn.Module], ocfg: Any, dims: Any, *, zero: int = 1,
                 grad_clip: float = 0.0, group_fn: Callable[[str, nn.Parameter], str] | None = None,
                 grad_reduce: str = "sum", norm_groups: Sequence[Any] | None = None,
                 qk_clip_group: str = "dp_cp", bucket_bytes: int = 64 * 2**20, log_table: bool = True,
                 norm_exclude: Iterable[torch.Tensor] = ()):
        if zero not in (0, 1, 2):
            raise ValueError(f"parallel.zero must be 0, 1 or 2, got {zero}")
        if grad_reduce not in ("sum", "mean"):
            raise ValueError(f"grad_reduce must be 'sum' or 'mean', got {grad_reduce!r}")
        self.ocfg, self.dims, self.zero = ocfg, dims, zero
        self.grad_clip, self.grad_reduce, self.bucket_bytes = float(grad_clip), grad_reduce, bucket_bytes
        self.rank = dims.rank
        self.norm_groups = list(norm_groups) if norm_groups is not None else [dims.group("dp_cp"), dims.group("pp")]
        self.infos = build_param_infos(modules, ocfg, group_fn)
        for inf in self.infos:
            if inf.group not in GROUP_NAMES:
                raise ValueError(f"{inf.fqn}: group_fn returned unknown group {inf.group!r} (one of {GROUP_NAMES})")
            inf.group_ranks = list(dims.ranks(inf.group))
        assign_owners(self.infos, ocfg.ns_steps)
        self._by_id = {id(i.param): i for i in self.infos}
        self.state: dict[int, dict[str, torch.Tensor]] = {i.index: self._init_state(i)
                                                         for i in self.infos if self._updates_here(i)}
        # QK-Clip: modules with qk_max + qk_clip_params; targets whose param this optimizer does not hold are
        # an error (a frozen q/k weight cannot be clipped consistently with its master copy).
        self.qk_tau = float(ocfg.qk_clip_threshold)
        self.qk_group = dims.group(qk_clip_group)
        # (a wholly frozen attention -- an EAGLE-3 draft run's target -- has nothing to clip and is left out)
        self.qk_modules = [(n, m) for n, m in find_qk_clip_modules(modules)
                           if any(t.param.requires_grad for t in qk_clip_targets(m))] if self.qk_tau > 0 else []
        self.qk_targets = []
        for name, mod in self.qk_modules:
            tl = qk_clip_targets(mod)
            for t in tl:
                if id(t.param) not in self._by_id:
                    raise ValueError(f"QK-Clip target of {name} ({t.kind}) is not a trainable optimised parameter")
            self.qk_targets.append(tl)
        self._norm_exclude: set[int] = set()
        self.exclude_from_norm(norm_exclude)
        self._pending: list[_Pending] = []
        self._reduced: set[int] = set()
        self._norm: float | None = None
        self.steps = 0
        if log_table and self.rank == 0:
            log.info("optimizer (%s, zero=%d, grad_reduce=%s) on rank 0:\n%s", ocfg.name, zero, grad_reduce,
                     self.describe())

    # ------------------------------------------------------------------------------------------------------
    # ownership and state
    def _updates_here(self, inf: ParamInfo) -> bool:
        return self.zero == 0 or inf.owner == self.rank

    def _init_state(self, inf: ParamInfo) -> dict[str, torch.Tensor]:
        p = inf.param
        st: dict[str, torch.Tensor] = {}
        if inf.kind == "muon":
            st["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        else:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["step"] = torch.zeros((), dtype=torch.float32)  # CPU: read every step without a device sync
        if p.dtype != torch.float32:
            st["master"] = p.detach().float().clone()
        return st

    def owned(self) -> list[ParamInfo]:
        """Parameters whose state lives on this rank (all of them for zero=0)."""
        return [i for i in self.infos if i.index in self.state]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank, measured from the tensors (incl. fp32 master copies)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())

    def grad_bytes(self) -> int:
        """Bytes of gradient memory held on this rank: the storages behind every ``.grad`` plus the buffers of
        reductions still in flight, each storage counted once (measured, not computed from shapes)."""
        storages: dict[int, int] = {}
        tensors = [i.param.grad for i in self.infos if i.param.grad is not None]
        tensors += [pend.flat for pend in self._pending]
        for t in tensors:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def describe(self, detail: bool = False) -> str:
        """Table of parameter counts per optimizer group and what this rank owns."""
        sb = {idx: sum(t.numel() * t.element_size() for t in st.values()) for idx, st in self.state.items()}
        return describe_params(self.infos, self.rank, sb, detail)

    # ------------------------------------------------------------------------------------------------------
    # gradient reduction
    def _buckets(self, infos: list[ParamInfo], by_owner: bool) -> list[list[ParamInfo]]:
        keyed: dict[tuple, list[ParamInfo]] = defaultdict(list)
        for inf in sorted(infos, key=lambda i: i.index):
            p = inf.param
            keyed[(inf.group, p.dtype, p.device, inf.owner if by_owner else -1)].append(inf)
        out = []
        for key in sorted(keyed, key=lambda k: (k[0], str(k[1]), str(k[2]), k[3])):
            cur, cur_bytes = [], 0
            for inf in keyed[key]:
                nb = inf.numel * inf.param.element_size()
                if cur and cur_bytes + nb > self.bucket_bytes:
                    out.append(cur)
                    cur, cur_bytes = [], 0
                cur.append(inf)
                cur_bytes += nb
            if cur:
                out.append(cur)
        return out

    def _launch(self, infos: list[ParamInfo]) -> None:
        """Start the (async) reduction of these parameters' gradients; see the module docstring.

        Memory: a bucket is packed into one flat buffer and the parameters' ``.grad`` become views of it at once
        (owners / all-reduce) or are dropped (ZeRO-2 non-owners), so the original gradients are freed now. The
        previous call's collectives are waited for first, so at most one chunk's buffers are in flight (they
        overlap with the backward of the next chunk)."""
        self._finish()
        infos = [i for i in infos if i.index not in self._reduced]
        self._reduced.update(i.index for i in infos)
        to_owner = self.zero == 2
        for bucket in self._buckets(infos, by_owner=to_owner):
            inf0 = bucket[0]
            pg = self.dims.group(inf0.group)
            if pg is None:  # size-1 group: nothing to reduce (grads stay as they are)
                continue
            keep = not to_owner or inf0.owner == self.rank
            p0 = inf0.param
            if len(bucket) == 1 and p0.grad is not None and p0.grad.is_contiguous():
                flat = p0.grad.view(-1)  # reduce in place: no copy of a large single parameter
            else:
                flat = torch.cat([(i.param.grad if i.param.grad is not None else torch.zeros_like(i.param))
                                  .reshape(-1) for i in bucket])
                if keep:
                    off = 0
                    for i in bucket:
                        i.param.grad = flat[off:off + i.numel].view_as(i.param)
                        off += i.numel
            if to_owner:
                work = dist.reduce(flat, dst=inf0.owner, op=dist.ReduceOp.SUM, group=pg, async_op=True)
                if not keep:
                    for i in bucket:
                        i.param.grad = None
            else:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg, async_op=True)
            divisor = len(inf0.group_ranks) if self.grad_reduce == "mean" else 1
            self._pending.append(_Pending(work, flat, keep, divisor))

    def _finish(self) -> None:
        for pend in self._pending:
            pend.finish()
        self._pending.clear()

    def reduce_chunk_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Start reducing the gradients of ``params`` (a virtual chunk whose backward is complete for every
        micro-batch of this step). zero=2: ``dist.reduce`` to the owner over the parameter's group and
        ``.grad = None`` on non-owners; zero=0/1: async all-reduce. Collective over each parameter's group:
        every rank of the group must call it with the same chunk. Parameters the optimizer does not hold
        (frozen) are ignored."""
        infos = [self._by_id[id(p)] for p in params if id(p) in self._by_id]
        self._launch(infos)

    # ------------------------------------------------------------------------------------------------------
    # norm, clipping, step
    def exclude_from_norm(self, params: Iterable[torch.Tensor]) -> None:
        """Leave ``params`` out of the global grad norm: replicas of a parameter another pipeline stage also
        holds and updates identically (the last stage's copy of the MTP-shared embedding), counted there."""
        self._norm_exclude.update(id(p) for p in params)

    def clip_grad_norm_(self, max_norm: float | None = None) -> float:
        """Reduce any outstanding gradients, compute the GLOBAL grad norm (owners' squared norms SUM-reduced
        over ``norm_groups``) and scale the gradients this rank updates so it is <= ``max_norm``
        (default ``train.grad_clip``; 0 = no clipping). Returns the pre-clip norm. Collective."""
        self._launch(self.infos)
        self._finish()
        device = self.infos[0].param.device if self.infos else None
        sq = local_sq_norm((i.param.grad for i in self.infos
                            if i.owner == self.rank and id(i.param) not in self._norm_exclude), device)
        norm = global_norm(sq, self.norm_groups)
        coef = clip_coefficient(norm, self.grad_clip if max_norm is None else max_norm)
        scale_grads_((i.param.grad for i in self.infos if self._updates_here(i)), coef)
        self._norm = norm
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> dict[str, float]:
        """One optimizer step at learning rate ``lr`` (Muon and AdamW share it). Collective over the reduction
        groups, ``norm_groups`` and ``qk_clip_group``. Returns ``grad_norm`` (pre-clip, global), ``skipped``
        (1.0 when the norm is not finite -- no parameter changes), ``qk_clipped_heads``, ``qk_max``."""
        norm = self._norm if self._norm is not None else self.clip_grad_norm_()
        out = {"grad_norm": norm, "skipped": 0.0, "qk_clipped_heads": 0.0, "qk_max": 0.0}
        gammas = self._qk_gammas(out)
        if not math.isfinite(norm):
            log.warning("non-finite grad norm %s at optimizer step %d: update skipped", norm, self.steps)
            out["skipped"] = 1.0
            self._reset_qk_max()
            self.steps += 1
            return out
        hp = HParams.from_config(self.ocfg, lr)
        clip_rows = defaultdict(list)  # param id -> [(target, gamma)]
        for tl, gamma in zip(self.qk_targets, gammas):
            if bool((gamma < 1).any()):
                for t in tl:
                    clip_rows[id(t.param)].append((t, gamma))
        for inf in self.infos:
            if not self._updates_here(inf):
                continue
            st, p = self.state[inf.index], inf.param
            w = st["master"] if "master" in st else p.data
            g = p.grad.float() if p.grad is not None else torch.zeros_like(w)
            if inf.kind == "muon":
                muon_step_(w, g, st["momentum_buffer"], hp, inf)
            else:
                adamw_step_(w, g, st["exp_avg"], st["exp_avg_sq"], st["step"], hp, inf.decay)
            for t, gamma in clip_rows.get(id(p), ()):
                scale_target_(w, t, gamma)
            if "master" in st:
                p.data.copy_(w)
        if self.zero >= 1:
            self._broadcast_params()
        self._reset_qk_max()
        self._norm = None
        self.steps += 1
        return out

    def skip_step(self) -> dict[str, float]:
        """Skip this step's update (the trainer found a non-finite loss or gradient): no parameter, moment,
        momentum or step counter changes; this step's QK-Clip maxima are dropped. Local (no communication):
        every rank of the run must skip the same step. Returns :meth:`step`'s keys with ``skipped`` 1.0."""
        out = {"grad_norm": self._norm if self._norm is not None else float("nan"), "skipped": 1.0,
               "qk_clipped_heads": 0.0, "qk_max": 0.0}
        self._reset_qk_max()
        self._norm = None
        return out

    def _qk_gammas(self, out: dict[str, float]) -> list[torch.Tensor]:
        if not self.qk_modules:
            return []
        maxes = all_reduce_qk_max([m.qk_max for _, m in self.qk_modules], self.qk_group)
        gammas = [clip_factors(m, self.qk_tau) for m in maxes]
        out["qk_clipped_heads"] = float(sum(int((g < 1).sum()) for g in gammas))
        out["qk_max"] = float(max(float(m.max()) for m in maxes))
        return gammas

    def _reset_qk_max(self) -> None:
        for _, m in self.qk_modules:
            m.qk_max.zero_()

    def _broadcast_params(self) -> None:
        """Each owner sends its updated parameters to the rest of the group: per group, per owner (in group
        rank order), bucketed by dtype/device. Same order on every rank of the group."""
        for bucket in self._buckets(self.infos, by_owner=True):
            inf0 = bucket[0]
            pg = self.dims.group(inf0.group)
            if pg is None:
                continue
            mine = inf0.owner == self.rank
            if len(bucket) == 1:
                dist.broadcast(inf0.param.data, src=inf0.owner, group=pg)
                continue
            if mine:
                flat = torch.cat([i.param.data.reshape(-1) for i in bucket])
            else:
                flat = torch.empty(sum(i.numel for i in bucket), dtype=inf0.param.dtype, device=inf0.param.device)
            dist.broadcast(flat, src=inf0.owner, group=pg)
            if not mine:
                off = 0
                for i in bucket:
                    i.param.data.copy_(flat[off:off + i.numel].view_as(i.param))
                    off += i.numel

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (always to None: ZeRO-2 relies on absent grads) and reset per-step bookkeeping."""
        if self._pending:
            self._finish()
        for inf in self.infos:
            inf.param.grad = None
        self._reduced.clear()
        self._norm = None

    # ------------------------------------------------------------------------------------------------------
    # checkpointing
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat ``{f"{fqn}.{state_name}": tensor}`` of the state on THIS rank only (owned parameters; all for
        zero=0). State names: ``momentum_buffer`` (Muon), ``exp_avg``, ``exp_avg_sq``, ``step`` (AdamW),
        ``master`` (fp32 copy of a non-fp32 parameter). Tensors are the live state (no copies)."""
        out = {}
        for inf in self.infos:
            for k, t in self.state.get(inf.index, {}).items():
                out[f"{inf.fqn}.{k}"] = t
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy the entries this rank needs from ``sd`` (which may hold more, e.g. a full unsharded dict, so a
        checkpoint from another DP size loads). ``strict``: every needed key must be present."""
        missing = []
        for inf in self.infos:
            for k, t in self.state.get(inf.index, {}).items():
                key = f"{inf.fqn}.{k}"
                if key not in sd:
                    missing.append(key)
                    continue
                src = sd[key]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"optimizer state {key}: shape {tuple(src.shape)} != {tuple(t.shape)}")
                t.copy_(src.to(dtype=t.dtype, device=t.device))
        if strict and missing:
            raise KeyError(f"optimizer state missing {len(missing)} entries, e.g. {missing[:3]}")
