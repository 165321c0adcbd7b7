"""Context-parallel vision encoding (kcp/vision_cp.py): the split rule, and 2 gloo ranks encoding a micro-batch
split over the CP group == the single-process tower (float64, tight): the embeddings on every rank, and the
gradients w.r.t. every tower parameter and ``pixel_values`` summed over the ranks (as the dp x cp reduction
does), each rank's loss using all media's embeddings with its own weights. Cases: a split image + a small
(whole, one rank) image + a split 2-frame clip, joint and factorised attention; only small media; no media; a
split image whose only unit leaves rank 1 with nothing to encode; at cp = 3, a split image of 2 units: rank 2
encodes nothing but joins every k / v exchange. Every rank makes the same collectives (collective_trace)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from kcp.vision_cp import plan_vision_split

MIN = 40  # vision.cp_split_min_patches of these tests
CASES = {  # name -> grids; with MIN = 40: (1, 8, 6) and the clip (2, 4, 6) split, (1, 4, 4) / (1, 4, 6) whole
    "split_small_clip": [[1, 8, 6], [1, 4, 4], [2, 4, 6]],
    "small_only": [[1, 4, 4], [1, 4, 6]],
    "no_media": [],
    "rank1_empty": [[1, 2, 24]],  # 48 patches, one unit of 2 rows: rank 1 gets none
}


def _tower(attention: str):
    from k3train.config import VisionConfig
    from k3train.model.vit_tower import VisionTower

    torch.manual_seed(0)
    vc = VisionConfig(enabled=True, num_hidden_layers=2, hidden_size=32, num_attention_heads=2, head_dim=16,
                      intermediate_size=64, pos_emb_height=8, pos_emb_width=8, projector_hidden_size=48,
                      attention=attention, norm="layernorm")  # RMSNorm computes in fp32 even for fp64 inputs
    t = VisionTower(vc, 40).double()
    with torch.no_grad():  # random everything (norm gains around 1) so that no parameter is inert
        for n, p in t.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.3 * torch.randn_like(p))
    return t


def _media(grids):
    from k3train.model.media import MediaInputs

    g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    px = torch.randn(int(g.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(1),
                     dtype=torch.float64)
    return MediaInputs(px.requires_grad_(), g)


def test_plan_rule():
    p = plan_vision_split([(1, 8, 6), (1, 4, 4), (2, 4, 6), (1, 2, 24)], 2, MIN)
    assert p.split == (True, False, True, False)
    assert p.bands[0] == ((0, 4), (4, 4))  # 4 units of 2 rows, 2 each
    assert p.bands[2] == ((0, 2), (2, 2))  # the clip: one unit (2 rows of both frames) each
    assert p.bands[3] == ((0, 2), (2, 0)) and p.bands[1] == ((0, 0), (0, 4))  # largest small media first
    assert p.loads() == [96, 64] and sum(p.loads()) == 48 + 16 + 48 + 48
    # uneven: 5 units over 3 ranks (the extra ones to the least loaded), fewer units than ranks, no threshold
    p = plan_vision_split([(1, 4, 4), (1, 10, 2)], 3, 20)
    assert p.bands[1] == ((0, 4), (4, 4), (8, 2)) and p.bands[0] == ((0, 0), (0, 0), (0, 4))
    assert plan_vision_split([(1, 2, 64)], 4, 1).bands[0] == ((0, 2), (2, 0), (2, 0), (2, 0))
    assert not any(plan_vision_split([(1, 64, 64)], 4, 0).split)  # 0: never split
    assert plan_vision_split([(1, 64, 64)], 1, 1).bands[0] == ((0, 64),)
    for grids, cp in (([(3, 6, 4), (1, 12, 2), (1, 2, 2)], 4), ([(2, 8, 8)] * 3, 3)):
        p = plan_vision_split(grids, cp, 1)
        for (t, h, w), b in zip(grids, p.bands):  # consecutive bands in rank order covering every row pair
            assert [r0 for r0, _ in b] == [sum(n for _, n in b[:r]) for r in range(cp)] and sum(n for _, n in b) == h
            assert all(n % 2 == 0 for _, n in b) and max(n for _, n in b) - min(n for _, n in b) <= 2
    with pytest.raises(ValueError, match="rows of 2"):
        plan_vision_split([(1, 3, 4)], 2, 1)


def test_config_field():
    from k3train.config import ConfigError, load_config

    assert load_config("configs/tiny-vl.yaml", []).vision.cp_split_min_patches == 4096  # a 896 x 896 px image
    assert load_config("configs/tiny-vl.yaml", ["--vision.cp_split_min_patches=0"]).vision.cp_split_min_patches == 0
    with pytest.raises(ConfigError, match="vision.cp_split_min_patches: must be an integer >= 0"):
        load_config("configs/tiny-vl.yaml", ["--vision.cp_split_min_patches=-1"])


def _body(rank: int, world: int, cases: dict) -> None:
    from kcp.vision_cp import VisionCPContext

    for attention in ("joint", "factorised"):
        tower = _tower(attention)
        params = dict(tower.named_parameters())
        for name, grids in cases.items():
            what = f"{attention} {name} rank {rank}"
            media = _media(grids)
            n_tok = media.num_tokens()
            weights = [torch.randn(n_tok, 40, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)
                       for r in range(world)]
            # the single-process reference: the loss of every rank together
            ref = tower(media)
            sum((ref * w).sum() for w in weights).backward()
            want = {n: p.grad.clone() for n, p in params.items()}
            want_px = media.pixel_values.grad.clone()
            tower.zero_grad()
            media.pixel_values.grad = None
            with trace_collectives() as trace:
                ctx = VisionCPContext(dist.group.WORLD, media.grid_thw, MIN)
                out = tower(media, ctx)
                (out * weights[rank]).sum().backward()
            assert_collectives_match(trace)
            split = any(ctx.plan.split)
            layers = tower.vcfg.num_hidden_layers
            assert trace.count("all_gather_single") == 1 + (layers if split else 0) + (1 if grids else 0), what
            assert trace.count("reduce_scatter_single") == (layers if split else 0) + (1 if grids else 0), what
            kv_bytes = layers * (world - 1) * ctx.kv_max * 2 * 2 * 16 * 8 if split else 0  # the module docstring's
            assert ctx.stats.bytes["vit_kv_fwd"] == ctx.stats.bytes["vit_kv_bwd"] == kv_bytes, what
            emb_bytes = (world - 1) * ctx.emb_max * 40 * 8
            assert ctx.stats.bytes["vit_emb_fwd"] == ctx.stats.bytes["vit_emb_bwd"] == emb_bytes, what
            if name == "rank1_empty":
                assert ctx.plan.split == (False,) and ctx.plan.loads() == [48, 0]
            if name == "rank2_empty_split":  # rank 2 joins the k / v exchange with nothing to send or attend
                assert ctx.plan.split == (True,) and ctx.plan.loads() == [48, 48, 0]
            if name == "split_small_clip":
                assert ctx.plan.split == (True, False, True) and 0 < ctx.patch_index.numel() < media.num_patches()
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10, msg=lambda m: f"{what} output: {m}")
            for n, p in params.items():
                g = p.grad.clone()
                dist.all_reduce(g)
                torch.testing.assert_close(g, want[n], atol=1e-11 * (1 + float(want[n].abs().max())), rtol=1e-9,
                                           msg=lambda m, n=n: f"{what} grad {n}: {m}")
            g = media.pixel_values.grad.clone()
            dist.all_reduce(g)
            torch.testing.assert_close(g, want_px, atol=1e-12, rtol=1e-9, msg=lambda m: f"{what} pixel grad: {m}")
            tower.zero_grad()


def test_split_encoding_equals_single_process_2_ranks():
    run_distributed(_body, 2, CASES, timeout=240)


def test_split_with_an_empty_rank_3_ranks():
    """cp = 3: a split image of 2 units leaves rank 2 without rows; it still joins every exchange."""
    run_distributed(_body, 3, {"rank2_empty_split": [[1, 4, 24]]}, timeout=240)
