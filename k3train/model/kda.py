"""KDA layer (Kimi Delta Attention, K3 variant): projections, ShortConv, decay, chunked delta rule, output gate.

Per token ``x [d]`` and head ``h`` (``H = kda_num_heads``, ``K = V = kda_head_dim``)::

    q = L2Norm(Swish(ShortConv(W_q x)))      k = L2Norm(Swish(ShortConv(W_k x)))      v = Swish(ShortConv(W_v x))
    beta = sigmoid(W_b x)                                    [H]
    z = W_a_up W_a_down x + b_a                              [H, K]  (low rank kda_decay_rank, bias per head+channel)
    g = g_min * sigmoid(exp(A_h) * z)        (K3, "lower_bounded": g in (g_min, 0))
      = -exp(A_h) * softplus(z)              (Kimi Linear, "softplus")
    o = KDA(q, k, v, g, beta)                S_t = (I - b k k^T) Diag(exp(g_t)) S_{t-1} + b k v^T,  o_t = S_t^T q_t * K^-0.5
    y = W_o [sigmoid(W_g x) * RMSNorm_V(o)]  (K3's full-rank output gate; RMSNorm per head over V, shared weight)
      W_g = W_g_up W_g_down                   (Kimi Linear's low-rank gate, ``use_full_rank_gate: false``: rank K)

Parameter names follow HF Kimi Linear (``q_proj``, ``q_conv1d``, ``f_a_proj``/``f_b_proj`` = W_a_down/W_a_up,
``dt_bias`` = b_a, ``A_log`` = A_h, ``b_proj``, ``o_norm``, ``o_proj``); the full-rank gate is ``g_proj`` (K3), the
low-rank one ``g_a_proj`` (d -> K) and ``g_b_proj`` (K -> H*K) as in Kimi Linear.
The core op is :func:`k3train.ops.kda.chunk_kda` on the flattened ``[1, B*T]`` layout with ``seq.cu_seqlens``, so
the state resets at every document and row start. Under KDA context parallelism (``seq.cp``) the conv takes its
left halo from ``seq.cp.conv_halo`` and the core op is ``seq.cp.kda`` (it carries the state across ranks).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3train.model.chunking import chunked_output, head_ranges, linear_fp32_out
from k3train.model.conv import ShortConv, causal_depthwise_conv
from k3train.model.norm import RMSNorm
from k3train.model.seq import SeqInfo
from k3train.ops.kda import layer_kda_op
from k3train.optim.param_groups import mark_per_head


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (float64 stays float64, so reference tests can run the whole layer in double)."""
    return x if x.dtype == torch.float64 else x.float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, computed in fp32 (the flash-linear-attention convention)."""
    xf = _acc(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_decay(z: torch.Tensor, A_log: torch.Tensor, form: str, lower_bound: float) -> torch.Tensor:
    """Log decay ``g [..., H, K]`` from the logit ``z [..., H, K]`` and per-head log scale ``A_log [H]`` (>= fp32).

    ``lower_bounded`` (K3): ``g = lower_bound * sigmoid(exp(A) z)`` in (lower_bound, 0), so a 16-token sub-tile's
    cumulative log decay stays above 16 * lower_bound = -80 (its inverse fits bf16). ``softplus`` (Kimi Linear):
    ``g = -exp(A) softplus(z)``, unbounded below.
    """
    scale = _acc(A_log).exp()[:, None]  # [H, 1]
    zf = _acc(z)
    if form == "lower_bounded":
        return lower_bound * torch.sigmoid(scale * zf)
    if form == "softplus":
        return -scale * F.softplus(zf)
    raise ValueError(f"model.kda_decay_form must be 'lower_bounded' or 'softplus', got {form!r}")


class KDALayer(nn.Module):
    """The KDA token mixer of one K3 layer: ``x [B, T, d] -> y [B, T, d]`` given ``seq: SeqInfo``.

    Communication: none by itself; under CP it calls ``seq.cp.conv_halo`` / ``seq.cp.kda`` (the CP group lives in
    that object). ``kda_op`` (default :func:`chunk_kda`) is an attribute so tests and inference can swap in the
    token-loop reference.
    """

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        if H <= 0 or K <= 0:
            raise ValueError(f"model.kda_num_heads ({H}) and model.kda_head_dim ({K}) must be > 0")
        if cfg.kda_decay_rank <= 0:
            raise ValueError(f"model.kda_decay_rank must be > 0, got {cfg.kda_decay_rank}")
        self.hidden_size, self.num_heads, self.head_dim = d, H, K
        self.decay_form, self.gate_lower_bound = cfg.kda_decay_form, float(cfg.gate_lower_bound)
        kda_decay(torch.zeros(1, 1), torch.zeros(1), self.decay_form, self.gate_lower_bound)  # validate the form
        hk = H * K
        self.q_proj = nn.Linear(d, hk, bias=False)
        self.k_proj = nn.Linear(d, hk, bias=False)
        self.v_proj = nn.Linear(d, hk, bias=False)
        self.q_conv1d = ShortConv(hk, cfg.short_conv_kernel_size)
        self.k_conv1d = ShortConv(hk, cfg.short_conv_kernel_size)
        self.v_conv1d = ShortConv(hk, cfg.short_conv_kernel_size)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.f_a_proj = nn.Linear(d, cfg.kda_decay_rank, bias=False)  # W_a_down
        self.f_b_proj = nn.Linear(cfg.kda_decay_rank, hk, bias=False)  # W_a_up
        self.dt_bias = nn.Parameter(torch.zeros(hk))  # b_a, per head and key channel
        self.A_log = nn.Parameter(torch.zeros(H))  # A_h, per head, init 0
        self.full_rank_gate = bool(cfg.use_full_rank_gate)
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, hk, bias=False)  # full-rank output gate W_g (K3)
        else:  # Kimi Linear's low-rank output gate, rank K (the published g_a_proj / g_b_proj shapes)
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, hk, bias=False)
        self.o_norm = RMSNorm(K, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(hk, d, bias=False)
        self.mark_param_attrs()
        # (q, k, v, g, beta, *, scale, cu_seqlens) -> (o, final_state); the token-loop reference fits too.
        self.kda_op: Callable[..., Any] = layer_kda_op(cfg)  # chunk_kda with the config's chunking and gate bound
        # heads per chunk (model.mixer_head_chunk; 0: all at once) and whether each chunk is recomputed on its own
        # in the backward (set from outside: parallel.recompute_granularity = sublayer; k3train/model/chunking.py)
        self.head_chunk = int(getattr(cfg, "mixer_head_chunk", 0))
        self.checkpoint_chunks = False

    def mark_param_attrs(self) -> None:
        """Per-head Muon orthogonalises each head's rows of W_q, W_k, W_v separately (rows are head-major).
        Re-run by ``init_weights``: ``to_empty`` from the meta device replaces the Parameter objects."""
        for w in (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight):
            mark_per_head(w, self.num_heads)

    def forward(self, x: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        H, K = self.num_heads, self.head_dim
        ranges = head_ranges(H, self.head_chunk)
        if len(ranges) == 1:
            return self.o_proj(self._heads(x, seq, 0, H))
        # head chunks (k3train/model/chunking.py): each chunk's share of the output projection, summed in fp32;
        # recomputed one chunk at a time in the backward when checkpoint_chunks is set (sublayer recompute)
        w_o = self.o_proj.weight

        def part(h0: int, h1: int) -> torch.Tensor:
            return linear_fp32_out(self._heads(x, seq, h0, h1), w_o[:, h0 * K:h1 * K])

        return chunked_output(part, ranges, self.checkpoint_chunks, x.dtype)

    def _heads(self, x: torch.Tensor, seq: SeqInfo, h0: int, h1: int) -> torch.Tensor:
        """Heads ``h0..h1-1`` up to the output projection: ``x [B, T, d] -> [B, T, (h1-h0)*K]`` (gated,
        normalised; ``x``'s dtype). Every weight is read through its rows of these heads."""
        B, T, _ = x.shape
        H, K = h1 - h0, self.head_dim
        whole = (h0, h1) == (0, self.num_heads)
        rows = slice(h0 * K, h1 * K)

        def lin(mod: nn.Linear, r: slice, inp: torch.Tensor = x) -> torch.Tensor:
            return mod(inp) if whole else F.linear(inp, mod.weight[r])

        cp = seq.cp
        q, k, v = self._short_convs(x, seq, [lin(p, rows) for p in (self.q_proj, self.k_proj, self.v_proj)], rows)
        q = l2norm(F.silu(q).view(B, T, H, K))
        k = l2norm(F.silu(k).view(B, T, H, K))
        v = F.silu(v).view(B, T, H, K)
        beta = torch.sigmoid(_acc(lin(self.b_proj, slice(h0, h1))))  # [B, T, H]
        z = lin(self.f_b_proj, rows, self.f_a_proj(x)).view(B, T, H, K) + self.dt_bias[rows].view(H, K)
        g = kda_decay(z, self.A_log[h0:h1], self.decay_form, self.gate_lower_bound)  # fp32 (fp64) [B, T, H, K]
        scale = K ** -0.5
        if cp is not None:
            o = cp.kda(q, k, v, g, beta, scale, seq)
        else:
            # Flattened varlen layout: one "batch" of B*T tokens, documents (and rows) delimited by cu_seqlens.
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
            o, _ = self.kda_op(*flat, scale=scale, cu_seqlens=seq.cu_seqlens)
            o = o.view(B, T, H, K)
        gate = torch.sigmoid(self.output_gate_logits(x, None if whole else rows)).view(B, T, H, K)
        o = self.o_norm(o.to(x.dtype)) * gate
        return o.reshape(B, T, H * K)

    def output_gate_logits(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """``W_g x`` ``[..., H*K]``: the full-rank gate, or the low-rank ``W_g_up W_g_down x``; with ``rows`` only
        those output channels (a head chunk's)."""
        if self.full_rank_gate:
            return self.g_proj(x) if rows is None else F.linear(x, self.g_proj.weight[rows])
        down = self.g_a_proj(x)
        return self.g_b_proj(down) if rows is None else F.linear(down, self.g_b_proj.weight[rows])

    def _short_convs(self, x: torch.Tensor, seq: SeqInfo, projs: list[torch.Tensor],
                     rows: slice) -> list[torch.Tensor]:
        """ShortConv of the q, k, v projections ``[B, T, C]`` each (before Swish; C the chunk's channels
        ``rows``)."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        n = self.q_conv1d.kernel_size - 1
        whole = rows == slice(0, self.num_heads * self.head_dim)
        ws = [c.weight if whole else c.weight[rows] for c in convs]
        if seq.cp is None or n == 0:
            return [causal_depthwise_conv(p, w, seq.doc_ids) for w, p in zip(ws, projs)]
        # Under CP: the previous rank's last K-1 tokens of this row (doc -1 where there is none), fetched ONCE for
        # q, k and v together.
        prev, prev_doc = seq.cp.conv_halo(torch.cat(projs, dim=-1), n)
        prevs = prev.split([p.shape[-1] for p in projs], dim=-1)
        return [causal_depthwise_conv(p, w, seq.doc_ids, pv, prev_doc) for w, p, pv in zip(ws, projs, prevs)]

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, decay={self.decay_form}"
                f"(lower_bound={self.gate_lower_bound}), gate={'full' if self.full_rank_gate else 'low'}-rank")
