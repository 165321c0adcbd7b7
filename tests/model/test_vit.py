"""MoonViT-V2 (k3train/model/vit.py, vit_tower.py) and its K3Model seam, against literal references (float64):
many media in one varlen call == each media alone (outputs and every gradient); factorised attention == an
explicit per-frame then per-position loop; token counts == media.merged_tokens; zero media runs; the placeholder
scatter, pruning, init and the optimizer's per-head marks."""
import math

import pytest
import torch
import torch.nn.functional as F

from k3train.config import ConfigError, VisionConfig, load_config
from k3train.model import K3Model
from k3train.model.flops import vision_flops, vision_flops_detail
from k3train.model.media import MediaInputs, merged_tokens
from k3train.model.vit import MediaLayout, activation, apply_rope, rope_2d
from k3train.model.vit_tower import VisionTower
from k3train.optim.param_groups import build_param_infos
from parallel.pipeline.partition import build_partition
from parallel.pipeline.stage import prune_to_stage

D_MODEL = 40
# an image at the table's size, a downsampled and an upsampled one (bilinear), a 3-frame and a 2-frame clip
GRIDS = [[1, 8, 8], [1, 4, 6], [3, 4, 4], [1, 10, 12], [2, 6, 4]]
TINY_VISION = ["--vision.enabled=true", "--vision.num_hidden_layers=2", "--vision.hidden_size=32",
               "--vision.num_attention_heads=2", "--vision.head_dim=16", "--vision.intermediate_size=64",
               "--vision.pos_emb_height=8", "--vision.pos_emb_width=8", "--vision.projector_hidden_size=48",
               "--model.media_placeholder_token_id=7"]


def _vcfg(**kw) -> VisionConfig:
    base = dict(enabled=True, num_hidden_layers=2, hidden_size=32, num_attention_heads=2, head_dim=16,
                intermediate_size=64, pos_emb_height=8, pos_emb_width=8, projector_hidden_size=48)
    return VisionConfig(**{**base, **kw})


def _tower(seed: int = 0, **kw) -> VisionTower:
    torch.manual_seed(seed)
    t = VisionTower(_vcfg(**kw), D_MODEL).double()
    with torch.no_grad():  # random everything (norm gains around 1) so that no parameter is inert
        for n, p in t.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.3 * torch.randn_like(p))
    return t


def _media(grids, seed: int = 1) -> MediaInputs:
    g = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    px = torch.randn(int(g.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed),
                     dtype=torch.float64)
    return MediaInputs(px, g)


def _split(media: MediaInputs) -> list[MediaInputs]:
    out, o = [], 0
    for t, h, w in media.grid_thw.tolist():
        n = t * h * w
        out.append(MediaInputs(media.pixel_values[o:o + n], media.grid_thw[len(out):len(out) + 1]))
        o += n
    return out


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("attention", ["joint", "factorised"])
def test_varlen_equals_each_media_alone(attention):
    tower, media = _tower(attention=attention), _media(GRIDS)
    out = tower(media)
    assert out.shape == (media.num_tokens(), D_MODEL)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out * w).sum().backward()
    g_all = _grads(tower)
    tower.zero_grad()
    rows, o = [], 0
    for one in _split(media):
        y = tower(one)
        t, h, w_ = one.grid_thw[0].tolist()
        assert y.shape[0] == merged_tokens(t, h, w_)
        (y * w[o:o + y.shape[0]]).sum().backward()
        rows.append(y.detach())
        o += y.shape[0]
    torch.testing.assert_close(out.detach(), torch.cat(rows), atol=1e-9, rtol=1e-9)
    for n, g in _grads(tower).items():
        assert g.abs().sum() > 0, n  # every parameter takes part
        tol = 1e-5 if "norm" in n else 1e-8  # RMSNorm computes (and reduces its gain's gradient) in fp32
        torch.testing.assert_close(g_all[n], g, atol=tol, rtol=tol, msg=lambda s: f"grad of {n}: {s}")


def _ref_attention(attn, x, cos, sin):
    """softmax(q k^T / sqrt(dh)) v per head over all rows of ``x``, written out."""
    H, dh = attn.num_heads, attn.head_dim
    q = apply_rope(attn.q_proj(x).view(-1, H, dh), cos, sin)
    k = apply_rope(attn.k_proj(x).view(-1, H, dh), cos, sin)
    v = attn.v_proj(x).view(-1, H, dh)
    p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh), dim=-1)
    return attn.o_proj(torch.einsum("hqk,khd->qhd", p, v).reshape(x.shape[0], H * dh))


