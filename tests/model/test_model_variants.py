"""The model variants the published Hugging Face checkpoints need (k3train/hf): config validation (one line naming
the key) and the grouped top-k router against a literal per-token loop. The variants' numerics are checked against
transformers' Kimi Linear in tests/hf/test_hf_kimi_linear.py and in every parallel layout in
tests/integration/test_composed_parallel.py (layouts with the ``kimi_linear`` variant)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3train.config import ConfigError, load_config
from k3train.model.moe import Router, group_choice_mask

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


@pytest.mark.parametrize("over,needle", [
    (["--model.hidden_act=gelu"], "model.hidden_act"),
    (["--model.routed_expert_hidden_size=null"], "model.latent_moe_use_norm"),
    (["--model.num_expert_group=3"], "model.num_expert_group"),
    (["--model.num_expert_group=8"], "model.num_expert_group"),  # one expert per group
    (["--model.num_expert_group=2", "--model.topk_group=3"], "model.topk_group"),
    (["--model.num_expert_group=4", "--model.topk_group=1"], "model.topk_group"),  # 2 experts < k + 1 = 3
])
def test_variant_config_errors_name_the_key(over, needle):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, over)
    msg = str(e.value)
    assert msg.startswith(needle) and "\n" not in msg, msg


def test_variant_config_values():
    cfg = load_config(TINY, ["--model.q_lora_rank=null", "--model.routed_expert_hidden_size=null",
                             "--model.latent_moe_use_norm=false"])
    assert cfg.model.q_lora_rank == 0  # HF null == no query compression
    assert not cfg.model.latent_moe and cfg.model.expert_hidden_size == cfg.model.hidden_size


def _literal_grouped_topk(biased: torch.Tensor, groups: int, topk_group: int, k: int) -> list[set[int]]:
    out = []
    n_e = biased.shape[1]
    per = n_e // groups
    for row in biased.tolist():
        score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -score[g])[:topk_group]
        allowed = [e for e in range(n_e) if e // per in best]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:k]))
    return out


def test_grouped_topk_matches_literal_loop():
    torch.manual_seed(0)
    r = Router(16, 12, 2, num_groups=4, topk_group=2, balance="none")
    with torch.no_grad():
        r.weight.normal_(0, 1.0)
        r.bias.normal_(0, 0.3)
    x = torch.randn(50, 16, dtype=torch.float64)
    idx, w, scores, _ = r.route(x)
    want = _literal_grouped_topk(scores + r.bias.double(), 4, 2, 2)
    assert [set(i) for i in idx.tolist()] == want
    torch.testing.assert_close(w, scores.gather(1, idx) / scores.gather(1, idx).sum(-1, keepdim=True))
    mask = group_choice_mask(scores + r.bias.double(), 4, 2)
    assert mask.sum(1).eq(6).all()  # 2 groups of 3 experts per token
