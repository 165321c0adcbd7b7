"""Context-parallel vision encoding: a micro-batch's media encoded once per CP group, the large ones split.

Without it every CP rank of the first stage encodes every media of its rows (the CP ranks hold the same rows'
media) and keeps the embeddings of its own placeholders (``K3Model.slice_media_embeds``): the encoder's compute
is duplicated ``cp`` times and a 3584 x 3584 image (65,536 patches, joint attention) sits whole on one rank.

With ``vision.cp_split_min_patches > 0`` the code that builds the per-micro-batch CP context
(:func:`k3train.parallelize.make_seq_builder`) attaches a :class:`VisionCPContext` to the batch
(``Batch.vision_cp``) and ``VisionTower.forward(media, cp)`` runs:

* the plan (:func:`plan_vision_split`; host-side shapes only, so every CP rank computes the same one): a media of
  at least ``min_patches`` patches (``t * h * w``) is split over all CP ranks in units of 2 patch rows across all
  frames (the 2 x 2 ``sd2_tpool`` merge and factorised attention's temporal pass stay local), as evenly as
  possible (the extra units go to the least loaded ranks; a media of fewer units than ranks leaves some with
  none); every smaller media is encoded whole by one rank, the least loaded one, largest media first. A rank
  holds one contiguous band of rows of a media, the bands in rank order.
* the encoder on this rank's bands: patch embed, position embedding and 2D RoPE at each patch's true
  ``(t, row, col)``, norms, MLPs, the merge and the projector are per patch / per merged token, so local;
* ``joint`` attention and factorised attention's ``spatial`` pass take the keys / values of the whole of every
  split media (:meth:`VisionCPContext.exchange_kv`); the temporal pass needs nothing;
* the projected embeddings of all media are all-gathered (:meth:`VisionCPContext.assemble`): every rank then holds
  the micro-batch's embeddings in placeholder order and ``K3Model.slice_media_embeds`` picks its slice as before.

Why a small media goes whole to one rank rather than being encoded redundantly by all: the encoder work of the
CP group is then done once (a micro-batch of many ordinary images costs ``1/cp`` of today's per rank) for the
price of the embedding all-gather, which the split media need anyway; the result is exact either way. Setting
``vision.cp_split_min_patches: 0`` keeps the redundant encoding (no context, no collectives).

Collectives (every rank of the CP group joins the same ones in the same order: each decision is taken from the
plan, never from local data; a rank with no band still joins, and an empty ``anchor`` slice of each gathered
tensor reaches its output so its backward runs too). Per micro-batch, ``b`` = element size, ``H dh`` = the
attention's inner width, ``d`` = the LM hidden size, ``P`` / ``M`` = the largest rank's patches of split media
/ merged tokens of all media (parts padded to it: gloo needs equal sizes):

* at construction: one all-gather of 4 int64 (all CP ranks hold the same media; raises alike on all);
* per ViT layer, if any media is split: one all-gather of the packed k and v of every split media
  ``[P, 2, H, dh]`` -- ``(cp - 1) * P * 2 * H * dh * b`` bytes moved per rank -- and one reduce-scatter of the
  same size in backward (each owner receives the sum of every rank's key / value gradients); a factorised layer:
  the same for its spatial pass. (One collective per layer carries k and v of all split media together: the
  bytes of two per split media per layer, fewer calls.)
* once: the embedding all-gather ``[M, d]`` (``(cp - 1) * M * d * b``), a reduce-scatter of it in backward.

E.g. K3's encoder (``H dh`` = 1536, bf16) on one 3584 x 3584 image at cp = 8: ``P`` = 8192, 352 MB moved per
rank per layer forward and again backward, against ``1/8`` of the image's attention and MLP compute per rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from k3train.model.vit import MediaLayout
from kcp.comm import CommStats, all_gather_autograd, all_gather_stacked, group_size_rank
from kcp.context import cp_group_of


@dataclass(frozen=True)
class VisionSplitPlan:
    """Who encodes what: ``bands[i][r] = (first row, rows)`` of media ``i`` on CP rank ``r`` (``rows`` 0: none),
    ``split[i]``: media ``i`` has rows on more than one rank (its attention needs the k / v exchange)."""

    grids: tuple[tuple[int, int, int], ...]
    cp: int
    bands: tuple[tuple[tuple[int, int], ...], ...]
    split: tuple[bool, ...]

    def rank_bands(self, r: int) -> list[tuple[int, int, int]]:
        """``(media, first row, rows)`` of every band rank ``r`` encodes, in media order."""
        return [(i, b[r][0], b[r][1]) for i, b in enumerate(self.bands) if b[r][1] > 0]

    def loads(self) -> list[int]:
        """Patches each rank encodes."""
        return [sum(self.grids[i][0] * n * self.grids[i][2] for i, _, n in self.rank_bands(r))
                for r in range(self.cp)]

    @property
    def any_split(self) -> bool:
        return any(self.split)


def plan_vision_split(grids: Any, cp: int, min_patches: int, merge: int = 2) -> VisionSplitPlan:
    """THE split rule (module docstring): ``grids`` ``[(t, h, w)]`` of a micro-batch's media, the CP size, the
    threshold (``0``: no media is split; each is encoded whole by one rank) -> the plan. Shapes only."""
    grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
    if cp < 1 or min_patches < 0:
        raise ValueError(f"plan_vision_split: cp={cp} must be >= 1 and min_patches={min_patches} >= 0")
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < merge or w < merge or h % merge or w % merge:
            raise ValueError(f"media {i}: patch grid (t={t}, h={h}, w={w}) does not split in rows of {merge}")
    loads = [0] * cp
    units: list[list[int] | None] = [None] * len(grids)

    def least_loaded(k: int) -> list[int]:
        return sorted(range(cp), key=lambda r: (loads[r], r))[:k]

    big = [min_patches > 0 and cp > 1 and t * h * w >= min_patches for t, h, w in grids]
    for i, (t, h, w) in enumerate(grids):
        if big[i]:  # split: units of `merge` rows of all frames, the extra ones to the least loaded ranks
            base, extra = divmod(h // merge, cp)
            plus = set(least_loaded(extra))
            units[i] = [base + (r in plus) for r in range(cp)]
            for r in range(cp):
                loads[r] += units[i][r] * t * merge * w
    for i in sorted((i for i in range(len(grids)) if not big[i]), key=lambda i: (-_patches(grids[i]), i)):
        owner = least_loaded(1)[0]  # whole, on the least loaded rank (largest media first)
        units[i] = [grids[i][1] // merge if r == owner else 0 for r in range(cp)]
        loads[owner] += _patches(grids[i])
    bands = []
    for u in units:
        starts = [sum(u[:r]) for r in range(cp)]
        bands.append(tuple((s * merge, n * merge) for s, n in zip(starts, u)))
    return VisionSplitPlan(grids, cp, tuple(bands), tuple(sum(n > 0 for n in u) > 1 for u in units))


def _patches(g: tuple[int, int, int]) -> int:
    return g[0] * g[1] * g[2]


class VisionCPContext:
    """The vision encoder's context parallelism for one micro-batch on one CP rank (module docstring).

    Args:
        dims_or_group: ``ParallelDims`` (its ``'cp'`` group), a process group, or None (one rank).
        grid_thw: ``[n_media, 3]`` the micro-batch's media grids (the same on every CP rank; checked).
        min_patches: ``vision.cp_split_min_patches``. merge: ``vision.merge_size``.
    Collective over the CP group (one tiny all-gather). The tower calls :meth:`local_layout`,
    :meth:`local_patches`, :meth:`assemble`; the attention layers call :meth:`exchange_kv` through the layout.
    """

    def __init__(self, dims_or_group: Any, grid_thw: Tensor, min_patches: int, merge: int = 2, *,
                 stats: CommStats | None = None) -> None:
        self.group = cp_group_of(dims_or_group)
        self.size, self.rank = group_size_rank(self.group)
        self.stats = stats if stats is not None else CommStats()
        self.merge = merge
        grids = [tuple(int(x) for x in g) for g in grid_thw.detach().reshape(-1, 3).tolist()]
        n = len(grids)
        summary = torch.tensor([n, sum(map(_patches, grids)), sum((i + 1) * h for i, (_, h, _) in enumerate(grids)),
                                sum((i + 1) * (w * 4096 + t) for i, (t, _, w) in enumerate(grids))],
                               dtype=torch.long, device=grid_thw.device)
        every = all_gather_stacked(summary, self.group, self.stats, "vit_layout").cpu()
        if not bool((every == every[0]).all()):
            raise ValueError(f"VisionCPContext: the CP ranks hold different media for one micro-batch (summaries "
                             f"[n_media, patches, ...] {every.tolist()}); every CP rank must get the rows' media")
        self.plan = plan = plan_vision_split(grids, self.size, min_patches, merge)
        media_offsets = [0]
        for g in grids:
            media_offsets.append(media_offsets[-1] + _patches(g))
        # this rank's bands: the local layout and the full-batch patch indices of its patches
        mine = plan.rank_bands(self.rank)
        self.mine = mine
        self.local_grids = tuple((grids[i][0], rows, grids[i][2]) for i, _, rows in mine)
        self.local_rows = tuple((r0, grids[i][1]) for i, r0, _ in mine)
        offs, o = [], 0
        for t, h, w in self.local_grids:
            offs.append(o)
            o += t * h * w
        self.local_offsets = tuple(offs)
        idx = []
        for i, r0, rows in mine:  # rows [r0, r0 + rows) of every frame of media i
            t, h, w = grids[i]
            idx += [torch.arange(media_offsets[i] + (f * h + r0) * w, media_offsets[i] + (f * h + r0 + rows) * w)
                    for f in range(t)]
        self.patch_index = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
        # where each rank's parts sit in its padded buffers: k / v of split media, embeddings of all media
        self.kv_at: list[dict[int, int]] = []
        self.emb_at: list[dict[int, int]] = []
        kv_sizes, emb_sizes = [], []
        for r in range(self.size):
            kv, em = {}, {}
            ko = eo = 0
            for i, _, rows in plan.rank_bands(r):
                t, _, w = grids[i]
                if plan.split[i]:
                    kv[i], ko = ko, ko + t * rows * w
                em[i], eo = eo, eo + (rows // merge) * (w // merge)
            self.kv_at.append(kv)
            self.emb_at.append(em)
            kv_sizes.append(ko)
            emb_sizes.append(eo)
        self.kv_max, self.emb_max = max(kv_sizes), max(emb_sizes)
        self.local_tokens = emb_sizes[self.rank]

    # ------------------------------------------------------------------------------------------------------
    def local_layout(self, layout: Any) -> Any:
        """The encoder's layout of this rank's bands (``layout``: the whole micro-batch's, checked against the
        grids this context was built for), with :meth:`exchange_kv` when a media is split."""
        if tuple(layout.grids) != self.plan.grids:
            raise ValueError(f"VisionCPContext: built for media grids {list(self.plan.grids)} but the encoder got "
                             f"{list(layout.grids)}")
        return MediaLayout(self.local_grids, self.local_offsets, self.local_rows,
                           self.exchange_kv if self.plan.any_split else None)

    def local_patches(self, pixel_values: Tensor) -> Tensor:
        """This rank's patches (``index_select``: a gradient w.r.t. ``pixel_values`` lands on its own rows)."""
        return pixel_values.index_select(0, self.patch_index.to(pixel_values.device))

    def exchange_kv(self, k: Tensor, v: Tensor) -> tuple[list[tuple[Tensor, Tensor, int]], Tensor]:
        """``k, v [N_local, H, dh]`` of this rank's bands -> ``(keys, anchor)``: per local band ``(k, v, key rows)``
        -- the whole media's keys for a split media, the band's own otherwise -- and an empty ``[0, H, dh]`` slice of
        the gathered tensor for the caller to put into its output (so the backward reduce-scatter runs on every
        rank, with or without bands). One all-gather forward, one reduce-scatter backward."""
        plan, H, dh = self.plan, k.shape[1], k.shape[2]
        kv = torch.stack([k, v], dim=1)  # [N, 2, H, dh]
        # kv[:0] first: the buffer depends on k and v even on a rank that sends nothing, so that the gather has a
        # backward node there too (its reduce-scatter is a collective every rank must join)
        parts = [kv[:0]] + [kv[o:o + t * rows * w] for (i, _, rows), (t, _, w), o in
                            zip(self.mine, self.local_grids, self.local_offsets) if plan.split[i]]
        sent = sum(p.shape[0] for p in parts)
        parts.append(kv.new_zeros(self.kv_max - sent, 2, H, dh))
        every = all_gather_autograd(torch.cat(parts), self.group, self.stats, "vit_kv_fwd", "vit_kv_bwd")
        whole: dict[int, Tensor] = {}
        keys = []
        for (i, _, rows), (t, _, w), o in zip(self.mine, self.local_grids, self.local_offsets):
            if not plan.split[i]:
                keys.append((k[o:o + t * rows * w], v[o:o + t * rows * w], rows))
                continue
            h = plan.grids[i][1]
            if i not in whole:  # the bands in rank order, frame by frame: the media's (t, h, w) raster order
                bands = [every[r, self.kv_at[r][i]:self.kv_at[r][i] + t * n * w].reshape(t, n * w, 2, H, dh)
                         for r, (_, n) in enumerate(plan.bands[i]) if n > 0]
                whole[i] = torch.cat(bands, dim=1).reshape(t * h * w, 2, H, dh)
            keys.append((whole[i][:, 0], whole[i][:, 1], h))
        return keys, every[0, :0, 0]

    def assemble(self, emb: Tensor) -> Tensor:
        """``emb [local merged tokens, d]`` (this rank's bands, in order) -> ``[all media's tokens, d]`` in
        placeholder order on every rank. One all-gather forward, one reduce-scatter backward (none without media)."""
        if emb.shape[0] != self.local_tokens:
            raise ValueError(f"VisionCPContext.assemble: {emb.shape[0]} local embeddings, the plan gives "
                             f"{self.local_tokens}")
        if not self.plan.grids:
            return emb
        pad = emb.new_zeros(self.emb_max - emb.shape[0], emb.shape[1])
        every = all_gather_autograd(torch.cat([emb, pad]), self.group, self.stats, "vit_emb_fwd", "vit_emb_bwd")
        m = self.merge
        parts = [every[r, self.emb_at[r][i]:self.emb_at[r][i] + (n // m) * (w // m)]
                 for i, (_, _, w) in enumerate(self.plan.grids)
                 for r, (_, n) in enumerate(self.plan.bands[i]) if n > 0]
        return torch.cat(parts)

    def __repr__(self) -> str:
        return (f"VisionCPContext(cp={self.size}, rank={self.rank}, media={len(self.plan.grids)}, "
                f"split={sum(self.plan.split)}, loads={self.plan.loads()})")
