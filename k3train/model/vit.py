"""MoonViT-V2, K3's vision encoder, as plain ``nn.Module``s (no torch.distributed): patches -> per-patch features.

    pixel_values [N, 3, p, p] -> patch_embed (a p x p "conv" = one matmul per patch, bias per ``vision.bias``)
        + pos_embed: learnable [64, 64, D] table interpolated to each media's (h, w) grid (bilinear in V2,
          bicubic in K2.5; align_corners=False) + fixed sinusoidal temporal row per frame (clips only)
    -> blocks.0 .. blocks.{L-1}: x += attn(norm1(x)); x += mlp(norm2(x))   (pre-norm, RMSNorm in V2)
         attention: q, k, v = D -> H * dh each, 2D RoPE on q and k, non-causal, within one media only;
         ``joint``: one segment per image / clip (t * h * w patches; the published code),
         ``factorised``: within each frame (h * w), then -- clips only, a second residual pass with the same
         weights -- across the t frames at each patch position (the paper's description)
    -> final_norm (K2.5 only) -> hidden [N, D]; :func:`sd2_tpool` then gives [sum (h/2)(w/2), 4 D].

Layout conventions (kimi_k25's, so its weights load unchanged; see k3train/model/media.py): patches of a media in
``(t, h, w)`` raster order; RoPE over ``head_dim`` rotates pairs ``(j, j + dh/2)`` (rotate-half), the angle of pair
``j`` being ``col * f_{j//2}`` for even ``j`` and ``row * f_{j//2}`` for odd ``j``, ``f_k = theta^(-4k/dh)``;
the temporal table is ``[sin(f * w) | cos(f * w)]``, ``w_i = 10000^(-2i/D)``, with no temporal term for a single
frame; the merge concatenates the 2 x 2 neighbours in the order (0,0), (0,1), (1,0), (1,1).

Variable-length attention is a loop over media of ``scaled_dot_product_attention`` calls (each exact and
batched over frames / positions), so a micro-batch of many media of different sizes costs what each alone costs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from k3train.model.norm import RMSNorm
from k3train.optim.param_groups import mark_per_head


def make_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    """``rmsnorm`` (the project's fp32-computed RMSNorm, no bias) or ``layernorm`` (bias per ``bias``)."""
    if kind == "rmsnorm":
        return RMSNorm(dim, eps)
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    raise ValueError(f"vision.norm must be 'rmsnorm' or 'layernorm', got {kind!r}")


def activation(name: str, x: Tensor) -> Tensor:
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"vision activation must be 'gelu_tanh' or 'gelu', got {name!r}")


@dataclass(frozen=True)
class MediaLayout:
    """Host-side shapes of a micro-batch's media: ``grids[i] = (t, h, w)``, ``offsets[i]`` = its first patch.

    A context-parallel split (kcp/vision_cp.py) hands the encoder a layout of this rank's row bands instead:
    ``rows[i] = (first row, the media's full h)`` places band ``i`` (``h`` rows of all ``t`` frames) in its media
    (position embeddings and RoPE use the true rows), and ``kv_exchange(k, v)`` supplies the keys / values of
    every band's whole media for joint and spatial attention. Both empty: every entry is a whole media."""

    grids: tuple[tuple[int, int, int], ...]
    offsets: tuple[int, ...]
    rows: tuple[tuple[int, int], ...] = ()
    kv_exchange: Any = field(default=None, compare=False, repr=False)

    def row_band(self, i: int) -> tuple[int, int]:
        """``(first row, full h)`` of entry ``i`` in its media (``(0, h)`` for a whole media)."""
        return self.rows[i] if self.rows else (0, self.grids[i][1])

    @classmethod
    def from_grid_thw(cls, grid_thw: Tensor) -> "MediaLayout":
        grids = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
        offsets, o = [], 0
        for t, h, w in grids:
            offsets.append(o)
            o += t * h * w
        return cls(grids, tuple(offsets))

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    def clip_patches(self, device: torch.device) -> Tensor:
        """Patch indices of the multi-frame clips (the temporal pass of factorised attention), in order."""
        idx = [torch.arange(o, o + t * h * w, device=device)
               for (t, h, w), o in zip(self.grids, self.offsets) if t > 1]
        return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device=device)

    def clips_only(self) -> "MediaLayout":
        """The layout of :meth:`clip_patches` (the clips packed together)."""
        return MediaLayout.from_grid_thw(torch.tensor([g for g in self.grids if g[0] > 1], dtype=torch.long)
                                         .reshape(-1, 3))


