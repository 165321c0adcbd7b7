"""Parameter counts of the full K3 (meta device) against the published 2.78T / 104.2B, the FLOPs formula against
the module parameters, and SeqInfo's segment offsets."""
import json

import torch

from k3train.config import load_config
from k3train.config.presets import tiny_model_config as tiny_cfg
from k3train.model import K3Model, SeqInfo
from k3train.model.flops import active_matmul_params, model_flops_per_token, param_breakdown
from tools.count_params import count, main


def test_k3_counts_match_published():
    res = count("configs/k3.yaml")
    assert abs(res["total"] - 2.78e12) <= 0.005 * 2.78e12, res["total"]
    assert abs(res["active"] - 104.2e9) <= 0.005 * 104.2e9, res["active"]
    b = res["breakdown"]
    assert sum(c["total"] for n, c in b.items() if n not in ("mtp", "vision", "projector")) == res["total"]
    assert b["embedding"]["total"] == b["lm_head"]["total"] == 163840 * 7168
    assert b["routed_experts"]["total"] == 92 * 896 * 3 * 3584 * 3072
    assert b["routed_experts"]["active"] == 92 * 16 * 3 * 3584 * 3072
    assert b["mtp"]["total"] > 0
    # MoonViT-V2 (about 0.4B): 27 x (q, k, v 1024 -> 1536, o, MLP 1024 <-> 4096, 2 RMSNorm) + patch + 64 x 64 table
    # + the final RMSNorm before the merge (published kimi_k3)
    assert b["vision"]["total"] == 27 * (4 * 1024 * 1536 + 2 * 1024 * 4096 + 2 * 1024) + 3 * 14 * 14 * 1024 \
        + 64 * 64 * 1024 + 1024 == 401_214_464
    assert b["projector"]["total"] == 4096 * 4096 + 4096 * 7168 + 7168  # PatchMergerMLPV2 + RMSNorm(7168)
    assert [im["tokens"] for im in res["vision_per_image"]] == [256, 4096, 16384]  # seed 000's table
    for im in res["vision_per_image"]:  # forward + backward per part, from flops.vision_flops_detail
        assert im["flops"]["total"]["forward"] == im["forward_flops"] > im["encoder_forward_flops"]
        assert im["flops"]["total"]["backward"] > im["forward_flops"]


def test_count_tool_json(capsys):
    assert main(["--config", "configs/tiny.yaml", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert isinstance(res["total"], int) and isinstance(res["active"], int) and "breakdown" in res


def _matmul_params_from_modules(model, cfg, include_mtp):
    """Active matmul parameters read off the module tree: every >= 2-D weight except the embedding and the
    depthwise convs, routed-expert stacks counted k/E."""
    n = 0
    for fqn, p in model.named_parameters():
        if p.ndim < 2 or fqn.startswith("embed_tokens") or "conv1d" in fqn:
            continue
        if fqn.startswith("mtp.") and not include_mtp:
            continue
        if ".experts." in fqn:
            n += p.numel() // cfg.num_experts * cfg.num_experts_per_token
        else:
            n += p.numel()
    if include_mtp and cfg.num_nextn_predict_layers:
        n += cfg.hidden_size * cfg.vocab_size  # the shared LM head runs a second time for the MTP logits
    return n


def test_flops_formula_matches_modules():
    kimi_linear = ("q_lora_rank=null", "use_full_rank_gate=false", "routed_expert_hidden_size=null",
                   "latent_moe_use_norm=false", "hidden_act=silu", "num_expert_group=2")
    for cfg in (tiny_cfg(), tiny_cfg("q_lora_rank=0", "mla_use_output_gate=false", "first_k_dense_replace=2"),
                tiny_cfg(*kimi_linear), load_config("configs/k3.yaml").model):
        with torch.device("meta"):
            model = K3Model(cfg)
        for mtp in (False, True):
            assert active_matmul_params(cfg, mtp) == _matmul_params_from_modules(model, cfg, mtp)
        bd = param_breakdown(model, cfg)
        assert active_matmul_params(cfg, False) <= bd["active"]
        f = model_flops_per_token(cfg, 128)
        assert f > 6 * active_matmul_params(cfg)  # + attention terms


def test_seq_info_cu_seqlens():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 6, 6]])
    seq = SeqInfo.from_doc_ids(doc)
    assert seq.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 12] and seq.cu_seqlens.dtype == torch.int32
    assert seq.positions.tolist()[1] == list(range(6)) and seq.max_seqlen == 4
