"""Expert-parallel dispatcher with MoonEP redundant experts: the drop-in replacement of ``LocalDispatcher``.

``EPDispatcher(...)(x_latent[N, l], topk_idx[N, k], topk_weight[N, k], experts) -> [N, l]``, where ``experts``
is this rank's shard (``w_gate[n, l, f], w_up[n, l, f], w_down[n, f, l]``, ``n = E / ep``). Communication over
the EP group (``dims.group('ep')``), replica weights over a second group on the same ranks.

Forward of one call (every EP rank runs the same collectives in the same order):

1. ``bincount`` of the routes -> async all-gather of ``[E]`` counts (``R*E`` ints); meanwhile each route's rank
   within its expert is computed locally.
2. Plan (identical on all ranks) and this rank's index layout (:mod:`moonep.fast_layout`: the counts' copy
   to the host is the dispatch's one synchronisation; no ``[R, R, E]`` array, no sort).
3. Latent rows (width ``l``, not ``d``) are gathered into the persistent send buffer in destination order and
   all-to-all'ed (async); the replica weights are prefetched point-to-point at the same time (MoonEP) into a
   bank of the replica pool shared by all MoE layers (:mod:`moonep.replica_pool`).
4. The received rows are permuted into compute order (own experts, then replica slots); own experts are computed
   while the prefetch finishes, then the replicas (two ``grouped_expert_ffn`` calls).
5. Reverse all-to-all of the outputs (combine); the ``k`` outputs per token are mixed with ``topk_weight``
   on the source rank, so the router's gradient stays local.

Backward (one custom autograd Function for steps 1-5, so every rank calls every collective in a fixed order even
when it received no tokens): the replicas are fetched again into a pool bank (unless a bank still holds them, or
the previous layer's backward fetched them ahead), overlapped with the reverse all-to-all of the output grads;
then the replicas of the MoE layer whose backward comes next start travelling into the other bank; replica FFN
backward first, whose weight grads start travelling home (:mod:`moonep.grad_reduce`, in rounds with a bounded
receive buffer) while the own-expert backward runs; the input grads go back by all-to-all, overlapped with the
reduce-back and -- ``split_wgrad`` (``parallel.expert_wgrad_split``, Megatron's delayed wgrad) -- with the own
experts' weight-gradient matmuls, computed after the input gradient has left (:func:`k3train.model.moe.
expert_input_grad`; without it they are computed before); the owner adds the replica grads to its shard grads. Nothing of the replicas is kept from forward to
backward but the replica FFN's activations (graph mode), whose saved weights point into the pool by reference.

Shapes: with MoonEP every rank computes exactly ``N*k`` rows (equal ``N``), whatever the routing; without it the
count varies (up to ``R*N*min(k, n)``). Reference: ``LocalDispatcher`` / ``latent_moe_reference`` of
``k3train.model.moe`` run on the EP group's tokens in one process (tests/moonep/test_ep_moe.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from k3train.model.moe import DownCut, expert_input_grad, grouped_expert_ffn
from moonep.comm import CommBuffers, all_gather_counts, all_to_all_rows, token_buffer_rows, wait_all
from moonep.fast_layout import counts_to_host, fast_rank_layout, plan_with_takes
from moonep.grad_reduce import ReduceBack
from moonep.layout import RankLayout, inverse_permutation, local_route_positions
from moonep.metrics import DispatchRecord, LayerMetrics
from moonep.planner import Plan
from moonep.prefetch import weight_bytes_per_replica
from moonep.replica_pool import BankHolder, ReplicaJob, ReplicaPool, bank_saved_tensor_hooks
from parallel.pairing import current_side

logger = logging.getLogger(__name__)


def _in_backward_pass() -> bool:
    # activation recomputation re-runs the forward inside the autograd engine: record metrics once per forward
    return torch._C._current_graph_task_id() != -1


def _saved_tensor_hooks_active() -> bool:
    # non-reentrant activation checkpointing packs saved tensors through hooks and recomputes them per autograd
    # graph task; a graph built inside forward and differentiated by a nested autograd.grad (a new graph task)
    # would trigger a second, unsynchronised recomputation -- with collectives -- on some ranks only.
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _grouped_ffn() -> Any:
    return grouped_expert_ffn


def _expert_input_grad() -> Any:
    return expert_input_grad


@dataclass
class EPSide:
    """What one side of F/B pairing (:mod:`parallel.pairing`) communicates with: its EP group, its replica-weight
    group (over the same ranks), its token buffers and its replica pool. Side 0 is the dispatcher's own; side 1
    (``parallel.overlap_ep``) has groups and buffers of its own, so a paired forward and backward never share a
    process group, a buffer or a pool bank."""

    ep_group: Any
    weight_group: Any
    buffers: CommBuffers
    pool: ReplicaPool


def _job_on(job: ReplicaJob | None, side: EPSide) -> ReplicaJob | None:
    """``job`` fetching over ``side``'s weight group (a backward may run on another side than its forward); the
    same key, so a bank filled for it is still found."""
    if job is None or job.group is side.weight_group:
        return job
    return dataclasses.replace(job, group=side.weight_group)


class EPDispatcher:
    """Expert-parallel dispatch/combine with optional MoonEP redundancy (module docstring).

    ``num_experts``: global E; ``ep_group`` / ``ep_ranks`` (global ranks in EP order) / ``ep_rank``: this rank's
    EP group; ``weight_group``: process group on the same ranks for the replica weights (defaults to
    ``ep_group``); ``buffers``: persistent token buffers shared by all dispatchers of a model; ``pool``: the
    replica pool shared by them; ``chunk`` / ``order``: the model chunk and the dispatcher's MoE-layer index in
    forward order (a layer prefetches the replicas of ``order - 1`` of its chunk for the backward that follows its
    own); ``name``: the layer's FQN for metrics; ``impl``: ``grouped_expert_ffn``'s implementation;
    ``pair_side``: the resources of side 1 (:class:`EPSide`) for F/B pairing. Each call and each backward uses
    the side of the thread running it (:func:`parallel.pairing.current_side`). ``split_wgrad``: the own experts'
    weight gradients are computed while the input gradients' all-to-all travels (module docstring); the results
    are the same either way.
    """

    def __init__(self, *, num_experts: int, ep_group: Any, ep_ranks: list[int], ep_rank: int, moonep: bool = True,
                 weight_group: Any = None, buffers: CommBuffers | None = None, name: str = "",
                 impl: str = "auto", pool: ReplicaPool | None = None, chunk: int = 0, order: int = 0,
                 pair_side: EPSide | None = None, split_wgrad: bool = True) -> None:
        if num_experts % len(ep_ranks) != 0:
            raise ValueError(f"EPDispatcher: num_experts={num_experts} not divisible by ep={len(ep_ranks)}")
        self.num_experts, self.ep, self.ep_rank = num_experts, len(ep_ranks), ep_rank
        self.experts_per_rank = num_experts // self.ep
        self.ep_group, self.ep_ranks = ep_group, list(ep_ranks)
        self.weight_group = weight_group if weight_group is not None else ep_group
        self.moonep, self.name, self.impl = moonep, name, impl
        self.buffers = buffers if buffers is not None else CommBuffers()
        self.pool = pool if pool is not None else ReplicaPool()
        self.chunk, self.order = chunk, order
        self.split_wgrad = split_wgrad
        self.metrics = LayerMetrics()
        self.last_plan: Plan | None = None
        self.sides = [EPSide(self.ep_group, self.weight_group, self.buffers, self.pool)]
        if pair_side is not None:
            self.sides.append(pair_side)

    def _side(self) -> EPSide:
        k = current_side()
        if k >= len(self.sides):
            raise RuntimeError(f"EPDispatcher {self.name}: called on pairing side {k}, but it has no resources for "
                               f"it (apply_expert_parallel(..., paired=True) builds them)")
        return self.sides[k]

    def __repr__(self) -> str:
        return (f"EPDispatcher(name={self.name!r}, E={self.num_experts}, ep={self.ep}, rank={self.ep_rank}, "
                f"moonep={self.moonep})")

    def __call__(self, x_latent: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 experts: Any) -> torch.Tensor:
        """``x_latent[N, l]``, ``topk_idx[N, k]`` (global ids), ``topk_weight[N, k]`` -> ``[N, l]``
        (``sum_j topk_weight[:, j] * E_{topk_idx[:, j]}(x)``, accumulated in fp32). Collective over the EP group."""
        n = self.experts_per_rank
        if experts.w_gate.shape[0] != n:
            raise ValueError(f"EPDispatcher {self.name}: experts hold {experts.w_gate.shape[0]} experts, expected "
                             f"E/ep = {n} (apply_expert_parallel shards them)")
        if x_latent.dim() != 2 or topk_idx.shape != topk_weight.shape or topk_idx.shape[0] != x_latent.shape[0]:
            raise ValueError(f"EPDispatcher {self.name}: bad shapes x{tuple(x_latent.shape)}, "
                             f"idx{tuple(topk_idx.shape)}, weight{tuple(topk_weight.shape)}")
        n_tok, k = topk_idx.shape
        # the experts' numerics: SiTU betas, QAT (quant), the activation (SiTU-GLU / SwiGLU)
        act = (experts.situ_beta, experts.situ_linear_beta, getattr(experts, "quant", None), experts.act)
        y = _EPExperts.apply(x_latent, experts.w_gate, experts.w_up, experts.w_down, self, topk_idx, act)
        y = y.view(n_tok, k, y.shape[-1])  # explicit width: a rank may route no tokens
        acc = torch.promote_types(y.dtype, torch.float32)
        return (y.to(acc) * topk_weight.to(acc).unsqueeze(-1)).sum(dim=1).to(y.dtype)

    # ------------------------------------------------------------------------------------------------------------
    def _ffn(self, x: torch.Tensor, offsets: torch.Tensor, weights: tuple[torch.Tensor, ...], act: tuple,
             grad: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, Any]:
        """Run the grouped FFN on detached leaves (an inner graph the Function's backward differentiates).

        Returns ``(x_leaf, weight_leaves, y, cut)`` (``cut``: the ``DownCut`` of a split backward, or None);
        empty ``x`` skips the FFN (its backward is zero)."""
        x_leaf = x.detach().requires_grad_(grad)
        w_leaves = [w.detach().requires_grad_(grad) for w in weights]
        if x.shape[0] == 0:
            return x_leaf, w_leaves, x.new_zeros(0, weights[2].shape[-1]), None
        cut = DownCut() if grad and self.split_wgrad else None
        with torch.enable_grad() if grad else contextlib.nullcontext():
            # QAT fake-quant (if any) happens inside, on the own shard and on the replicas alike
            y = _grouped_ffn()(x_leaf, offsets, *w_leaves, act[0], act[1], impl=self.impl, quant=act[2], act=act[3],
                               cut=cut)
        return x_leaf, w_leaves, y, cut

    def _forward(self, ctx: Any, x: torch.Tensor, weights: tuple[torch.Tensor, ...], topk_idx: torch.Tensor,
                 act: tuple) -> torch.Tensor:
        R, n, E, me = self.ep, self.experts_per_rank, self.num_experts, self.ep_rank
        n_tok, k = topk_idx.shape
        width, dev, dt = x.shape[1], x.device, x.dtype
        need_grad = any(ctx.needs_input_grad[:4])
        side = self._side()

        # 1. counts all-gather, overlapped with the local per-expert ranking of the routes
        local = local_route_positions(topk_idx, E)
        gathered, handle = all_gather_counts(local[1], side.ep_group, R)
        send_cap, recv_cap = token_buffer_rows(n_tok, k, R, n, self.moonep)
        side.buffers.reserve("send", send_cap, width, dt, dev)
        side.buffers.reserve("recv", recv_cap, width, dt, dev)
        wait_all([handle])

        # 2. plan + layout: the counts' copy to the host is the one synchronisation
        counts_by_src = counts_to_host(gathered, R)
        plan, takes = plan_with_takes(counts_by_src.sum(0), R, self.moonep)
        lay = fast_rank_layout(plan, takes, counts_by_src, me, local[2])
        self.last_plan = plan

        # 3. token all-to-all (async) + replica prefetch into a pool bank (async, other group)
        send = side.buffers.get("send", n_tok * k, width, dt, dev)
        torch.index_select(x, 0, lay.send_order // k, out=send)
        recv = side.buffers.get("recv", lay.recv_rows, width, dt, dev)
        h_tok = all_to_all_rows(recv, send, lay.recv_splits, lay.send_splits, side.ep_group, async_op=True)
        w_data = tuple(w.detach() for w in weights)
        job = ReplicaJob(lay, w_data, side.weight_group, self.ep_ranks, n, chunk=self.chunk, order=self.order)
        replicas, h_w = side.pool.fill_forward(job) if self.moonep else (None, [])
        wait_all([h_tok])

        # 4. expert compute: own experts while the prefetch finishes, then the replicas. Without saved-tensor
        #    hooks the FFN graphs are kept for backward (the replica graph's saved weights by reference into the
        #    pool); under activation checkpointing the inputs are saved instead (recomputed by the checkpoint) and
        #    the FFNs are re-run in backward.
        graph_mode = need_grad and not _saved_tensor_hooks_active()
        x_sorted = recv.index_select(0, lay.recv_perm)  # the copy out of the comm buffer
        own = self._ffn(x_sorted[:lay.own_rows], lay.own_offsets(dev), w_data, act, graph_mode)
        wait_all(h_w)
        rep, holder = None, None
        if self.moonep:
            holder = BankHolder()
            with bank_saved_tensor_hooks(replicas, holder) if graph_mode else contextlib.nullcontext():
                rep = self._ffn(x_sorted[lay.own_rows:], lay.replica_offsets(dev), replicas, act, graph_mode)
        y_sorted = torch.cat([own[2].detach()] + ([rep[2].detach()] if rep is not None else []))

        # 5. combine: back to source-major order, reverse all-to-all, back to flat route order
        inv_perm = inverse_permutation(lay.recv_perm)
        back = side.buffers.get("recv", lay.recv_rows, width, dt, dev)
        torch.index_select(y_sorted, 0, inv_perm, out=back)
        home = side.buffers.get("send", n_tok * k, width, dt, dev)
        all_to_all_rows(home, back, lay.send_splits, lay.recv_splits, side.ep_group)
        y_routes = x.new_empty(n_tok * k, width).index_copy_(0, lay.send_order, home)

        if need_grad:
            ctx.lay, ctx.inv_perm, ctx.shape, ctx.act = lay, inv_perm, (n_tok, k, width), act
            ctx.graph_mode, ctx.job, ctx.holder = graph_mode, job, holder
            if self.moonep and not _in_backward_pass():
                side.pool.link(job)  # a recomputed forward's job is not the one its backward uses
            if graph_mode:
                ctx.own, ctx.rep = own, rep
            else:
                ctx.save_for_backward(x_sorted, *weights)
        if not _in_backward_pass():
            row_bytes = width * x.element_size()
            self.metrics.add(DispatchRecord.from_plan(plan, None, row_bytes, weight_bytes_per_replica(w_data),
                                                      cross_rows=lay.cross_rows))
        return y_routes

    def _backward(self, ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lay: RankLayout = ctx.lay
        n_tok, k, width = ctx.shape
        dev, dt = grad.device, grad.dtype
        n = self.experts_per_rank
        side = self._side()  # the backward's side, maybe not its forward's
        job: ReplicaJob = _job_on(ctx.job, side)
        if not ctx.graph_mode:  # rebuild the own FFN graph from the saved inputs (activation checkpointing);
            x_sorted, *saved_w = ctx.saved_tensors  # unpacking may recompute the forward: before taking a bank
            ctx.own = self._ffn(x_sorted[:lay.own_rows], lay.own_offsets(dev), tuple(saved_w), ctx.act, True)
        bank, h_w = side.pool.acquire_backward(job) if self.moonep else (None, [])

        # reverse combine: output grads travel to the ranks that computed the routes (replicas meanwhile)
        send = side.buffers.get("send", n_tok * k, width, dt, dev)
        torch.index_select(grad.contiguous(), 0, lay.send_order, out=send)
        recv = side.buffers.get("recv", lay.recv_rows, width, dt, dev)
        all_to_all_rows(recv, send, lay.recv_splits, lay.send_splits, side.ep_group)
        g_sorted = recv.index_select(0, lay.recv_perm)

        # replicas first: their weight grads go home while the own-expert backward runs
        reduce: ReduceBack | None = None
        g_x_rep: list[torch.Tensor] = []
        if self.moonep:
            wait_all(h_w)
            side.pool.prefetch_ahead(_job_on(job.prev, side))  # the next backward's replicas travel during this one
            if ctx.graph_mode:
                ctx.holder.tensors = bank.tensors
            else:
                ctx.rep = self._ffn(x_sorted[lay.own_rows:], lay.replica_offsets(dev), bank.tensors, ctx.act, True)
            g_xr, g_wr = self._ffn_backward(ctx.rep, g_sorted[lay.own_rows:])
            ctx.rep = None
            if ctx.holder is not None:
                ctx.holder.tensors = None
            side.pool.release(bank)
            g_x_rep.append(g_xr)
            reduce = ReduceBack(lay, tuple(g_wr), side.weight_group, self.ep_ranks)
            reduce.start()
        if self.split_wgrad:  # the input gradient first; the weight gradients while it travels
            g_xo, own_wgrad = _expert_input_grad()(*ctx.own, g_sorted[:lay.own_rows])
        else:
            g_xo, g_wo = self._ffn_backward(ctx.own, g_sorted[:lay.own_rows])
        ctx.own = None

        # input grads go back to the source ranks, overlapped with the reduce-back (and the own weight gradients)
        g_x_sorted = torch.cat([g_xo] + g_x_rep)
        back = side.buffers.get("recv", lay.recv_rows, width, dt, dev)
        torch.index_select(g_x_sorted, 0, ctx.inv_perm, out=back)
        home = side.buffers.get("send", n_tok * k, width, dt, dev)
        h_tok = all_to_all_rows(home, back, lay.send_splits, lay.recv_splits, side.ep_group, async_op=True)
        if self.split_wgrad:
            g_wo = own_wgrad()
        if reduce is not None:
            reduce.finish(tuple(g_wo), n)
        wait_all([h_tok])
        g_routes = grad.new_empty(n_tok * k, width).index_copy_(0, lay.send_order, home)
        acc = torch.promote_types(dt, torch.float32)
        g_x = g_routes.view(n_tok, k, width).to(acc).sum(dim=1).to(dt)
        return g_x, list(g_wo)

    @staticmethod
    def _ffn_backward(saved: tuple, grad_y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Input and weight gradients of an ``_ffn`` graph together (the replicas': their weight gradients leave
        first)."""
        g_x, weight_grads = _expert_input_grad()(*saved, grad_y)
        return g_x, weight_grads()


class _EPExperts(torch.autograd.Function):
    """``(x[N, l], w_gate, w_up, w_down) -> y_routes[N*k, l]``: expert ``topk_idx[i, j]`` applied to ``x[i]`` at
    row ``i*k + j``, computed wherever the plan puts it. Forward/backward live on the dispatcher."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                disp: EPDispatcher, topk_idx: torch.Tensor, act: tuple) -> torch.Tensor:
        ctx.disp = disp
        return disp._forward(ctx, x, (w_gate, w_up, w_down), topk_idx, act)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g_x, g_w = ctx.disp._backward(ctx, grad)
        ctx.own = ctx.rep = None  # free the inner graphs
        return (g_x, *g_w, None, None, None)

