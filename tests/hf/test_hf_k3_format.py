"""A tiny checkpoint in the published Kimi K3 schema (tests/hf/k3_schema.py: MXFP4 routed experts, padded A_log,
AttnRes names, the ``language_model.`` prefix, the MoonViT3d tower) imported and exported back:

* import decodes every MXFP4 expert exactly (each E2M1 code times 2^(scale - 127), from the format's table) and
  undoes each layout quirk (A_log padding, ``[1, d]`` AttnRes queries, the shared-expert split, the vision q/k rows
  from interleaved to rotate-half RoPE order);
* export (``--experts auto``: as the source) writes the same key set, dtypes, bytes and ``total_size``, bit for bit
  -- the MXFP4 scales and codes reused; a weight changed in one block of 32 re-quantizes that block only;
  ``--experts bf16`` writes per-expert bf16 weights that import to the same values.
"""
from __future__ import annotations

import torch

import k3train.hf as hf
from k3train.quant.mx import fake_quant
from hf_cases import assert_same_checkpoint, read_checkpoint
from k3_schema import D, E, F, H, K, LAT, VIS, e2m1_value, write_checkpoint

M = "language_model.model.layers.2.block_sparse_moe."


def _decoded(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` values of one expert weight from the format's definition: element 2j in the low nibble of byte
    j, 2j+1 in the high one, each code's E2M1 value times 2^(its block's scale byte - 127)."""
    table = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    return table[codes] * torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)


def test_import_decodes_the_k3_schema(tmp_path):
    src = write_checkpoint(tmp_path)
    model = hf.from_pretrained(tmp_path)
    cfg = model.hf_config
    assert cfg.model.residual == "attnres" and cfg.vision.enabled and cfg.model.kda_decay_form == "lower_bounded"
    ex = model.layers["2"].ffn.experts
    for e, name, ours in ((0, "w1", ex.w_gate), (3, "w2", ex.w_down), (1, "w3", ex.w_up)):
        want = _decoded(src[f"{M}experts.{e}.{name}.weight_packed"], src[f"{M}experts.{e}.{name}.weight_scale"])
        assert torch.equal(ours[e].detach().double(), want.T), f"expert {e} {name}"
    kda = model.layers["1"].attn
    assert torch.equal(kda.A_log.detach(), src["language_model.model.layers.1.self_attn.A_log"][:H])
    assert torch.equal(model.layers["3"].ffn_res.query.detach(),
                       src["language_model.model.layers.3.mlp_res_proj.weight"][0].float())
    shared = model.layers["2"].ffn.shared_experts
    assert torch.equal(shared[1].w_down.weight.detach(),
                       src[M + "shared_experts.down_proj.weight"][:, F:].float())
    qkv = src["vision_tower.encoder.blocks.0.wqkv.weight"].float()
    dh = VIS["qkv"] // VIS["heads"]
    k_hf = qkv[VIS["qkv"]:2 * VIS["qkv"]].reshape(VIS["heads"], dh, -1)
    k_ours = model.vision.encoder.blocks[0].attn.k_proj.weight.detach().reshape(VIS["heads"], dh, -1)
    assert torch.equal(k_ours[:, :dh // 2], k_hf[:, 0::2]) and torch.equal(k_ours[:, dh // 2:], k_hf[:, 1::2])
    from k3train.hf.load import load_hf_weights
    from k3train.model.moe import GroupedExperts
    from moonep.shard import shard_experts

    part = hf.from_pretrained(tmp_path)  # an expert-parallel shard (ep 2, rank 1) decodes only experts 2 and 3
    for m in part.modules():
        if isinstance(m, GroupedExperts):
            shard_experts(m, 2, 1)
            m.w_down.data.zero_()
    stats = load_hf_weights([part], part.hf_config, tmp_path)
    assert torch.equal(part.layers["3"].ffn.experts.w_down, model.layers["3"].ffn.experts.w_down[2:])
    assert stats["bytes_read"] < sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    ids = torch.randint(3, 200, (1, 12))
    with torch.no_grad():
        assert torch.isfinite(hf.logits(model, ids)).all()


def test_export_reproduces_the_k3_schema_bit_for_bit(tmp_path):
    from k3train.hf.export import write_hf_shards

    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir(), out.mkdir()
    write_checkpoint(src_dir)
    model = hf.from_pretrained(src_dir)
    write_hf_shards([model], model.hf_config, out, max_shard_bytes=50_000)
    n = assert_same_checkpoint(src_dir, out)
    assert n > 3 * 2 * E * 3  # every packed + scale of 3 MoE layers
    assert "quantization_config" in (out / "config.json").read_text()

    # one block of 32 of one expert weight changed: that block alone is re-quantized, the rest reused
    before = model.layers["2"].ffn.experts.w_gate[1].detach().clone()
    from k3train.quant.qat import expert_weight_to_mxfp4

    ocp_scales = expert_weight_to_mxfp4(before[None])[1][0]  # what the OCP rule picks for the same values
    assert not torch.equal(ocp_scales, read_checkpoint(src_dir)[1][M + "experts.1.w1.weight_scale"]), \
        "the source's scales should differ from the OCP choice somewhere (so reusing them is what keeps bytes)"
    with torch.no_grad():
        model.layers["2"].ffn.experts.w_gate[1, :, 5] *= 3.0  # expert 1, w1 row 5 (one block along LAT = 32)
    changed = tmp_path / "changed"
    changed.mkdir()
    write_hf_shards([model], model.hf_config, changed, max_shard_bytes=50_000, source_dir=src_dir)
    _, a = read_checkpoint(src_dir)
    _, b = read_checkpoint(changed)
    diff = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert set(diff) <= {M + "experts.1.w1.weight_packed", M + "experts.1.w1.weight_scale"} and diff, diff
    assert torch.equal(a[M + "experts.1.w1.weight_scale"][torch.arange(F) != 5],
                       b[M + "experts.1.w1.weight_scale"][torch.arange(F) != 5])
    back = hf.from_pretrained(changed).layers["2"].ffn.experts.w_gate[1].detach()
    row5 = model.layers["2"].ffn.experts.w_gate[1, :, 5].detach()
    assert torch.equal(back[:, 5], fake_quant(row5[None], "mxfp4")[0])  # the OCP rounding of the changed block
    assert torch.equal(back[:, torch.arange(F) != 5], before[:, torch.arange(F) != 5])  # the others as they were

    # bf16 experts: per expert, nn.Linear-shaped, the same values
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    write_hf_shards([model], model.hf_config, bf16, experts="bf16", source_dir=src_dir)
    _, c = read_checkpoint(bf16)
    assert c[M + "experts.2.w2.weight"].dtype == torch.bfloat16 and c[M + "experts.2.w2.weight"].shape == (LAT, F)
    assert not any(k.endswith("weight_packed") for k in c)
    again = hf.from_pretrained(bf16)
    assert torch.equal(again.layers["3"].ffn.experts.w_down, model.layers["3"].ffn.experts.w_down)
    assert (D, H, K) == (64, 2, 16)
