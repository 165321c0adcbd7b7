"""Stable LatentMoE (spec "Stable LatentMoE", "Router and Quantile Balancing"; seed 001 chapter 5).

    u = sum_{j in TopK} p_j E_j(W_down x)          routed experts work in the latent width l
    y = sum_s Shared_s(x) + W_up RMSNorm(u)         shared experts see the full width d

Without a latent projection (``routed_expert_hidden_size: null``, Kimi Linear's MoE) ``W_down``, ``W_up`` and the
norm are absent: ``u = sum_j p_j E_j(x)`` in the width d and ``y = sum_s Shared_s(x) + u``.

Pieces, each usable on its own:
- :class:`Router`: sigmoid scores in fp32, top-k of ``scores + bias`` (bias = persistent buffer set by Quantile
  Balancing, never gradient-trained; HF ``e_score_correction_bias``), optionally within the token's best expert
  groups (grouped top-k), mixing weights from the unbiased scores (renormalised over the k routes and scaled by
  ``routed_scaling_factor``); accumulates balancing statistics.
- :func:`permute_tokens` / :func:`unpermute_combine`: sort the N*k routes by expert and back (public so the
  expert-parallel dispatcher reuses them).
- :func:`grouped_expert_ffn`: gated FFN (SiTU-GLU or SwiGLU) of every local expert over its contiguous slice of the
  sorted rows,
  via ``torch._grouped_mm`` (padded ``bmm`` where that kernel does not apply); readable references beside it.
  The one place an expert matmul consumes weights, so MXFP4 QAT (:mod:`k3train.quant.qat`) applies there.
- :class:`LocalDispatcher`: the single-device dispatcher; ``LatentMoE.dispatcher`` is replaced from outside by
  expert parallelism with an object of the same call signature.

No torch.distributed here: the balancing statistics are exposed by ``Router.balance_stats()`` and summed by the
caller across every rank that routes tokens for the layer.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3train.model.chunking import in_backward_pass as _in_backward_pass
from k3train.model.chunking import maybe_checkpoint, token_ranges
from k3train.model.ffn import DenseFFN, glu
from k3train.model.norm import RMSNorm
from k3train.quant.qat import NO_QUANT, ExpertQuant
from k3train.ops.quantile_balancing import (
    ema_update,
    max_violation,
    qb_exact_update,
    qb_histogram_counts,
    qb_histogram_range,
    qb_histogram_update,
    route_topk_plus_one,
    sign_update,
    target_count,
)


# --------------------------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------------------------
class Router(nn.Module):
    """Sigmoid router with a balancing bias.

    ``weight[E, d]`` (Parameter), ``bias[E]`` (persistent fp32 buffer; selection only). Statistics (training
    mode, outside backward recomputation): ``expert_loads[E]`` int32 and, for QB with the histogram estimator,
    ``qb_hist[E, qb_bins]`` int32 -- non-persistent buffers, reset by :meth:`balance_step`.

    balance: ``'qb'`` (Quantile Balancing), ``'sign'`` (``b += rate * sign(mean - load)``), ``'none'``.
    ``num_groups`` / ``topk_group`` (grouped top-k, :func:`group_choice_mask`): the experts form ``num_groups``
    equal groups and a token's routes come from its ``topk_group`` best groups (1 group: plain top-k).
    estimator (QB): ``'histogram'`` (distributed path) or ``'exact'`` (keeps this rank's scores of the step in
    memory; exact only when one process routes the whole batch -- with several ranks it uses local scores).
    """

    def __init__(self, d: int, num_experts: int, k: int, *, renormalize: bool = True, scaling_factor: float = 1.0,
                 balance: str = "qb", estimator: str = "histogram", bins: int = 1000, ema: float = 0.0,
                 sign_rate: float = 1e-3, num_groups: int = 1, topk_group: int = 1) -> None:
        super().__init__()
        if not 1 <= k < num_experts:
            raise ValueError(f"Router: need 1 <= num_experts_per_token < num_experts (QB routes top-(k+1)), "
                             f"got k={k}, num_experts={num_experts}")
        if num_groups < 1 or num_experts % num_groups or not 1 <= topk_group <= num_groups \
                or (num_groups > 1 and num_experts // num_groups < 2) \
                or topk_group * (num_experts // num_groups) <= k:
            raise ValueError(f"Router: bad grouped top-k: num_expert_group={num_groups}, topk_group={topk_group} "
                             f"for {num_experts} experts and k={k}")
        if balance not in ("qb", "sign", "none"):
            raise ValueError(f"Router: router_balance must be 'qb', 'sign' or 'none', got {balance!r}")
        if estimator not in ("histogram", "exact"):
            raise ValueError(f"Router: qb_estimator must be 'histogram' or 'exact', got {estimator!r}")
        if bins < 1:
            raise ValueError(f"Router: qb_bins must be >= 1, got {bins}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"Router: qb_ema must be in [0, 1), got {ema}")
        self.d, self.num_experts, self.k = d, num_experts, k
        self.renormalize, self.scaling_factor = renormalize, float(scaling_factor)
        self.balance, self.estimator, self.bins = balance, estimator, bins
        self.ema, self.sign_rate = float(ema), float(sign_rate)
        self.num_groups, self.topk_group = int(num_groups), int(topk_group)
        self.collect_stats = True  # callers may switch statistics off (e.g. evaluation in train mode)
        self.weight = nn.Parameter(torch.empty(num_experts, d))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("expert_loads", torch.zeros(num_experts, dtype=torch.int32), persistent=False)
        use_hist = balance == "qb" and estimator == "histogram"
        self.register_buffer("qb_hist", torch.zeros(num_experts, bins if use_hist else 0, dtype=torch.int32),
                             persistent=False)
        self._exact_scores: list[torch.Tensor] = []
        self.reset_parameters()

    @classmethod
    def from_config(cls, cfg: Any) -> "Router":
        return cls(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token,
                   renormalize=cfg.moe_renormalize, scaling_factor=cfg.routed_scaling_factor,
                   balance=cfg.router_balance, estimator=cfg.qb_estimator, bins=cfg.qb_bins, ema=cfg.qb_ema,
                   sign_rate=cfg.sign_update_rate, num_groups=cfg.num_expert_group, topk_group=cfg.topk_group)

    def reset_parameters(self) -> None:
        """nn.Linear's default init for ``weight``; zero bias and statistics."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Zero ``bias`` and the statistics (needed after ``to_empty`` on a meta-built model)."""
        with torch.no_grad():
            self.bias.zero_()
        self.reset_balance_state()

    def reset_balance_state(self) -> None:
        with torch.no_grad():
            self.expert_loads.zero_()
            self.qb_hist.zero_()
        self._exact_scores = []

    # ---- routing ---------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pure routing (no statistics). ``x[N, d]`` -> ``topk_idx[N, k]`` long, ``topk_weight[N, k]`` fp32,
        ``scores[N, E]`` fp32 (float64 for a float64 input), ``alpha[N]`` (the (k+1)-th biased score)."""
        if x.dim() != 2 or x.shape[1] != self.d:
            raise ValueError(f"Router: expected x of shape [N, {self.d}], got {tuple(x.shape)}")
        # fp32 at least (float64 stays float64 for reference tests): scores decide discrete choices
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = torch.sigmoid(F.linear(x.to(dtype), self.weight.to(dtype)))
        allowed = None
        if self.num_groups > 1:
            allowed = group_choice_mask(scores.detach() + self.bias.to(dtype), self.num_groups, self.topk_group)
        topk_idx, alpha = route_topk_plus_one(scores, self.bias, self.k, allowed)
        # mixing weights use the unbiased scores: the bias only decides who is selected
        topk_weight = scores.gather(1, topk_idx)
        if self.renormalize:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        topk_weight = topk_weight * self.scaling_factor
        return topk_idx, topk_weight, scores, alpha

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[N, d]`` -> ``(topk_idx[N, k], topk_weight[N, k], scores[N, E])``; accumulates statistics in
        training mode (once per token even under activation recomputation). No communication."""
        topk_idx, topk_weight, scores, alpha = self.route(x)
        if self.training and self.collect_stats and not _in_backward_pass():
            self._accumulate(scores.detach(), topk_idx, alpha)
        return topk_idx, topk_weight, scores

    @torch.no_grad()
    def _accumulate(self, scores: torch.Tensor, topk_idx: torch.Tensor, alpha: torch.Tensor) -> None:
        self.expert_loads += torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
        if self.balance != "qb":
            return
        if self.estimator == "histogram":
            lo, hi = qb_histogram_range(self.bias)
            self.qb_hist += qb_histogram_counts(scores, alpha, lo, hi, self.bins)
        else:
            self._exact_scores.append(scores)

    # ---- balancing -------------------------------------------------------------------------------------------
    def balance_stats(self) -> list[torch.Tensor]:
        """The live statistic buffers (int32) to SUM-all-reduce in place across every rank that routes tokens
        for this layer (the dp x cp ranks of its pipeline stage), before :meth:`balance_step`.
        ``[expert_loads[E]]`` plus ``qb_hist[E, bins]`` for QB with the histogram estimator."""
        stats = [self.expert_loads]
        if self.balance == "qb" and self.estimator == "histogram":
            stats.append(self.qb_hist)
        return stats

    @torch.no_grad()
    def balance_step(self) -> dict[str, Any]:
        """Once per optimizer step, after the all-reduce of :meth:`balance_stats`: compute the new bias from this
        step's statistics, apply it for the NEXT step, reset the statistics.

        Returns ``maxvio`` (max load / mean load of the step just finished), ``loads`` (cpu int64 [E]),
        ``tokens`` (tokens routed), ``bias_absmax`` (after the update).
        """
        loads = self.expert_loads.to(torch.int64)
        assignments = loads.sum()
        maxvio = max_violation(loads)
        new_bias = self.bias
        if self.balance == "qb":
            if self.estimator == "histogram":
                # same bias that binned this step's forwards -> same edges
                lo, hi = qb_histogram_range(self.bias)
                q = target_count(assignments, self.num_experts)
                new_bias = qb_histogram_update(self.qb_hist, lo, hi, q, bias=self.bias)
            elif self._exact_scores:
                new_bias = qb_exact_update(torch.cat(self._exact_scores), self.bias, self.k)
            new_bias = ema_update(self.bias, new_bias, self.ema)
        elif self.balance == "sign":
            new_bias = sign_update(self.bias, loads, self.sign_rate)
        self.bias.copy_(new_bias)
        metrics = {
            "maxvio": float(maxvio),
            "loads": loads.cpu(),
            "tokens": int(assignments) // self.k,
            "bias_absmax": float(self.bias.abs().max()),
        }
        self.reset_balance_state()
        return metrics

    def extra_repr(self) -> str:
        groups = f", groups={self.topk_group}/{self.num_groups}" if self.num_groups > 1 else ""
        return (f"d={self.d}, num_experts={self.num_experts}, k={self.k}, balance={self.balance}, "
                f"estimator={self.estimator}, bins={self.bins}{groups}")


