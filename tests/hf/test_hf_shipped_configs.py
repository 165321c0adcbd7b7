"""Every shipped config's model exports in the published layout and imports back bit for bit:

* configs/tiny.yaml, tiny-vl.yaml, small.yaml, k3.yaml: the exported ``config.json`` maps back to the same
  ``model`` / ``vision`` sections (the shared experts as the published one MLP, k3train's split recorded);
* ``make train``'s run (configs/tiny.yaml through the real trainer, test-sized batches): its checkpoint through
  ``k3train export-hf`` reads back to the trained parameters exactly, and that export written again from the imported
  model is the same bytes;
* tiny-vl (the vision tower with its final norm): a fresh model's export reads back to the same parameters.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import k3train.hf as hf
from hf_cases import assert_same_checkpoint, run_overrides

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny", "tiny-vl", "small", "k3"])
def test_shipped_config_maps_both_ways(name):
    from k3train.config import load_config
    from k3train.hf.config_map import check_run_matches, config_json_from_config, sections_from_config_json

    cfg = load_config(ROOT / "configs" / f"{name}.yaml", [])
    cj = config_json_from_config(cfg)
    _, model, vision = sections_from_config_json(cj, name)
    check_run_matches(cfg, model, vision, name)  # every mapped value equals the run's
    assert (model["num_shared_experts"], model["shared_expert_intermediate_size"]) == \
        (cfg.model.num_shared_experts, cfg.model.shared_expert_intermediate_size)
    tc = cj.get("text_config", cj)
    assert tc["num_shared_experts"] * tc["moe_intermediate_size"] == \
        cfg.model.num_shared_experts * cfg.model.shared_expert_intermediate_size  # one MLP of the published width


def test_make_train_run_exports_and_imports_bit_for_bit(tmp_path):
    from k3train.config import load_config
    from k3train.hf_commands import export_hf_main
    from k3train.hf.export import write_hf_shards
    from k3train.trainer import Trainer

    if run_overrides(tmp_path, 1)[0].endswith("None"):
        pytest.skip("the shipped corpus is not built")
    tr = Trainer(load_config(ROOT / "configs" / "tiny.yaml", run_overrides(tmp_path / "run", 1)))
    try:
        tr.train_step()
        trained = {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()}
        tr.save_checkpoint()
    finally:
        tr.metrics.close()
    out = tmp_path / "exported"
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert export_hf_main(["--config", str(tmp_path / "run" / "config.yaml"), "--checkpoint", str(ckpt), "-o",
                           str(out), "--dtype", "float32"]) == 0
    back = hf.from_pretrained(out)
    assert dict(back.named_parameters()).keys() == trained.keys()
    for n, p in back.named_parameters():
        assert torch.equal(p.detach(), trained[n]), n
    again = tmp_path / "again"
    again.mkdir()
    write_hf_shards([back], back.hf_config, again, dtype=torch.float32, source_dir=out)
    assert assert_same_checkpoint(out, again) > 100


def test_tiny_vl_exports_and_imports(tmp_path):
    from k3train.config import load_config
    from k3train.hf.export import write_hf_shards
    from k3train.model.model import K3Model

    cfg = load_config(ROOT / "configs" / "tiny-vl.yaml", [])
    model = K3Model(cfg.model, cfg.vision)
    model.init_weights(2)
    write_hf_shards([model], cfg, tmp_path, dtype=torch.float32)
    back = hf.from_pretrained(tmp_path)
    for (n, a), (m, b) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(a, b), n
    assert any("final_norm" in n for n, _ in back.named_parameters())