def test_factorised_equals_per_frame_then_per_position_loop():
    tower, media = _tower(attention="factorised"), _media([[3, 4, 6]])
    enc = tower.encoder
    layout = MediaLayout.from_grid_thw(media.grid_thw)
    t, h, w = layout.grids[0]
    with torch.no_grad():
        got = enc(media.pixel_values, layout)
        x = enc.patch_embed(media.pixel_values.reshape(t * h * w, -1)) + enc.pos_embed(layout)
        cos, sin = rope_2d(layout, enc.head_dim, enc.rope_theta, torch.float64, x.device)
        for blk in enc.blocks:
            a, y = blk.norm1(x), x.clone()
            for f in range(t):  # spatial: within frame f
                s = slice(f * h * w, (f + 1) * h * w)
                y[s] += _ref_attention(blk.attn, a[s], cos[s], sin[s])
            a, x = blk.norm1(y), y.clone()
            for pos in range(h * w):  # temporal: the t patches at one position
                idx = torch.arange(t) * h * w + pos
                x[idx] += _ref_attention(blk.attn, a[idx], cos[idx], sin[idx])
            x = x + blk.mlp.fc2(activation(blk.mlp.act, blk.mlp.fc1(blk.norm2(x))))
    torch.testing.assert_close(got, x, atol=1e-9, rtol=1e-9)
    # images: factorised == joint (same weights); clips differ
    joint = _tower(attention="joint")
    joint.load_state_dict(tower.state_dict())
    img, clip = _media([[1, 6, 4]]), media
    with torch.no_grad():
        torch.testing.assert_close(joint(img), tower(img), atol=1e-12, rtol=1e-12)
        assert (joint(clip) - tower(clip)).abs().max() > 1e-3


def test_joint_attention_mixes_frames_and_positions():
    """An explicit joint softmax over all t*h*w patches of the clip equals the encoder's first block."""
    tower, media = _tower(num_hidden_layers=1), _media([[2, 4, 4]])
    enc, layout = tower.encoder, MediaLayout.from_grid_thw(media.grid_thw)
    with torch.no_grad():
        x = enc.patch_embed(media.pixel_values.reshape(32, -1)) + enc.pos_embed(layout)
        cos, sin = rope_2d(layout, enc.head_dim, enc.rope_theta, torch.float64, x.device)
        blk = enc.blocks[0]
        x = x + _ref_attention(blk.attn, blk.norm1(x), cos, sin)
        x = x + blk.mlp.fc2(activation(blk.mlp.act, blk.mlp.fc1(blk.norm2(x))))
        torch.testing.assert_close(enc(media.pixel_values, layout), x, atol=1e-9, rtol=1e-9)


def test_pos_embed_bilinear_and_temporal_table():
    tower = _tower()
    pe = tower.encoder.pos_embed
    layout = MediaLayout.from_grid_thw(torch.tensor([[1, 8, 8], [1, 4, 6], [2, 4, 6]]))
    with torch.no_grad():
        pos = pe(layout)
        torch.testing.assert_close(pos[:64], pe.weight.reshape(64, -1))  # table size: no resampling
        ref = F.interpolate(pe.weight.permute(2, 0, 1)[None], size=(4, 6), mode="bilinear")[0]
        torch.testing.assert_close(pos[64:88], ref.permute(1, 2, 0).reshape(24, -1))
        # clip frame f adds [sin(f w) | cos(f w)]: frame 0 adds (0 | 1), frame 1 (sin w | cos w)
        D = pe.weight.shape[-1]
        inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        torch.testing.assert_close(pos[88:112] - pos[64:88], torch.cat([inv * 0, inv * 0 + 1]).expand(24, D))
        torch.testing.assert_close(pos[112:136] - pos[64:88], torch.cat([inv.sin(), inv.cos()]).expand(24, D))


def test_zero_media_runs_with_zero_grads():
    tower = _tower()
    out = tower(MediaInputs.empty(dtype=torch.float64))
    assert out.shape == (0, D_MODEL)
    out.sum().backward()
    for n, p in tower.named_parameters():
        assert p.grad is not None and not p.grad.any(), n


