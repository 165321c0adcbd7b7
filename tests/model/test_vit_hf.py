"""A K2.5-format vision tower built from our config equals Hugging Face transformers' ``kimi_k25`` tower +
projector for the same (random) weights: images of three sizes (one at the table's size, one down-, one
upsampled: bicubic) and a 3-frame clip in one call."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig  # noqa: E402
from transformers.models.kimi_k25.modeling_kimi_k25 import (  # noqa: E402
    Kimi_K25MultimodalProjection, Kimi_K25VisionModel)

from k3train.config import VisionConfig  # noqa: E402
from k3train.model.media import MediaInputs  # noqa: E402
from k3train.model.vit_hf import hf_vision_state_dict, vision_overrides_from_hf  # noqa: E402
from k3train.model.vit_tower import VisionTower  # noqa: E402

TEXT_HIDDEN = 40
GRIDS = [[1, 8, 8], [1, 4, 6], [1, 12, 10], [3, 4, 4]]


def _hf_modules(dtype):
    vc = Kimi_K25VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                              num_attention_heads=2, num_hidden_layers=2, hidden_size=32, intermediate_size=48)
    vc._attn_implementation = "eager"
    cfg = Kimi_K25Config(text_config={"model_type": "deepseek_v3", "hidden_size": TEXT_HIDDEN},
                         vision_config=vc.to_dict(), projection_hidden_size=32)
    tower, proj = Kimi_K25VisionModel(vc).to(dtype).eval(), Kimi_K25MultimodalProjection(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every tensor random (norm gains around 1), so a swapped name cannot pass
        for mod in (tower, proj):
            for n, p in mod.named_parameters():
                r = torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.copy_(1 + 0.1 * r if "norm" in n and n.endswith("weight") else 0.2 * r)
    return vc, cfg, tower, proj


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-6)])
def test_k25_tower_matches_transformers(dtype, tol):
    vc, cfg, tower, proj = _hf_modules(dtype)
    ours = VisionTower(VisionConfig(**vision_overrides_from_hf(vc.to_dict(), cfg.projection_layer_norm_eps)),
                       TEXT_HIDDEN).to(dtype)
    sd = {f"vision_tower.{k}": v for k, v in tower.state_dict().items()}
    sd.update({f"mm_projector.{k}": v for k, v in proj.state_dict().items()})
    ours.load_state_dict(hf_vision_state_dict(sd, prefix=""), strict=True)

    grid = torch.tensor(GRIDS)
    g = torch.Generator().manual_seed(1)
    px = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=g, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        ref = proj(tower(px, grid_thw=grid).pooler_output).squeeze(1)
        out = ours(MediaInputs(px, grid))
    assert out.shape == (sum(h * w // 4 for _, h, w in GRIDS), TEXT_HIDDEN) == ref.shape
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_hf_mapping_rejects_unknown_vision_tensor():
    with pytest.raises(ValueError, match="no mapping"):
        hf_vision_state_dict({"model.vision_tower.layers.0.attn.qkv.weight": torch.zeros(1)})
    assert hf_vision_state_dict({"model.language_model.embed_tokens.weight": torch.zeros(1)}) == {}
