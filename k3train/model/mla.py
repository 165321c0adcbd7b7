"""Gated MLA: DeepSeek-style multi-head latent attention, NoPE, with a full-rank sigmoid output gate.

Per token ``x [d]``, ``H`` heads, ``Dn = qk_nope_head_dim``, ``Dr = qk_rope_head_dim``, ``Dv = v_head_dim``::

    q      = W_uq RMSNorm(W_dq x)                     [H, Dn + Dr]      (q_lora_rank 0 / null: q = W_q x)
    latent = W_dkv x = [c_kv (kv_lora_rank) ; k_pe (Dr)]                 <- the only per-token KV cache (576 in K3)
    [k_nope ; v] = W_ukv RMSNorm(c_kv)                [H, Dn + Dv]
    k      = [k_nope ; k_pe broadcast over heads]     [H, Dn + Dr]
    o      = softmax(q k^T * (Dn + Dr)^-0.5 + mask) v      mask: key_pos <= query_pos and key_doc == query_doc
    y      = W_o [sigmoid(W_g x) * o]                 (mla_use_output_gate false: y = W_o o, as Kimi Linear)

NoPE (``mla_use_nope``): no rotary embedding is applied; the "rope" slot keeps its dimensions (it is part of the
cached latent and of the q.k product) so checkpoints keep the published shapes. The attention is computed in
fp32 (K3 keeps attention outputs in FP32 in training). By default it runs blockwise
(:func:`k3train.ops.mla_blockwise.blockwise_mla_attention`, ``model.mla_block_size``): flash-attention structure,
keys and values expanded from the latent one key block at a time, blocks the mask empties skipped, the QK-Clip max
from the same pass -- nothing of size ``[Tq, Tk]`` and no all-keys K/V, so 1M-token contexts fit. The readable
dense reference is :func:`attention_core` (+ :func:`masked_logit_max`) on the fully expanded K/V; setting
``MLA.attention_op`` to it (or to any op of its signature, e.g. a GPU flash kernel: k3train/model/kernels.py)
switches a layer to that path. Parameter names follow HF DeepSeek-V3 (``q_a_proj`` = W_dq, ``q_b_proj`` = W_uq,
``kv_a_proj_with_mqa`` = W_dkv, ``kv_b_proj`` = W_ukv); the gate is ``g_proj``.

QK-Clip: ``qk_max [H]`` (non-persistent buffer) holds the running max of pre-softmax logits per head since the
optimizer last reset it, updated under ``no_grad`` in training when ``track_qk_max`` is set.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3train.model.chunking import chunked_output, head_ranges, in_backward_pass, linear_fp32_out
from k3train.model.norm import RMSNorm
from k3train.model.seq import SeqInfo
from k3train.ops.mla_blockwise import blockwise_mla_attention
from k3train.ops.mla_dense import MaskInfo, masked_logit_max
from k3train.optim.param_groups import mark_per_head


class MLA(nn.Module):
    """Gated MLA token mixer: ``x [B, T, d] -> y [B, T, d]`` given ``seq: SeqInfo``.

    Communication: none by itself; under CP it calls ``seq.cp.gather_latent(latent)`` (autograd-aware all-gather of
    the ``[B, T, kv_lora_rank + qk_rope_head_dim]`` latent over the CP group held by that object), then
    ``seq.cp.mla_queries(x)`` for the queries this rank computes and ``seq.cp.mla_outputs(y)`` to hand their
    outputs back (the CP causal balance, kcp/mla_cp.py; identities without it).

    ``attention_op``: None (the blockwise path, ``model.mla_block_size``), or an op with :func:`attention_core`'s
    signature on the expanded K/V -- :func:`attention_core` itself (the dense reference) or a flash kernel that
    k3train/model/kernels.py sets per layer.
    """

    attention_op: Callable[..., torch.Tensor] | None = None

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if not cfg.mla_use_nope:
            raise ValueError("model.mla_use_nope=false (rotary MLA) is not implemented; K3 uses NoPE")
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = H, cfg.q_lora_rank or 0, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        if H <= 0 or self.qk_dim <= 0 or self.v_dim <= 0:
            raise ValueError(f"model.num_attention_heads ({H}), qk head dim ({self.qk_dim}) and v_head_dim "
                             f"({self.v_dim}) must be > 0")
        self.scale = self.qk_dim ** -0.5
        if self.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.use_output_gate = bool(cfg.mla_use_output_gate)
        if self.use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.mark_param_attrs()
        self.register_buffer("qk_max", torch.zeros(H), persistent=False)
        self.track_qk_max = True
        self.block_size = int(cfg.mla_block_size)
        # heads per chunk (model.mixer_head_chunk; 0: all at once) and whether each chunk is recomputed on its own
        # in the backward (set from outside: parallel.recompute_granularity = sublayer; k3train/model/chunking.py)
        self.head_chunk = int(getattr(cfg, "mixer_head_chunk", 0))
        self.checkpoint_chunks = False

    def mark_param_attrs(self) -> None:
        """Per-head Muon: rows of W_uq are [head][nope+rope]; rows of W_ukv are [head][k_nope ; v], and the k_nope
        and v rows of a head are different projections, so they are orthogonalised as separate segments.
        Re-run by ``init_weights``: ``to_empty`` from the meta device replaces the Parameter objects."""
        wq = self.q_b_proj.weight if self.q_lora_rank > 0 else self.q_proj.weight
        mark_per_head(wq, self.num_heads)
        mark_per_head(self.kv_b_proj.weight, self.num_heads,
                      segments=(self.nope_dim, self.v_dim) if self.nope_dim > 0 else None)

    def reset_buffers(self) -> None:
        """Zero ``qk_max`` (after ``to_empty`` on a meta-built model; the optimizer resets it after each step)."""
        with torch.no_grad():
            self.qk_max.zero_()

    def qk_clip_params(self) -> list[tuple[torch.Tensor, int, int, int, int, str]]:
        """QK-Clip targets (protocol of :mod:`k3train.optim.qk_clip`): per head, the q_nope rows and the k_nope rows
        of W_ukv scale by sqrt(gamma), the q rope-slot rows by gamma (the shared k_pe in W_dkv is left alone)."""
        H, dn, dr, dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        wq = self.q_b_proj.weight if self.q_lora_rank > 0 else self.q_proj.weight
        out = [(wq, H, dn + dr, 0, dn, "q")] if dn > 0 else []
        if dr > 0:
            out.append((wq, H, dn + dr, dn, dr, "q_rope"))
        if dn > 0:
            out.append((self.kv_b_proj.weight, H, dn + dv, 0, dn, "k"))
        return out

    # ---------------------------------------------------------------------------------------------------------
    def project_q(self, x: torch.Tensor, heads: tuple[int, int] | None = None) -> torch.Tensor:
        """``x [B, T, d] -> q [B, T, H, Dn + Dr]`` (of heads ``h0..h1-1`` when ``heads`` is given)."""
        B, T, _ = x.shape
        h0, h1 = heads if heads is not None else (0, self.num_heads)
        whole = (h0, h1) == (0, self.num_heads)
        proj = self.q_b_proj if self.q_lora_rank > 0 else self.q_proj
        inp = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora_rank > 0 else x
        q = proj(inp) if whole else F.linear(inp, proj.weight[h0 * self.qk_dim:h1 * self.qk_dim])
        return q.view(B, T, h1 - h0, self.qk_dim)

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent ``[B, Tk, kv_lora_rank + Dr]`` -> keys ``[B, Tk, H, Dn + Dr]``, values ``[B, Tk, H, Dv]``."""
        return self._expand(latent, self.kv_b_proj.weight)

    def expand_weights(self) -> tuple[torch.Tensor, ...]:
        """The parameters :meth:`expand_latent` reads (the blockwise op returns their gradients)."""
        return (self.kv_a_layernorm.weight, self.kv_b_proj.weight)

    def _expand(self, latent: torch.Tensor, w_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`expand_latent` with ``w_kv`` the rows of W_ukv of some heads (all: the parameter itself)."""
        B, Tk, _ = latent.shape
        H = w_kv.shape[0] // (self.nope_dim + self.v_dim)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = F.linear(self.kv_a_layernorm(c_kv), w_kv).view(B, Tk, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, Tk, H, self.rope_dim)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, seq: SeqInfo,
                attend: Callable[[MLA, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``attend(self, x)`` (optional) computes the layer's output instead of the causal attention over ``seq``:
        the EAGLE-3 draft's training-time test (k3train/model/eagle3.py), run through this module's call so module
        hooks see it."""
        if attend is not None:
            return attend(self, x)
        latent = self.kv_a_proj_with_mqa(x)
        q_doc, q_pos = seq.doc_ids, seq.positions
        if seq.cp is not None:
            latent, key_doc, key_pos = seq.cp.gather_latent(latent)
            # the queries this rank computes: under the CP causal balance half of them are a partner's
            # (kcp/mla_cp.py); their output goes back by seq.cp.mla_outputs below
            x, q_doc, q_pos = seq.cp.mla_queries(x)
        else:
            key_doc, key_pos = seq.doc_ids, seq.positions
        mask = MaskInfo(q_doc=q_doc, q_pos=q_pos, k_doc=key_doc, k_pos=key_pos)
        ranges = head_ranges(self.num_heads, self.head_chunk)
        if len(ranges) == 1:
            y = self.o_proj(self._heads(x, latent, mask, 0, self.num_heads))
        else:
            # head chunks (k3train/model/chunking.py): the latent is gathered once, each chunk expands its own
            # heads' keys and values from it; the chunks' shares of the output projection are summed in fp32
            w_o, dv = self.o_proj.weight, self.v_dim

            def part(h0: int, h1: int) -> torch.Tensor:
                return linear_fp32_out(self._heads(x, latent, mask, h0, h1), w_o[:, h0 * dv:h1 * dv])

            y = chunked_output(part, ranges, self.checkpoint_chunks, x.dtype)
        return seq.cp.mla_outputs(y) if seq.cp is not None else y

    def _heads(self, x: torch.Tensor, latent: torch.Tensor, mask: MaskInfo, h0: int, h1: int) -> torch.Tensor:
        """Heads ``h0..h1-1`` up to the output projection: ``-> [B, T, (h1-h0)*Dv]`` (gated, ``x``'s dtype);
        updates their QK-Clip maxima."""
        whole = (h0, h1) == (0, self.num_heads)
        wkv = self.kv_b_proj.weight
        w_kv = wkv if whole else wkv[h0 * (self.nope_dim + self.v_dim):h1 * (self.nope_dim + self.v_dim)]
        qh = self.project_q(x, (h0, h1)).transpose(1, 2)  # [B, H, T, Dqk]
        # not in a recomputation (the same maximum again): under F/B pairing another thread's forward updates it now
        track = self.training and self.track_qk_max and not in_backward_pass()
        if self.attention_op is None:
            def expand(lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self._expand(lat, w_kv)

            o, max_logit = blockwise_mla_attention(qh, latent, mask, self.scale, self.block_size, expand,
                                                   (self.kv_a_layernorm.weight, w_kv))
        else:
            k, v = self._expand(latent, w_kv)
            kh, vh = k.transpose(1, 2), v.transpose(1, 2)
            max_logit = masked_logit_max(qh, kh, mask, self.scale) if track else None
            o = self.attention_op(qh, kh, vh, mask, self.scale)  # fp32 [B, H, T, Dv]
        if track:
            with torch.no_grad():
                mx = self.qk_max[h0:h1]
                mx.copy_(torch.maximum(mx, max_logit.to(mx.dtype)))
        return self._gated(x, o, h0, h1)

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The attention output ``o [B, H, T, Dv]`` (fp32) of the layer input ``x [B, T, d]`` -> ``y [B, T, d]``:
        the sigmoid output gate, then W_o."""
        return self.o_proj(self._gated(x, o, 0, self.num_heads))

    def _gated(self, x: torch.Tensor, o: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
        """Heads ``h0..h1-1``'s attention output ``o [B, h1-h0, T, Dv]`` (fp32) -> ``[B, T, (h1-h0)*Dv]`` through
        their rows of the sigmoid output gate, in ``x``'s dtype."""
        B, T, _ = x.shape
        whole = (h0, h1) == (0, self.num_heads)
        o = o.transpose(1, 2).reshape(B, T, (h1 - h0) * self.v_dim)
        if self.use_output_gate:
            gw = self.g_proj.weight
            g = self.g_proj(x) if whole else F.linear(x, gw[h0 * self.v_dim:h1 * self.v_dim])
            o = torch.sigmoid(g) * o
        return o.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora={self.q_lora_rank}, kv_lora={self.kv_lora_rank}, "
                f"nope={self.nope_dim}, rope={self.rope_dim} (NoPE), v={self.v_dim}, gate={self.use_output_gate}")