def test_bad_media_is_a_clear_error():
    tower = _tower()
    with pytest.raises(ValueError, match="multiples of vision.merge_size"):
        tower(_media([[1, 3, 4]]))
    with pytest.raises(ValueError, match="exceeds vision.pos_emb_time=4"):
        tower(_media([[5, 2, 2]]))
    m = _media([[1, 4, 4]])
    with pytest.raises(ValueError, match="pixel_values must be"):
        tower(MediaInputs(m.pixel_values[:-1], m.grid_thw))


def _k3(*extra):
    cfg = load_config("configs/tiny.yaml", TINY_VISION + list(extra))
    model = K3Model(cfg.model, cfg.vision)
    model.init_weights(5)
    return cfg, model.double()


def test_k3model_scatters_media_in_placeholder_order():
    cfg, model = _k3()
    media = _media([[1, 4, 4], [2, 4, 6]])  # 4 + 6 tokens
    tokens = torch.randint(8, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    tokens[0, 3:7] = 7
    tokens[0, 10:] = 7
    tokens[1, :4] = 7
    emb = model.embed(tokens, media).blocks[0]
    enc = model.encode_media(media)
    mask = tokens == 7
    torch.testing.assert_close(emb[mask], enc)  # row-major over [B, T]
    torch.testing.assert_close(emb[~mask], model.embed_tokens(tokens)[~mask])
    torch.testing.assert_close(model.embed(tokens, media_embeds=enc).blocks[0], emb)
    torch.testing.assert_close(model.embed(tokens).blocks[0], model.embed_tokens(tokens))  # text-only path
    tokens[1, 5] = 7
    with pytest.raises(ValueError, match="11 media placeholders .* give 10 embeddings"):
        model.embed(tokens, media)
    # zero media, zero placeholders: the encoder still runs and every vision gradient is a zero
    model.embed(tokens.clamp_min(8), MediaInputs.empty(dtype=torch.float64)).blocks[0].sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.vision.parameters())


def test_k3model_vision_init_pruning_and_optimizer_marks():
    cfg, full = _k3()
    assert K3Model(load_config("configs/tiny.yaml").model, VisionConfig()).vision is None  # disabled: text only
    with torch.device("meta"):
        meta = K3Model(cfg.model, cfg.vision)
    meta.to_empty(device="cpu")
    meta.init_weights(5)
    ref = {n: p for n, p in full.named_parameters() if n.startswith("vision.")}
    assert ref and all(torch.equal(p.double(), ref[n]) for n, p in meta.named_parameters() if n in ref)
    assert {n for n, _ in meta.named_parameters() if n.startswith("vision.")} == ref.keys()
    # init rules: residual writers at std / sqrt(2 * vision layers), the rest at vision.init_std
    o = full.vision.encoder.blocks[0].attn.o_proj.weight
    assert abs(o.std().item() - 0.02 / 2) < 0.004
    assert abs(full.vision.encoder.pos_embed.weight.std().item() - 0.02) < 0.004
    infos = {i.fqn: i for i in build_param_infos([meta], cfg.optim)}
    for n in ("q_proj", "k_proj", "v_proj"):
        inf = infos[f"vision.encoder.blocks.1.attn.{n}.weight"]
        assert inf.layout == "per_head" and (inf.heads, inf.head_rows) == (2, 16)
    assert infos["vision.encoder.pos_embed.weight"].kind == "adamw"
    assert infos["vision.projector.in_proj.weight"].kind == "muon"
    # a later pipeline stage drops the vision tower with the embedding (parallel/pipeline/stage.py)
    part = build_partition(cfg.model, load_config("configs/tiny.yaml", TINY_VISION + ["--parallel.pp=2"]).parallel)
    assert prune_to_stage(full, part, 0).vision is not None and prune_to_stage(meta, part, 1).vision is None


def test_vision_config_validation():
    with pytest.raises(ConfigError, match="vision.head_dim: must be a multiple of 4"):
        load_config("configs/tiny.yaml", TINY_VISION + ["--vision.head_dim=18"])
    with pytest.raises(ConfigError, match="vision.attention: must be one of joint, factorised"):
        load_config("configs/tiny.yaml", TINY_VISION + ["--vision.attention=divided"])
    with pytest.raises(ConfigError, match="model.media_placeholder_token_id: vision.enabled needs"):
        load_config("configs/tiny.yaml", TINY_VISION[:-1])
    load_config("configs/tiny.yaml", ["--vision.head_dim=18"])  # disabled: not checked, text config unchanged