def rope_2d(layout: MediaLayout, head_dim: int, theta: float, dtype: torch.dtype,
            device: torch.device) -> tuple[Tensor, Tensor]:
    """``(cos, sin) [N, head_dim]`` of the 2D RoPE for every patch (see the module docstring for the layout)."""
    rows, cols = [], []
    for i, (t, h, w) in enumerate(layout.grids):
        r0 = layout.row_band(i)[0]
        r, c = torch.meshgrid(torch.arange(r0, r0 + h, device=device), torch.arange(w, device=device),
                              indexing="ij")
        rows.append(r.reshape(-1).repeat(t))
        cols.append(c.reshape(-1).repeat(t))
    row = torch.cat(rows) if rows else torch.zeros(0, device=device)
    col = torch.cat(cols) if cols else torch.zeros(0, device=device)
    inv = theta ** (-torch.arange(0, head_dim // 2, 2, dtype=dtype, device=device) / (head_dim // 2))
    ang = torch.stack([col.to(dtype)[:, None] * inv, row.to(dtype)[:, None] * inv], dim=-1).reshape(-1, head_dim // 2)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x [N, H, dh]`` by ``cos/sin [N, dh]``, in at least fp32."""
    xf = x.to(cos.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).to(x.dtype)


def sinusoid_time_table(frames: int, dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[frames, dim]``: row ``f`` = ``[sin(f * w) | cos(f * w)]``, ``w_i = 10000^(-2i/dim)`` (fixed, no params)."""
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)
    ang = torch.arange(frames, dtype=dtype, device=device)[:, None] * inv
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class PositionEmbedding2D(nn.Module):
    """Learnable ``weight [height, width, dim]`` resampled to each media's grid, plus the temporal table."""

    def __init__(self, height: int, width: int, dim: int, mode: str, max_frames: int) -> None:
        super().__init__()
        if mode not in ("bilinear", "bicubic"):
            raise ValueError(f"vision.pos_emb_interpolation must be 'bilinear' or 'bicubic', got {mode!r}")
        self.mode, self.max_frames = mode, max_frames
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def forward(self, layout: MediaLayout) -> Tensor:
        """``[N, dim]`` position embeddings of every patch of ``layout``."""
        H0, W0, D = self.weight.shape
        parts = [self.weight.reshape(-1, D)[:0]]  # keeps the table in the graph with no media (zero gradient)
        time = sinusoid_time_table(self.max_frames, D, torch.promote_types(self.weight.dtype, torch.float32),
                                   self.weight.device)
        for i, (t, h, w) in enumerate(layout.grids):
            r0, full_h = layout.row_band(i)  # a CP row band: the media's table, rows [r0, r0 + h)
            if (full_h, w) == (H0, W0):
                grid = self.weight
            else:
                img = self.weight.permute(2, 0, 1)[None]
                grid = F.interpolate(img, size=(full_h, w), mode=self.mode, align_corners=False)[0].permute(1, 2, 0)
            grid = (grid[r0:r0 + h] if full_h != h else grid).reshape(h * w, D)
            if t == 1:
                parts.append(grid)
            else:
                parts.append((grid[None] + time[:t, None].to(grid.dtype)).reshape(t * h * w, D))
        return torch.cat(parts)


class VisionAttention(nn.Module):
    """Non-causal multi-head attention within each media, 2D RoPE on q and k. ``q/k/v_proj [H*dh, D]`` are
    marked for Per-Head Muon."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(dim, inner, bias=bias)
        self.k_proj = nn.Linear(dim, inner, bias=bias)
        self.v_proj = nn.Linear(dim, inner, bias=bias)
        self.o_proj = nn.Linear(inner, dim, bias=bias)
        self.mark_param_attrs()

    def mark_param_attrs(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            mark_per_head(lin.weight, self.num_heads)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: MediaLayout, kind: str) -> Tensor:
        """``x [N, D]`` (the patches of ``layout``) -> ``[N, D]``. ``kind``: ``joint`` (a media's patches attend
        to each other), ``spatial`` (within each frame) or ``temporal`` (across frames at each position).
        With ``layout.kv_exchange`` (a CP row band) the joint / spatial keys are the band's whole media."""
        N, H, dh = x.shape[0], self.num_heads, self.head_dim
        q = apply_rope(self.q_proj(x).view(N, H, dh), cos, sin)
        k = apply_rope(self.k_proj(x).view(N, H, dh), cos, sin)
        v = self.v_proj(x).view(N, H, dh)
        if layout.kv_exchange is not None and kind != "temporal":  # a frame's positions are all in the band
            keys, anchor = layout.kv_exchange(k, v)  # per entry (k, v, key rows); anchor: [0, H, dh] in the graph
            outs = [q[:0] + anchor]  # the exchange's backward runs on every rank, whatever it holds
        else:
            keys = [(k[o:o + t * h * w], v[o:o + t * h * w], h) for (t, h, w), o in zip(layout.grids, layout.offsets)]
            outs = [] if layout.grids else [q[:0] + k[:0] + v[:0]]  # no media: q, k, v stay in the graph
        for (t, h, w), o, (ks, vs, hk) in zip(layout.grids, layout.offsets, keys):
            n = t * h * w
            qs = q[o:o + n]
            if kind == "joint":  # [1, H, n, dh] (4-D: the fused flash / memory-efficient kernels take it)
                qs, ks, vs = (z.transpose(0, 1)[None] for z in (qs, ks, vs))
                out = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
            elif kind == "spatial":  # [t, H, hw, dh] queries, [t, H, hk w, dh] keys
                qs = qs.reshape(t, h * w, H, dh).transpose(1, 2)
                ks, vs = (z.reshape(t, hk * w, H, dh).transpose(1, 2) for z in (ks, vs))
                out = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
            elif kind == "temporal":  # [hw, H, t, dh]
                qs, ks, vs = (z.reshape(t, h * w, H, dh).permute(1, 2, 0, 3) for z in (qs, ks, vs))
                out = F.scaled_dot_product_attention(qs, ks, vs).permute(2, 0, 1, 3)
            else:
                raise ValueError(f"VisionAttention: unknown kind {kind!r}")
            outs.append(out.reshape(n, H, dh))
        return self.o_proj(torch.cat(outs).reshape(N, H * dh))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm block; ``factorised`` attention adds a temporal pass over the clips' patches (same weights)."""

    def __init__(self, vcfg: Any) -> None:
        super().__init__()
        D = vcfg.hidden_size
        self.factorised = vcfg.attention == "factorised"
        self.norm1 = make_norm(vcfg.norm, D, vcfg.norm_eps, vcfg.bias)
        self.attn = VisionAttention(D, vcfg.num_attention_heads, vcfg.head_dim, vcfg.bias)
        self.norm2 = make_norm(vcfg.norm, D, vcfg.norm_eps, vcfg.bias)
        self.mlp = VisionMLP(D, vcfg.intermediate_size, vcfg.hidden_act, vcfg.bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: MediaLayout) -> Tensor:
        if not self.factorised:
            x = x + self.attn(self.norm1(x), cos, sin, layout, "joint")
        else:
            x = x + self.attn(self.norm1(x), cos, sin, layout, "spatial")
            idx = layout.clip_patches(x.device)
            if idx.numel():
                sub = self.attn(self.norm1(x[idx]), cos[idx], sin[idx], layout.clips_only(), "temporal")
                x = x.index_add(0, idx, sub)
        return x + self.mlp(self.norm2(x))


class MoonViT(nn.Module):
    """The encoder: ``(pixel_values [N, 3, p, p], layout)`` -> per-patch features ``[N, hidden_size]``."""

    def __init__(self, vcfg: Any) -> None:
        super().__init__()
        D, p = vcfg.hidden_size, vcfg.patch_size
        self.patch_size = p
        self.head_dim, self.rope_theta = vcfg.head_dim, vcfg.rope_theta
        self.patch_embed = nn.Linear(3 * p * p, D, bias=vcfg.bias)  # the p x p stride-p conv, one matmul
        self.pos_embed = PositionEmbedding2D(vcfg.pos_emb_height, vcfg.pos_emb_width, D,
                                             vcfg.pos_emb_interpolation, vcfg.pos_emb_time)
        self.blocks = nn.ModuleList([VisionBlock(vcfg) for _ in range(vcfg.num_hidden_layers)])
        self.final_norm = make_norm(vcfg.norm, D, vcfg.norm_eps, vcfg.bias) if vcfg.final_norm else None
        # activation recompute per block (set from outside: the runner, under ``parallel.recompute``): a block
        # keeps only its input for backward and re-runs its forward there -- the encoder's saved activations drop
        # from ~13 D-wide vectors per patch and block to one
        self.recompute_blocks = False

    def forward(self, pixel_values: Tensor, layout: MediaLayout) -> Tensor:
        w = self.patch_embed.weight
        x = self.patch_embed(pixel_values.to(w.dtype).flatten(1))
        x = x + self.pos_embed(layout).to(x.dtype)
        cos, sin = rope_2d(layout, self.head_dim, self.rope_theta, torch.promote_types(w.dtype, torch.float32),
                           w.device)
        for blk in self.blocks:
            if self.recompute_blocks and torch.is_grad_enabled():
                x = checkpoint(blk, x, cos, sin, layout, use_reentrant=False)
            else:
                x = blk(x, cos, sin, layout)
        return self.final_norm(x) if self.final_norm is not None else x


def sd2_tpool(x: Tensor, layout: MediaLayout, merge: int = 2) -> Tensor:
    """``[N, D]`` per-patch features -> ``[sum (h/m)(w/m), m*m*D]``: each ``m x m`` neighbourhood concatenated
    (row-major within it), averaged over the media's frames; merged tokens in raster order of the merged grid."""
    D = x.shape[-1]
    outs = [x[:0].reshape(0, merge * merge * D)]  # no media: still in the graph
    for (t, h, w), o in zip(layout.grids, layout.offsets):
        y = x[o:o + t * h * w].reshape(t, h // merge, merge, w // merge, merge, D).mean(0)
        outs.append(y.permute(0, 2, 1, 3, 4).reshape((h // merge) * (w // merge), merge * merge * D))
    return torch.cat(outs)
