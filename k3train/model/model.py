"""``K3Model``: the Kimi K3 backbone (+ optional MTP layer) as a plain ``nn.Module`` with pipeline seams.

    tokens -> embed_tokens (+ vision: media -> MoonViT-V2 + projector -> the placeholder positions)
           -> AttnResState(blocks=[emb])
           -> layers.0 .. layers.{L-1}          (K3Layer: KDA or Gated MLA + dense FFN or LatentMoE, Block AttnRes)
           -> final_attnres (aggregate all blocks + partial) -> norm -> lm_head -> logits
           -> mtp (optional): predicts token t+2 from [final aggregation ; Emb(token t+1)]

The stage seam is the :class:`AttnResState` (completed blocks + partial sum): a pipeline stage runs
``forward_layers(state, start, end, seq)`` for any cut; the first stage calls ``embed_batch`` (``embed`` +
the vision encoder on the micro-batch's media) and the last
``loss_sums``. ``layers`` is an ``nn.ModuleDict`` keyed by the global layer index so a pruned model (pipeline
chunk) keeps the full model's FQNs; pruned top-level parts are set to ``None``.

``model.residual: standard`` swaps Block AttnRes for a PreNorm residual stream (the ablation): the state then holds
one running tensor ``h`` as its ``partial`` and no blocks (see :func:`k3train.model.attnres.canonical_layout`), the
final "aggregation" is ``h`` itself and the model has no ``final_attnres``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.model.attnres import AttnRes, AttnResState
from k3train.model.block import K3Layer
from k3train.model.eagle3 import Eagle3Fusion
from k3train.model.init import init_model_weights
from k3train.model.loss import CE_CHUNK_TOKENS, lm_head_ce_sum  # noqa: F401 - CE_CHUNK_TOKENS: planner pieces
from k3train.model.media import MediaInputs
from k3train.model.mtp import MTPLayer
from k3train.model.norm import RMSNorm
from k3train.model.seq import SeqInfo
from k3train.model.vit_tower import VisionTower

class K3Model(nn.Module):
    """The K3 language model. ``cfg`` is a validated :class:`k3train.config.ModelConfig`; ``vision`` (optional)
    the validated :class:`k3train.config.VisionConfig`: when enabled the model holds ``vision`` (a
    :class:`VisionTower`: ``vision.encoder`` + ``vision.projector``) beside ``embed_tokens``, on the first pipeline
    stage like it (pruned chunks set it to ``None``). ``eagle3``: the model also holds ``eagle3``, the EAGLE-3
    draft's ``W_E3`` (k3train/model/eagle3.py), on the last stage with the MTP layer.

    Public methods (the contract's model seams): ``embed``, ``embed_batch``, ``encode_batch``, ``encode_media``,
    ``forward_layers``, ``final_hidden``, ``loss_sums``, ``forward``, ``init_weights``. No torch.distributed calls;
    parallelism is applied from outside.
    """

    def __init__(self, cfg: Any, vision: Any = None, eagle3: bool = False) -> None:
        super().__init__()
        L = cfg.num_hidden_layers
        if len(cfg.kda_layers) + len(cfg.full_attn_layers) != L:
            raise ValueError("model config has no layer plan (kda_layers/full_attn_layers): build it through "
                             "load_config / Config.validate()")
        if cfg.tie_word_embeddings:
            raise ValueError("model.tie_word_embeddings=true is not supported (K3 unties embedding and LM head)")
        self.cfg = cfg
        d, V = cfg.hidden_size, cfg.vocab_size
        self.block_size = cfg.attn_res_block_size
        self.recompute = cfg.attn_res_recompute
        self.residual = cfg.residual
        self.embed_tokens: nn.Embedding | None = nn.Embedding(V, d)
        self.vision_cfg = vision if vision is not None and vision.enabled else None
        self.media_placeholder_token_id = cfg.media_placeholder_token_id
        if self.vision_cfg is not None and not 0 <= self.media_placeholder_token_id < V:
            raise ValueError(f"vision needs model.media_placeholder_token_id in [0, {V}), got "
                             f"{self.media_placeholder_token_id}")
        self.vision: VisionTower | None = VisionTower(self.vision_cfg, d) if self.vision_cfg is not None else None
        self.layers = nn.ModuleDict({str(i): K3Layer(cfg, i) for i in range(L)})
        self.final_attnres: AttnRes | None = AttnRes(d, cfg.rms_norm_eps) if self.residual == "attnres" else None
        self.norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(d, V, bias=False)
        self.mtp: MTPLayer | None = MTPLayer(cfg) if cfg.num_nextn_predict_layers > 0 else None
        self.recompute_unit: str | None = None  # set_recompute
        # eagle3 (train.objective=eagle3): the EAGLE-3 draft's feature fusion W_E3 beside the MTP layer it drives
        self.eagle3: Eagle3Fusion | None = Eagle3Fusion(d) if eagle3 else None

    def set_recompute(self, unit: str | None) -> None:
        """What :meth:`forward_layers` recomputes in the backward (``parallel.recompute_granularity``, set from
        outside like the runner's other policies): ``None`` (nothing, or the caller checkpoints a whole chunk),
        ``"layer"`` (each layer one region: its input kept), ``"sublayer"`` (each token mixer and FFN one region,
        or chunk by chunk when it computes in head / token chunks -- the MTP layer's MLA and MoE included)."""
        if unit not in (None, "layer", "sublayer"):
            raise ValueError(f"recompute unit must be None, 'layer' or 'sublayer', got {unit!r}")
        self.recompute_unit = unit
        for mod in self.modules():
            if isinstance(mod, K3Layer):
                mod.recompute_sublayers = unit == "sublayer"
            elif hasattr(mod, "checkpoint_chunks"):
                mod.checkpoint_chunks = unit == "sublayer"

    # ---------------------------------------------------------------------------------------------------------
    # stage seams
    def encode_media(self, media: MediaInputs, cp: Any = None) -> torch.Tensor:
        """The vision tower on ``media``: ``[media.num_tokens(), d]`` embeddings in placeholder order (kept
        separate from :meth:`embed` so a pipeline schedule can run the encoder on its own). ``cp``: the
        micro-batch's vision CP context (``batch.vision_cp``, kcp/vision_cp.py; collective over the CP group),
        which splits the encoding over the CP ranks; the result is the same."""
        if self.vision is None:
            raise RuntimeError("encode_media() called on a model (chunk) without a vision tower (vision.enabled)")
        return self.vision(media, cp) if cp is not None else self.vision(media)

    def scatter_media(self, tokens: torch.Tensor, emb: torch.Tensor, media_embeds: torch.Tensor) -> torch.Tensor:
        """``emb [B, T, d]`` with the positions where ``tokens == media_placeholder_token_id`` replaced, in
        row-major order, by the rows of ``media_embeds [n, d]`` (``n`` must equal the placeholder count)."""
        mask = tokens == self.media_placeholder_token_id
        n = int(mask.sum())
        if n != media_embeds.shape[0]:
            raise ValueError(f"the tokens hold {n} media placeholders (id {self.media_placeholder_token_id}) but "
                             f"the media give {media_embeds.shape[0]} embeddings")
        return emb.masked_scatter(mask.unsqueeze(-1), media_embeds.to(emb.dtype))

    def slice_media_embeds(self, tokens: torch.Tensor, media_embeds: torch.Tensor,
                           offsets: torch.Tensor) -> torch.Tensor:
        """The rows of ``media_embeds`` (all media of the FULL micro-batch rows) that a context-parallel slice's
        placeholders take: row ``b``'s ``k``-th placeholder in ``tokens [B, T/cp]`` takes embedding
        ``offsets[b] + k`` (:attr:`k3train.data.batch.Batch.media_offsets`). Gathered with ``index_select``, so
        the encoder's gradient gets exactly this slice's contributions (the dp_cp reduction sums the slices)."""
        mask = tokens == self.media_placeholder_token_id
        idx = (offsets.to(tokens.device).unsqueeze(1) + mask.long().cumsum(dim=1) - 1)[mask]
        if idx.numel() and int(idx.max()) >= media_embeds.shape[0]:
            raise ValueError(f"a CP slice's placeholders need media embedding {int(idx.max())} but the media give "
                             f"{media_embeds.shape[0]}")
        return media_embeds.index_select(0, idx)

    def embed_batch(self, batch: Any) -> AttnResState:
        """The first pipeline stage's input for a micro-batch (every runner calls this). A text-only model:
        ``embed(batch.tokens)`` (any media ignored). With vision the encoder always runs, on ``batch.media`` or
        on ``MediaInputs.empty()`` when the micro-batch has none (every rank runs the same program), and the
        placeholders take the projected embeddings; a CP slice (``batch.media_offsets`` set) encodes every media
        of its rows and takes only the embeddings of its own placeholders (:meth:`slice_media_embeds`); with
        ``batch.vision_cp`` (kcp/vision_cp.py) the CP ranks share that encoding and each gets all embeddings."""
        if self.vision is None:
            return self.embed(batch.tokens)
        return self.embed(batch.tokens, media_embeds=self.encode_batch(batch))

    def encode_batch(self, batch: Any) -> torch.Tensor:
        """The vision part of :meth:`embed_batch` (a vision model only): the embeddings ``[n, d]`` of the
        micro-batch's placeholders (of this CP slice's, when ``batch.media_offsets`` is set). A pipeline schedule
        runs it as its own action (parallel.encoder_schedule) and embeds with ``embed(tokens, media_embeds=)``."""
        media = getattr(batch, "media", None)
        if media is None:
            media = MediaInputs.empty(self.vision_cfg.patch_size)
        embeds = self.encode_media(media, getattr(batch, "vision_cp", None))
        offsets = getattr(batch, "media_offsets", None)
        if offsets is not None:
            embeds = self.slice_media_embeds(batch.tokens, embeds, offsets)
        return embeds

    def embed(self, tokens: torch.Tensor, media: MediaInputs | None = None,
              media_embeds: torch.Tensor | None = None) -> AttnResState:
        """``tokens [B, T]`` -> the state before layer 0 (``blocks = [embedding]``, no partial sum; standard
        residual: ``partial = embedding``, no blocks). With ``media`` (encoded here) or precomputed
        ``media_embeds`` (from :meth:`encode_media`), the media placeholders take the vision embeddings;
        with neither the embedding is text-only (placeholders keep their token embedding)."""
        if self.embed_tokens is None:
            raise RuntimeError("embed() called on a model chunk without embed_tokens")
        if media is not None and media_embeds is not None:
            raise ValueError("embed(): pass media or media_embeds, not both")
        emb = self.embed_tokens(tokens)
        if media is not None:
            media_embeds = self.encode_media(media)
        if media_embeds is not None:
            emb = self.scatter_media(tokens, emb, media_embeds)
        if self.residual == "standard":
            return AttnResState(blocks=[], partial=emb)
        return AttnResState(blocks=[emb], partial=None)

    def forward_layers(self, state: AttnResState, start: int, end: int, seq: SeqInfo) -> AttnResState:
        """Run layers ``[start, end)`` (global indices) on ``state`` (canonical for ``start``)."""
        if not 0 <= start <= end <= self.cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start}, {end}) outside 0..{self.cfg.num_hidden_layers}")
        state.check_canonical(start, self.block_size, self.residual)
        for i in range(start, end):
            key = str(i)
            if key not in self.layers:
                raise RuntimeError(f"layer {i} is not held by this model chunk (held: {list(self.layers.keys())})")
            if self.recompute_unit == "layer" and torch.is_grad_enabled():
                state = checkpoint(self.layers[key], state, seq, use_reentrant=False)
            else:
                state = self.layers[key](state, seq)
        return state

    def final_aggregate(self, state: AttnResState) -> torch.Tensor:
        """Final AttnRes over all blocks (+ the last partial sum), before the final norm: ``[B, T, d]`` (the
        residual stream ``h`` itself under the standard residual)."""
        if self.residual == "standard":
            state.check_canonical(self.cfg.num_hidden_layers, self.block_size, self.residual)
            return state.partial
        if self.final_attnres is None:
            raise RuntimeError("final_aggregate() called on a model chunk without final_attnres")
        state.check_canonical(self.cfg.num_hidden_layers, self.block_size)
        return self.final_attnres(state.sources(), None, self.recompute)

    def final_hidden(self, state: AttnResState) -> torch.Tensor:
        """``norm(final AttnRes aggregation)``: the LM head's input ``[B, T, d]``."""
        return self.norm(self.final_aggregate(state))

    def loss_sums(self, state: AttnResState, batch: Any, seq: SeqInfo) -> dict[str, torch.Tensor]:
        """Summed token losses of one micro-batch (the caller divides by GLOBAL token counts).

        Returns scalars: ``lm_loss_sum`` (CE of next-token prediction over ``batch.loss_mask``), ``lm_tokens``;
        ``mtp_loss_sum`` (CE of token t+2 over ``batch.mtp_loss_mask``, 0 without MTP), ``mtp_tokens``.
        """
        if self.lm_head is None or self.norm is None:
            raise RuntimeError("loss_sums() called on a model chunk without the LM head")
        agg = self.final_aggregate(state)
        out = {
            "lm_loss_sum": lm_head_ce_sum(self.norm(agg), self.lm_head, batch.labels, batch.loss_mask),
            "lm_tokens": batch.loss_mask.float().sum(),
        }
        if self.mtp is not None:
            if self.embed_tokens is None:
                raise RuntimeError("the MTP layer needs the (shared) embed_tokens on the last pipeline stage")
            next_emb = self.embed_tokens(batch.labels.clamp(0, self.cfg.vocab_size - 1))
            out["mtp_loss_sum"] = lm_head_ce_sum(self.mtp(agg, next_emb, seq), self.lm_head, batch.mtp_labels,
                                                 batch.mtp_loss_mask)
            out["mtp_tokens"] = batch.mtp_loss_mask.float().sum()
        else:
            out["mtp_loss_sum"] = agg.new_zeros((), dtype=torch.float32)
            out["mtp_tokens"] = agg.new_zeros((), dtype=torch.float32)
        return out

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        """Single-process reference: embed -> all layers -> loss sums, plus ``loss`` = the micro-batch's own mean
        (``lm_loss_sum / lm_tokens + mtp_loss_weight * mtp_loss_sum / mtp_tokens``)."""
        seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
        state = self.forward_layers(self.embed_batch(batch), 0, self.cfg.num_hidden_layers, seq)
        out = self.loss_sums(state, batch, seq)
        loss = out["lm_loss_sum"] / out["lm_tokens"].clamp_min(1)
        if self.mtp is not None:
            loss = loss + self.cfg.mtp_loss_weight * out["mtp_loss_sum"] / out["mtp_tokens"].clamp_min(1)
        out["loss"] = loss
        return out

    # ---------------------------------------------------------------------------------------------------------
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter (and reset buffers) from generators seeded by ``(seed, FQN)``: a pruned,
        pipeline-split or meta-built-then-materialised model gets the same values as the full one."""
        init_model_weights(self, self.cfg, seed)

    def routers(self) -> list[tuple[str, nn.Module]]:
        """``(fqn, Router)`` of every MoE layer held by this chunk (for QB statistics all-reduce)."""
        return [(n, m) for n, m in self.named_modules() if hasattr(m, "balance_stats") and hasattr(m, "balance_step")]
