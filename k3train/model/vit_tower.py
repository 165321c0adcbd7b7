"""The vision tower of K3Model: MoonViT-V2 encoder + ``sd2_tpool`` merge + projector (PatchMergerMLPV2).

    MediaInputs -> check -> MoonViT (k3train/model/vit.py) -> sd2_tpool -> Projector -> [sum merged tokens, d_model]

Projector (``vision.projector_norm``): ``post`` (V2) = ``in_proj (4D -> P) -> GELU -> out_proj (P -> d_model) ->
norm(d_model)``; ``pre`` (K2.5) = ``norm(D)`` on each of the 4 merged patches, then the two linears, no norm after.
The output rows are in placeholder order (media in order, each media's merged tokens in raster order), so
``K3Model.embed`` scatters them row-major over the placeholder positions.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from k3train.model.media import MediaInputs
from k3train.model.vit import MediaLayout, MoonViT, activation, make_norm, sd2_tpool


class Projector(nn.Module):
    def __init__(self, vcfg: Any, d_model: int) -> None:
        super().__init__()
        D, m = vcfg.hidden_size, vcfg.merge_size
        self.act, self.patch_dim = vcfg.projector_act, D
        self.pre_norm = make_norm(vcfg.norm, D, vcfg.norm_eps, vcfg.bias) if vcfg.projector_norm == "pre" else None
        self.in_proj = nn.Linear(m * m * D, vcfg.projector_hidden_size, bias=vcfg.bias)
        self.out_proj = nn.Linear(vcfg.projector_hidden_size, d_model, bias=vcfg.bias)
        self.norm = make_norm(vcfg.norm, d_model, vcfg.norm_eps, vcfg.bias) if vcfg.projector_norm == "post" else None

    def forward(self, merged: Tensor) -> Tensor:
        """``[M, m*m*D]`` -> ``[M, d_model]``."""
        x = merged
        if self.pre_norm is not None:
            x = self.pre_norm(x.reshape(x.shape[0], -1, self.patch_dim)).reshape(x.shape)
        x = self.out_proj(activation(self.act, self.in_proj(x)))
        return self.norm(x) if self.norm is not None else x


class VisionTower(nn.Module):
    """``K3Model.vision``: ``encoder`` (MoonViT) and ``projector``; ``forward(media) -> [num_tokens, d_model]``."""

    def __init__(self, vcfg: Any, d_model: int) -> None:
        super().__init__()
        self.vcfg = vcfg
        self.merge = vcfg.merge_size
        self.encoder = MoonViT(vcfg)
        self.projector = Projector(vcfg, d_model)

    def check(self, media: MediaInputs) -> MediaLayout:
        """The media's layout, or a ``ValueError`` naming what does not fit this encoder."""
        v, p = self.vcfg, self.vcfg.patch_size
        g, px = media.grid_thw, media.pixel_values
        if g.ndim != 2 or g.shape[1] != 3:
            raise ValueError(f"media.grid_thw must be [n_media, 3] (t, h, w), got shape {tuple(g.shape)}")
        layout = MediaLayout.from_grid_thw(g)
        for i, (t, h, w) in enumerate(layout.grids):
            if t < 1 or h < self.merge or w < self.merge or h % self.merge or w % self.merge:
                raise ValueError(f"media {i}: patch grid (t={t}, h={h}, w={w}) must have t >= 1 and h, w positive "
                                 f"multiples of vision.merge_size={self.merge}")
            if t > v.pos_emb_time:
                raise ValueError(f"media {i}: a clip of {t} frames exceeds vision.pos_emb_time={v.pos_emb_time} "
                                 "(the temporal table's frames)")
        if tuple(px.shape) != (layout.num_patches, 3, p, p):
            raise ValueError(f"media.pixel_values must be [{layout.num_patches}, 3, {p}, {p}] for grid_thw "
                             f"{[list(x) for x in layout.grids]}, got {tuple(px.shape)}")
        return layout

    def forward(self, media: MediaInputs, cp: Any = None) -> Tensor:
        """``[media.num_tokens(), d_model]`` in placeholder order. ``cp`` (optional, attached from outside: a
        :class:`kcp.vision_cp.VisionCPContext`): this rank encodes only its row bands of the media, attention
        takes the rest of each media's keys from the CP group, and the embeddings of all media are gathered."""
        layout = self.check(media)
        if cp is None:
            feats = self.encoder(media.pixel_values, layout)
            return self.projector(sd2_tpool(feats, layout, self.merge))
        local = cp.local_layout(layout)
        feats = self.encoder(cp.local_patches(media.pixel_values), local)
        return cp.assemble(self.projector(sd2_tpool(feats, local, self.merge)))