def test_vision_flops_matches_modules():
    v = _vcfg()
    tower = VisionTower(v, D_MODEL)
    enc = sum(p.numel() for p in tower.encoder.parameters() if p.ndim == 2)  # patch embedding + block linears
    proj = sum(p.numel() for p in tower.projector.parameters() if p.ndim == 2)
    attn = sum(p.numel() for n, p in tower.encoder.blocks.named_parameters() if ".attn." in n)
    hd, L = v.num_attention_heads * v.head_dim, v.num_hidden_layers
    for t, h, w in [(1, 4, 6), (3, 4, 4)]:
        n, hw, merged = t * h * w, h * w, h * w // 4
        mean = n * v.hidden_size if t > 1 else 0  # sd2_tpool's mean over a clip's frames
        assert vision_flops((t, h, w), v, D_MODEL) == 2 * n * enc + L * 4 * hd * n * n + mean + 2 * merged * proj
        assert vision_flops((t, h, w), v, D_MODEL, projector=False) == 2 * n * enc + L * 4 * hd * n * n + mean
        fact = 2 * n * enc + L * 4 * hd * t * hw * hw + mean + 2 * merged * proj
        if t > 1:
            fact += 2 * n * attn + L * 4 * hd * hw * t * t  # the temporal pass (same weights, once more)
        assert vision_flops((t, h, w), _vcfg(attention="factorised"), D_MODEL) == fact


def test_vision_flops_detail_hand_count():
    """One image of 4 x 6 patches through the tiny tower (L=2, D=32, 2 x 16 heads, MLP 64, projector 48 -> 40),
    counted by hand; backward = 2 x forward for every matmul, 1 x for the patch embedding (no pixel gradient)."""
    det = vision_flops_detail((1, 4, 6), _vcfg(), D_MODEL)
    n = 24
    hand = {"patch_embed": 2 * n * (3 * 14 * 14) * 32,          # 903,168
            "attn_proj": 2 * 2 * n * 4 * 32 * 32,               # 393,216  (q, k, v, o: 32 -> 32 each)
            "attn_scores": 2 * 4 * 32 * n * n,                  # 147,456  (q k^T and P v over 24^2 pairs)
            "mlp": 2 * 2 * n * 2 * 32 * 64,                     # 393,216
            "merge": 0,                                         # an image: no mean over frames
            "projector": 2 * 6 * (4 * 32 * 48 + 48 * D_MODEL)}  # 96,768   (6 merged tokens)
    assert {k: det[k]["forward"] for k in hand} == hand
    assert det["total"]["forward"] == 1_933_824 == vision_flops((1, 4, 6), _vcfg(), D_MODEL)
    assert det["total"]["backward"] == 2 * 1_933_824 - 903_168
    clip = vision_flops_detail((2, 4, 4), _vcfg(), D_MODEL)  # joint: all (2*16)^2 pairs; the mean over frames
    assert clip["attn_scores"]["forward"] == 2 * 4 * 32 * 32 * 32 and clip["merge"]["forward"] == 32 * 32


@pytest.mark.parametrize("attention", ["joint", "factorised"])
def test_block_recompute_matches_no_recompute(attention):
    """``recompute_blocks`` (parallel.recompute: each block checkpointed) gives the same output and every
    parameter and pixel gradient (float64, to rounding) as the plain forward; under no_grad it is not used."""
    runs = []
    for rc in (False, True):
        tower, media = _tower(attention=attention), _media(GRIDS)
        tower.encoder.recompute_blocks = rc
        media.pixel_values.requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = tower(media)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        (out * w).sum().backward()
        runs.append((out.detach(), _grads(tower), media.pixel_values.grad.clone(), sum(saved)))
    (o0, g0, p0, s0), (o1, g1, p1, s1) = runs
    assert s1 < s0  # the blocks kept only their inputs
    torch.testing.assert_close(o1, o0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p1, p0, rtol=1e-12, atol=1e-12)
    assert g1.keys() == g0.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-12, atol=1e-12, msg=n)
