"""The EAGLE-3 draft fine-tuned from the MTP layer (K3 report section 8.5; ``train.objective: eagle3``).

The target model (the backbone, its final norm, LM head and embedding) is FROZEN; only the draft is trained: the
pre-trained MTP layer (k3train/model/mtp.py) and a feature fusion ``W_E3``. Notation per packed row (tokens
``x_0..x_T``, ``labels[t] = x_{t+1}``, batch conventions in k3train/data/batch.py):

    features   low_t = b_i, mid_t = b_k  (completed AttnRes block sums, ``train.draft_feature_blocks``, K3: 1, 4)
               high_t = the final AttnRes aggregation over all blocks -- exactly the ``h_main`` the MTP layer
               consumed in pre-training (K3Model.loss_sums), before the final norm
    fusion     g_t = W_E3 [low_t ; mid_t ; high_t]     W_E3 [d, 3d], bias-free, initialised to [0 0 I]: g_t = high_t
    step 0     h^0_t = MTP.hidden(g_t, Emb(x_{t+1}))          draft distribution q^0_t = softmax(lm_head(norm(h^0_t)))
    step j>0   h^j_t = MTP.hidden(h^{j-1}_t, Emb(x_{t+1+j}))  (its own previous output, not a target feature)
    target     p^j_t = softmax(target logits at position t + 1 + j)   (both distributions at temperature 1)

``h^{j-1}_t`` is the draft layer's output before its final norm (the kind of residual-stream tensor ``high_t``
is; the layer normalises its input with ``hnorm`` either way). Embedding and LM head are the target's (shared, as
in MTP, frozen). Step ``j`` at position ``t`` predicts token ``x_{t+2+j}``: a chain of ``S = train.draft_steps``
(K3: 7) tokens drafted after the target's own token ``x_{t+1}``.

Training-time test (EAGLE-3): the ``S`` steps are unrolled over every position at once, and the draft's attention
at step ``j``, position ``t`` sees exactly what it sees when drafting at inference: the step-0 keys/values of
positions ``s <= t`` of its document (the draft's KV cache of the verified prefix) and its own keys/values of
steps ``1..j`` at position ``t`` (the tokens it drafted so far). :func:`ttt_attention` computes that softmax over
``[prefix keys ; diagonal keys]`` densely (``[B, H, T, T]`` scores per step: the readable form; the draft layer's
Gated MLA is NoPE, so positions enter only through the mask). Tokens fed in are the data's (teacher forcing).

Validity: step ``j`` at ``t`` counts (``chain_masks``) when ``x_t .. x_{t+1+j}`` lie in one document of the row
(no EOS among ``x_t .. x_{t+j}``, ``loss_mask`` 1 at ``t .. t+1+j``) and ``t + 1 + j <= T - 1``.

Losses per (step, position), summed over valid positions (the caller divides by GLOBAL counts per step):
    lk   ``-log sum_x min(p(x), q(x))``: the negative log of the acceptance probability of lossless speculative
         sampling; no cross-entropy term
    kl   ``sum_x p(x) (log p(x) - log q(x))`` (KL(p || q), for comparison)
Acceptance ``alpha^j_t = sum_x min(p^j_t(x), q^j_t(x))`` is returned per position for the metrics
(k3train/draft/objective.py: ``draft_accept`` and ``draft_accept_len``).

No torch.distributed here; the draft runs where the pipeline's last stage is (parallel/pipeline/runner.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.model.attnres import AttnResState
from k3train.model.loss import CE_CHUNK_TOKENS
from k3train.model.mla import MLA
from k3train.ops.mla_dense import MaskInfo
from k3train.model.seq import SeqInfo

DRAFT_LOSSES = ("lk", "kl")


class Eagle3Fusion(nn.Module):
    """``W_E3``: ``[low ; mid ; high]`` ``[..., 3d]`` -> ``[..., d]``, bias-free. ``weight [d, 3d]`` is initialised to
    ``[0 0 I]`` (k3train/model/init.py), so the fused feature starts as exactly ``high``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, 3 * d))

    @staticmethod
    def initial_weight(shape: tuple[int, ...]) -> torch.Tensor:
        """``[0 0 I]`` of ``shape = (d, 3d)``."""
        d = shape[0]
        if tuple(shape) != (d, 3 * d):
            raise ValueError(f"W_E3 must be [d, 3d], got {tuple(shape)}")
        w = torch.zeros(shape)
        w[:, 2 * d:] = torch.eye(d)
        return w

    def forward(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([low, mid, high], dim=-1), self.weight)