def group_choice_mask(biased: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """Grouped top-k (DeepSeek-V3's ``noaux_tc``, Kimi Linear): ``biased[N, E]`` (scores + balancing bias) ->
    bool ``[N, E]``, True for the experts of each token's ``topk_group`` best groups, a group scored by the sum of
    its two largest biased scores (groups are ``num_groups`` consecutive runs of ``E / num_groups`` experts)."""
    n, e = biased.shape
    group_scores = biased.view(n, num_groups, e // num_groups).topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(topk_group, dim=-1).indices  # [N, topk_group]
    chosen = torch.zeros(n, num_groups, dtype=torch.bool, device=biased.device).scatter_(1, best, True)
    return chosen.repeat_interleave(e // num_groups, dim=1)


# --------------------------------------------------------------------------------------------------------------
# Permutation helpers (shared with the expert-parallel dispatcher)
# --------------------------------------------------------------------------------------------------------------
def permute_tokens(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``N * k`` routes of ``topk_idx[N, k]`` by expert (stable: token order kept within an expert).

    Returns ``order[N*k]`` (long; flat route index ``token * k + slot`` of each sorted row; the token is
    ``order // k``), ``counts[E]`` (long, routes per expert) and ``offsets[E]`` (int32 cumulative ends, the
    ``offs`` convention of ``torch._grouped_mm``).
    """
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"permute_tokens: expert index out of range for num_experts={num_experts}")
    offsets = counts.cumsum(0).to(torch.int32)
    return order, counts, offsets


def unpermute_combine(y_sorted: torch.Tensor, order: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_tokens` plus the weighted sum over the k routes.

    ``y_sorted[N*k, l]`` (rows in ``order``), ``topk_weight[N, k]`` -> ``[N, l]`` in ``y_sorted.dtype``; the
    sum is accumulated in at least fp32. Deterministic (a gather by the inverse permutation, no atomics).
    """
    n_tok, k = topk_weight.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = y_sorted.index_select(0, inverse).view(n_tok, k, y_sorted.shape[-1])
    acc = torch.promote_types(y_sorted.dtype, torch.float32)
    return (y.to(acc) * topk_weight.to(acc).unsqueeze(-1)).sum(dim=1).to(y_sorted.dtype)


# --------------------------------------------------------------------------------------------------------------
# Grouped expert FFN
# --------------------------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: ``_grouped_mm``'s backward rejects expanded
    (stride-0) gradients such as the one of ``y.sum()``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    # torch._grouped_mm: CPU takes fp32/bf16/fp16, CUDA bf16 only; every row stride must be a multiple of 16 B.
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        # the CUDA kernel is bf16-only and built for sm90+ (H100/H200); unverified on GPU in this repo's tests
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        return False
    if not ok_dtype or any(w.dtype != x.dtype for w in weights):
        return False
    es = x.element_size()
    dims = [x.shape[-1]] + [w.shape[-1] for w in weights] + [w.shape[-2] for w in weights]
    return all((dim * es) % 16 == 0 for dim in dims) and all(w.is_contiguous() for w in weights)


def _gmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offsets))


def _padded_bmm_ffn(x: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, beta: float, linear_beta: float,
                    quant: ExpertQuant = NO_QUANT, act: str = "situ", cut: DownCut | None = None) -> torch.Tensor:
    # Fallback: scatter the rows into [E, capacity, l] with capacity = the largest group, three bmm's, gather back.
    n_rows, num_experts = x.shape[0], offsets.numel()
    offs = offsets.to(torch.long)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    capacity = int(counts.max()) if num_experts > 0 and n_rows > 0 else 0  # host sync; fallback path only
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts,
                                            output_size=n_rows)
    slot = torch.arange(n_rows, device=x.device) - (offs - counts)[expert_of_row]
    xp = x.new_zeros(num_experts, capacity, x.shape[1]).index_put((expert_of_row, slot), x)
    h = quant.input(glu(torch.bmm(xp, w_gate), torch.bmm(xp, w_up), act, beta, linear_beta))
    # per-row blocks: padding rows stay apart
    return torch.bmm(cut(h) if cut is not None else h, w_down)[expert_of_row, slot]


class DownCut:
    """Where the down projection's input leaves the autograd graph, so that a backward can compute the experts'
    input gradient before their weight gradients (:func:`expert_input_grad`; the EP dispatcher sends the input
    gradient home and computes the weight gradients while it travels, Megatron's delayed wgrad).

    ``grouped_expert_ffn(..., cut=c)`` calls ``c(h)`` on the down projection's input ``h`` (after QAT's input
    quantization): ``c.h`` keeps ``h`` (in the graph of ``x`` and ``w_gate`` / ``w_up``) and the down projection
    consumes ``c.leaf``, ``h`` detached. The per-expert ``'loop'`` reference and empty inputs leave ``c.h`` None."""

    def __init__(self) -> None:
        self.h: torch.Tensor | None = None
        self.leaf: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.h = h
        self.leaf = h.detach().requires_grad_(h.requires_grad)
        return self.leaf


def expert_input_grad(x: torch.Tensor, weights: list[torch.Tensor], y: torch.Tensor, cut: DownCut | None,
                      grad_y: torch.Tensor) -> tuple[torch.Tensor, Callable[[], list[torch.Tensor]]]:
    """``(dL/dx, weight_grads)`` of ``y = grouped_expert_ffn(x, ..., *weights, cut=cut)`` for ``grad_y``:
    the input gradient now (the down projection's input gradient, then the gated projections' back to ``x``: no
    weight gradient is computed), and ``weight_grads()`` -> ``[dL/dw_gate, dL/dw_up, dL/dw_down]`` later (three
    more matmuls; the graph is freed then). The same matmuls as one ``torch.autograd.grad`` over ``[x, *weights]``
    (the reference, used where ``cut`` did not apply), plus the gating's elementwise backward a second time.
    ``x`` and ``weights`` are the leaves the FFN ran on (they require grad); ``x`` may be empty."""
    grad_y = grad_y.contiguous()
    if cut is None or cut.h is None or x.shape[0] == 0:  # the reference order: everything in one pass
        if x.shape[0] == 0:
            return x.new_zeros(x.shape), lambda: [torch.zeros_like(w) for w in weights]
        g = torch.autograd.grad(y, [x] + list(weights), grad_y)
        return g[0], lambda: list(g[1:])
    (g_h,) = torch.autograd.grad(y, [cut.leaf], grad_y, retain_graph=True)
    (g_x,) = torch.autograd.grad(cut.h, [x], g_h, retain_graph=True)

    def weight_grads() -> list[torch.Tensor]:
        (g_down,) = torch.autograd.grad(y, [weights[2]], grad_y)
        g_gate, g_up = torch.autograd.grad(cut.h, [weights[0], weights[1]], g_h)
        return [g_gate, g_up, g_down]
    return g_x, weight_grads


def grouped_expert_ffn(x_sorted: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                       impl: str = "auto", quant: ExpertQuant | None = None, act: str = "situ",
                       cut: DownCut | None = None) -> torch.Tensor:
    """Gated FFN (``act``: ``"situ"`` SiTU-GLU with the betas, or ``"silu"`` SwiGLU; :func:`k3train.model.ffn.glu`)
    of expert e on rows ``offsets[e-1]:offsets[e]`` of ``x_sorted`` (``offsets[-1] == N``).

    ``x_sorted[N, l]``, ``offsets[E]`` int32 cumulative ends, ``w_gate[E, l, f]``, ``w_up[E, l, f]``,
    ``w_down[E, f, l]`` -> ``[N, l]`` in ``x_sorted.dtype`` (weights are cast to it). Empty experts are fine. ``impl``: ``'grouped_mm'``
    (``torch._grouped_mm``), ``'padded_bmm'`` (capacity = max group size), ``'loop'`` (the per-expert reference)
    or ``'auto'`` (grouped_mm where its dtype/alignment rules hold, else padded_bmm). No communication.

    ``quant`` (QAT, :class:`k3train.quant.qat.ExpertQuant`): every weight is fake-quantized (MXFP4, blocks of 32
    along its reduction dim ``l`` resp. ``f``) before the cast to the activation dtype, and -- with MXFP8 inputs --
    the activation operand of each of the three matmuls (``x`` and ``h``, blocks along their last dim); the
    gradients pass straight through. ``cut`` (:class:`DownCut`): the down projection's input leaves the graph there
    (``'grouped_mm'`` and ``'padded_bmm'``), for :func:`expert_input_grad`.
    """
    if x_sorted.dim() != 2 or w_gate.dim() != 3 or w_gate.shape != w_up.shape:
        raise ValueError(f"grouped_expert_ffn: expected x[N, l], w_gate/w_up[E, l, f], got {tuple(x_sorted.shape)},"
                         f" {tuple(w_gate.shape)}, {tuple(w_up.shape)}")
    num_experts, l_dim, f_dim = w_gate.shape
    if w_down.shape != (num_experts, f_dim, l_dim) or x_sorted.shape[1] != l_dim or offsets.shape != (num_experts,):
        raise ValueError(f"grouped_expert_ffn: inconsistent shapes x{tuple(x_sorted.shape)}, w_gate"
                         f"{tuple(w_gate.shape)}, w_down{tuple(w_down.shape)}, offsets{tuple(offsets.shape)}")
    quant = quant if quant is not None else NO_QUANT
    if quant.active:
        # QAT: the master weight is quantized (not its bf16 cast: the export quantizes the same tensor)
        w_gate, w_up, w_down = (quant.weight(w) for w in (w_gate, w_up, w_down))
        x_sorted = quant.input(x_sorted)
    if w_gate.dtype != x_sorted.dtype:
        # low-precision activations with fp32 master weights: compute in the activation dtype (differentiable cast)
        w_gate, w_up, w_down = (w.to(x_sorted.dtype) for w in (w_gate, w_up, w_down))
    if x_sorted.shape[0] == 0:
        # nothing routed here (a rank or micro-batch with zero tokens): torch._grouped_mm's backward rejects empty
        # inputs, and there is nothing to compute; the weights get a zero gradient contribution
        return x_sorted.new_zeros((0, l_dim)) + 0.0 * (w_gate.sum() + w_up.sum() + w_down.sum())
    if impl == "auto":
        impl = "grouped_mm" if _grouped_mm_applies(x_sorted, w_gate, w_up, w_down) else "padded_bmm"
    if impl == "grouped_mm":
        offs = offsets.to(torch.int32)
        h = quant.input(glu(_gmm(x_sorted, w_gate, offs), _gmm(x_sorted, w_up, offs), act, situ_beta,
                            situ_linear_beta))
        return _gmm(cut(h) if cut is not None else h, w_down, offs)
    if impl == "padded_bmm":
        return _padded_bmm_ffn(x_sorted, offsets, w_gate, w_up, w_down, situ_beta, situ_linear_beta, quant, act,
                               cut)
    if impl == "loop":
        return reference_grouped_expert_ffn(x_sorted, offsets, w_gate, w_up, w_down, situ_beta, situ_linear_beta,
                                            quant.input, act)
    raise ValueError(f"grouped_expert_ffn: impl must be 'auto', 'grouped_mm', 'padded_bmm' or 'loop', got {impl!r}")


def reference_grouped_expert_ffn(x_sorted: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor,
                                 w_up: torch.Tensor, w_down: torch.Tensor, situ_beta: float = 4.0,
                                 situ_linear_beta: float = 25.0,
                                 input_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                 act: str = "situ") -> torch.Tensor:
    """Readable per-expert reference of :func:`grouped_expert_ffn` (a Python loop over experts).
    ``input_quant``: applied to the hidden activation ``h`` before the down projection (QAT with MXFP8 inputs)."""
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        xe = x_sorted[start:end]
        h = glu(xe @ w_gate[e], xe @ w_up[e], act, situ_beta, situ_linear_beta)
        outs.append((input_quant(h) if input_quant is not None else h) @ w_down[e])
        start = end
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, w_down.shape[-1])