def draft_features(model: Any, state: AttnResState, blocks: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """``(low, mid, high)`` of the target's final state (canonical after the last layer): the completed block sums
    ``state.blocks[i]`` for ``i`` in ``blocks`` (``blocks[0]`` is the embedding, so 1 is the first block) and the
    final AttnRes aggregation (``model.final_aggregate``)."""
    n = len(state.blocks) - 1
    for i in blocks:
        if not 1 <= i <= n:
            raise ValueError(f"draft feature block {i} is not a completed AttnRes block (the state holds blocks "
                             f"1..{n})")
    return state.blocks[blocks[0]], state.blocks[blocks[1]], model.final_aggregate(state)


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, ``fill`` past the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def chain_masks(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``[B, T]`` float masks of the positions where draft step ``j`` counts (module docstring): ``loss_mask`` 1 at
    ``t, t+1, .., t+1+j`` (all inside the row). Nested: step ``j``'s positions are a subset of step ``j-1``'s."""
    ok = loss_mask > 0
    cur, out = ok, []
    for j in range(steps):
        cur = cur & shift_left(ok, 1 + j, False)
        out.append(cur.to(loss_mask.dtype))
    return out


@dataclass
class TTTCache:
    """The draft layer's keys and values of the unrolled steps: step 0's expanded for all positions (the
    prefix), and the latents of steps 1..j (each seen only by its own position)."""

    prefix_k: torch.Tensor | None = None  # [B, T, H, Dqk]
    prefix_v: torch.Tensor | None = None  # [B, T, H, Dv]
    diag: list[torch.Tensor] = field(default_factory=list)  # [B, T, kv_lora_rank + Dr] per step >= 1


def ttt_attention(attn: MLA, x: torch.Tensor, seq: SeqInfo, cache: TTTCache, step: int) -> torch.Tensor:
    """The Gated MLA of the draft layer at unrolled step ``step`` (module docstring): ``x [B, T, d]`` (the
    normalised attention input of this step) -> ``[B, T, d]``. Updates ``cache`` with this step's keys/values and,
    in training mode, the layer's QK-Clip maxima. Softmax in fp32 (fp64 for fp64 inputs)."""
    if seq.cp is not None:
        raise NotImplementedError("the EAGLE-3 draft's training-time test under context parallelism")
    q = attn.project_q(x).transpose(1, 2)  # [B, H, T, Dqk]
    latent = attn.kv_a_proj_with_mqa(x)
    if step == 0:
        cache.prefix_k, cache.prefix_v = attn.expand_latent(latent)
    else:
        cache.diag.append(latent)
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(acc)
    T = x.shape[1]
    s_prefix = torch.einsum("bhqd,bkhd->bhqk", qf, cache.prefix_k.to(acc)) * attn.scale
    allowed = MaskInfo(q_doc=seq.doc_ids, q_pos=seq.positions, k_doc=seq.doc_ids, k_pos=seq.positions).dense()
    s_prefix = s_prefix.masked_fill(~allowed, float("-inf"))
    diag = [attn.expand_latent(lat) for lat in cache.diag]
    s_diag = [torch.einsum("bhtd,bthd->bht", qf, k.to(acc)).unsqueeze(-1) * attn.scale for k, _ in diag]
    w = torch.softmax(torch.cat([s_prefix, *s_diag], dim=-1), dim=-1)
    o = torch.einsum("bhqk,bkhd->bhqd", w[..., :T], cache.prefix_v.to(acc))
    for i, (_, v) in enumerate(diag):
        o = o + w[..., T + i, None] * v.to(acc).transpose(1, 2)
    if attn.training and attn.track_qk_max:  # QK-Clip sees the draft's logits like any MLA's
        with torch.no_grad():
            m = s_prefix.amax(dim=(0, 2, 3))
            for s in s_diag:
                m = torch.maximum(m, s.amax(dim=(0, 2, 3)))
            attn.qk_max.copy_(torch.maximum(attn.qk_max, m.to(attn.qk_max.dtype)))
    return attn.project_out(x, o)


def unrolled_draft(mtp: nn.Module, fused: torch.Tensor, embed: nn.Module, labels: torch.Tensor, seq: SeqInfo,
                   steps: int) -> list[torch.Tensor]:
    """The training-time test: ``[h^0, .., h^{steps-1}]``, each ``[B, T, d]`` (the draft layer's output before
    its final norm). ``fused [B, T, d]`` = ``W_E3`` of the target's features; ``labels [B, T]``; ``embed`` the
    shared token embedding."""
    vocab = embed.weight.shape[0]
    cache, h, out = TTTCache(), fused, []
    for j in range(steps):
        tok = shift_left(labels, j).clamp(0, vocab - 1)  # x_{t+1+j}; past the row: any id (masked out)
        h = mtp.hidden(h, embed(tok), seq, attend=lambda attn, a, j=j: ttt_attention(attn, a, seq, cache, j))
        out.append(h)
    return out


def token_divergence(draft_logits: torch.Tensor, target_logits: torch.Tensor,
                     kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ``(loss [N], acceptance [N])`` of draft logits ``[N, V]`` against target logits ``[N, V]``
    (module docstring; in at least fp32, the target side without gradient). ``kind``: ``"lk"`` or ``"kl"``."""
    if kind not in DRAFT_LOSSES:
        raise ValueError(f"draft loss must be one of {DRAFT_LOSSES}, got {kind!r}")
    acc = torch.promote_types(draft_logits.dtype, torch.float32)
    log_q = torch.log_softmax(draft_logits.to(acc), dim=-1)
    log_p = torch.log_softmax(target_logits.detach().to(acc), dim=-1)
    accept = torch.minimum(log_p.exp(), log_q.exp()).sum(dim=-1)
    if kind == "lk":
        return -torch.log(accept.clamp_min(torch.finfo(acc).tiny)), accept
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1), accept


def _divergence_chunk(hq: torch.Tensor, hp: torch.Tensor, mask: torch.Tensor, lm_head: nn.Module,
                      kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        target_logits = lm_head(hp)
    loss, accept = token_divergence(lm_head(hq), target_logits, kind)
    return (loss * mask.to(loss.dtype)).sum(), accept.detach()


def divergence_sum(hq: torch.Tensor, hp: torch.Tensor, lm_head: nn.Module, mask: torch.Tensor, kind: str,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_t mask_t loss_t, acceptance [N])`` for draft LM-head inputs ``hq [B, T, d]`` against target LM-head
    inputs ``hp [B, T, d]`` (the shared ``lm_head``), without holding all logits: chunks of ``chunk_tokens``
    tokens (default ``CE_CHUNK_TOKENS``) run under activation checkpointing, as
    :func:`k3train.model.loss.lm_head_ce_sum`."""
    if chunk_tokens is None:
        chunk_tokens = CE_CHUNK_TOKENS
    q_in, p_in, msk = hq.reshape(-1, hq.shape[-1]), hp.reshape(-1, hp.shape[-1]), mask.reshape(-1)
    if q_in.shape[0] <= chunk_tokens or not torch.is_grad_enabled():
        parts = [_divergence_chunk(q_in[s:s + chunk_tokens], p_in[s:s + chunk_tokens], msk[s:s + chunk_tokens],
                                   lm_head, kind) for s in range(0, q_in.shape[0], chunk_tokens)]
    else:
        parts = [checkpoint(_divergence_chunk, q_in[s:s + chunk_tokens], p_in[s:s + chunk_tokens],
                            msk[s:s + chunk_tokens], lm_head, kind, use_reentrant=False)
                 for s in range(0, q_in.shape[0], chunk_tokens)]
    return sum(p[0] for p in parts), torch.cat([p[1] for p in parts])


def accepted_length(accepts: torch.Tensor) -> torch.Tensor:
    """Expected number of accepted draft tokens of an ``S``-token chain per position, from the per-step
    acceptance probabilities ``accepts [S, N]``: ``sum_{k=1..S} prod_{j<k} alpha_j`` (token ``k`` is kept only
    when tokens ``1..k`` all are; the target's own token per verification is not counted)."""
    return torch.cumprod(accepts, dim=0).sum(dim=0)


def draft_loss_sums(model: Any, state: AttnResState, batch: Any, seq: SeqInfo, *, steps: int, kind: str,
                    blocks: tuple[int, int]) -> dict[str, torch.Tensor]:
    """One micro-batch's draft sums on the last pipeline stage (``state``: the target's state after its last
    layer; the target part runs without gradient, the draft part with it when grad mode is on):

    ``draft_loss_sum [S]`` (per step, summed over valid positions), ``draft_accept_sum [S]`` (acceptance summed
    over the same positions), ``draft_tokens [S]`` (how many), ``draft_accept_len_sum`` (the expected accepted
    length of the whole chain, :func:`accepted_length`, summed over the positions where all ``S`` steps count)."""
    if model.mtp is None or model.eagle3 is None or model.lm_head is None or model.embed_tokens is None:
        raise RuntimeError("the EAGLE-3 draft needs the MTP layer, W_E3, the LM head and the embedding on the last "
                           "pipeline stage")
    with torch.no_grad():
        low, mid, high = draft_features(model, state, blocks)
        target_hidden = model.norm(high)
    fused = model.eagle3(low, mid, high)
    hidden = unrolled_draft(model.mtp, fused, model.embed_tokens, batch.labels, seq, steps)
    masks = chain_masks(batch.loss_mask, steps)
    losses, accepts = [], []
    for j, h in enumerate(hidden):
        loss, accept = divergence_sum(model.mtp.norm(h), shift_left(target_hidden, 1 + j), model.lm_head,
                                      masks[j], kind)
        losses.append(loss)
        accepts.append(accept)
    acc = torch.stack(accepts).reshape(steps, *masks[0].shape)
    m = torch.stack(masks).to(acc.dtype)
    return {"draft_loss_sum": torch.stack(losses),
            "draft_accept_sum": (acc * m).sum(dim=(1, 2)),
            "draft_tokens": m.sum(dim=(1, 2)),
            "draft_accept_len_sum": (accepted_length(acc.reshape(steps, -1)) * m[-1].reshape(-1)).sum()}