def reference_expert_ffn_loop(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                              w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                              situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                              act: str = "situ") -> torch.Tensor:
    """Readable per-token reference of the whole routed branch: ``out_i = sum_s w_is E_{idx_is}(x_i)``.

    ``x[N, l]``, ``topk_idx[N, k]``, ``topk_weight[N, k]`` -> ``[N, l]`` (slow; tests only)."""
    rows = []
    for i in range(x.shape[0]):
        acc = x.new_zeros(w_down.shape[-1])
        for s in range(topk_idx.shape[1]):
            e = int(topk_idx[i, s])
            h = glu(x[i] @ w_gate[e], x[i] @ w_up[e], act, situ_beta, situ_linear_beta)
            acc = acc + topk_weight[i, s].to(x.dtype) * (h @ w_down[e])
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, w_down.shape[-1])


class GroupedExperts(nn.Module):
    """``E`` gated experts (``act``) of width ``f`` in width ``l`` (latent, or d) as stacked parameters:
    ``w_gate[E, l, f]``, ``w_up[E, l, f]``, ``w_down[E, f, l]`` (3 * l * f per expert).

    ``forward(x_sorted[N, l], offsets[E] int32) -> [N, l]`` = :func:`grouped_expert_ffn`. Under expert
    parallelism this module holds only the rank's local experts. ``quant`` (plain attribute, set by
    :func:`k3train.quant.qat.apply_qat`): the QAT numerics every dispatcher runs these experts with.
    """

    def __init__(self, num_experts: int, dim: int, inter: int, situ_beta: float = 4.0,
                 situ_linear_beta: float = 25.0, act: str = "situ") -> None:
        super().__init__()
        if num_experts < 0 or dim <= 0 or inter <= 0:
            raise ValueError(f"GroupedExperts: bad sizes num_experts={num_experts}, l={dim}, f={inter}")
        self.num_experts, self.dim, self.inter = num_experts, dim, inter
        self.situ_beta, self.situ_linear_beta = float(situ_beta), float(situ_linear_beta)
        self.act = act
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, inter))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, inter))
        self.w_down = nn.Parameter(torch.empty(num_experts, inter, dim))
        self.quant: ExpertQuant = NO_QUANT
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) like nn.Linear; the model's name-seeded init_weights overwrites it."""
        with torch.no_grad():
            for w, fan_in in ((self.w_gate, self.dim), (self.w_up, self.dim), (self.w_down, self.inter)):
                w.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        return grouped_expert_ffn(x_sorted, offsets, self.w_gate, self.w_up, self.w_down,
                                  self.situ_beta, self.situ_linear_beta, impl=impl, quant=self.quant, act=self.act)

    def extra_repr(self) -> str:
        qat = f", qat={self.quant.weights}/{self.quant.inputs}" if self.quant.active else ""
        act = f", act={self.act}" if self.act != "situ" else ""
        return f"num_experts={self.num_experts}, l={self.dim}, f={self.inter}{act}{qat}"


# --------------------------------------------------------------------------------------------------------------
# Dispatcher and the layer
# --------------------------------------------------------------------------------------------------------------
class LocalDispatcher:
    """Single-device dispatch: permute routes by expert, run the grouped FFN, un-permute and combine.

    ``__call__(x_latent[N, l], topk_idx[N, k], topk_weight[N, k], experts) -> [N, l]`` (the weighted sum over
    the k routes). Expert parallelism replaces ``LatentMoE.dispatcher`` with an object of this signature.
    """

    def __init__(self, impl: str = "auto") -> None:
        self.impl = impl

    def __call__(self, x_latent: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        order, _, offsets = permute_tokens(topk_idx, experts.num_experts)
        x_sorted = x_latent.index_select(0, order // topk_idx.shape[1])
        y_sorted = experts(x_sorted, offsets, impl=self.impl)
        return unpermute_combine(y_sorted, order, topk_weight)


class LatentMoE(nn.Module):
    """Stable LatentMoE layer. ``forward(x[..., d]) -> [..., d]``.

    Submodules (FQNs): ``router`` (:class:`Router`), ``latent_down`` (d -> l), ``experts``
    (:class:`GroupedExperts`, E experts of width ``moe_intermediate_size``), ``latent_norm`` (RMSNorm(l), only if
    ``latent_moe_use_norm``), ``latent_up`` (l -> d), ``shared_experts.{s}`` (``num_shared_experts`` separate
    DenseFFN(d, ``shared_expert_intermediate_size``)). ``dispatcher``: plain attribute (not a submodule).
    Without a latent projection (``routed_expert_hidden_size`` null) ``latent_down`` / ``latent_up`` /
    ``latent_norm`` are None and the experts work in width d.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d = cfg.hidden_size
        latent = cfg.routed_expert_hidden_size is not None
        l_dim = cfg.routed_expert_hidden_size if latent else d
        beta, lin_beta, act = cfg.activation_situ_beta, cfg.activation_situ_linear_beta, cfg.hidden_act
        if not latent and cfg.latent_moe_use_norm:
            raise ValueError("LatentMoE: latent_moe_use_norm needs a latent projection (routed_expert_hidden_size)")
        self.d, self.latent_dim = d, l_dim
        self.router = Router.from_config(cfg)
        self.latent_down = nn.Linear(d, l_dim, bias=False) if latent else None
        self.experts = GroupedExperts(cfg.num_experts, l_dim, cfg.moe_intermediate_size, beta, lin_beta, act)
        self.latent_norm = RMSNorm(l_dim, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
        self.latent_up = nn.Linear(l_dim, d, bias=False) if latent else None
        self.shared_experts = nn.ModuleList(DenseFFN(d, cfg.shared_expert_intermediate_size, beta, lin_beta, act)
                                            for _ in range(cfg.num_shared_experts))
        self.dispatcher: Callable[..., torch.Tensor] = LocalDispatcher()
        # tokens per chunk (model.moe_token_chunk) and whether each chunk is recomputed on its own in the backward
        # (set from outside: parallel.recompute_granularity = sublayer; k3train/model/chunking.py)
        self.token_chunk = int(getattr(cfg, "moe_token_chunk", 0))
        self.checkpoint_chunks = False

    def routed_latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[N, d]`` -> ``(z[N, l], topk_idx, topk_weight)``: the latent tokens to dispatch and their routes."""
        topk_idx, topk_weight, _ = self.router(x)
        return self.to_latent(x), topk_idx, topk_weight

    def to_latent(self, x: torch.Tensor) -> torch.Tensor:
        """``W_down x`` (``x`` itself without a latent projection)."""
        return self.latent_down(x) if self.latent_down is not None else x

    def combine(self, x: torch.Tensor, u: torch.Tensor, shared: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``y = sum_s Shared_s(x) + W_up RMSNorm(u)`` for ``x[N, d]``, ``u[N, l]``; ``shared``: the shared experts'
        outputs when already computed (the same sum, in the same order)."""
        if self.latent_norm is not None:
            u = self.latent_norm(u)
        y = self.latent_up(u) if self.latent_up is not None else u
        for out in shared if shared is not None else (s(x) for s in self.shared_experts):
            y = y + out
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., d] -> [..., d]``, ``token_chunk`` tokens at a time (every chunk one dispatch: under expert
        parallelism every EP rank runs the same number of them, its tokens per micro-batch being the same)."""
        if x.shape[-1] != self.d:
            raise ValueError(f"LatentMoE: expected last dimension {self.d}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, self.d)
        ranges = token_ranges(flat.shape[0], self.token_chunk)
        if len(ranges) == 1:
            return self._forward_flat(flat).view(x.shape)
        outs = [maybe_checkpoint(self._forward_flat, flat[s:e], enabled=self.checkpoint_chunks) for s, e in ranges]
        return torch.cat(outs).view(x.shape)

    def _forward_flat(self, flat: torch.Tensor) -> torch.Tensor:
        z, topk_idx, topk_weight = self.routed_latent(flat)
        # the shared experts first: on an accelerator their kernels are queued before the dispatcher's one host
        # synchronisation (the count copy) and run while the host plans the dispatch
        shared = [s(flat) for s in self.shared_experts]
        u = self.dispatcher(z, topk_idx, topk_weight, self.experts)
        return self.combine(flat, u, shared)


def latent_moe_reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Readable reference of ``moe(x)``: routing without statistics, per-token expert loop. ``x[..., d]``."""
    flat = x.reshape(-1, moe.d)
    topk_idx, topk_weight, _, _ = moe.router.route(flat)
    ex = moe.experts
    u = reference_expert_ffn_loop(moe.to_latent(flat), topk_idx, topk_weight, ex.w_gate, ex.w_up, ex.w_down,
                                  ex.situ_beta, ex.situ_linear_beta, ex.act)
    return moe.combine(flat, u).view(x.shape)
