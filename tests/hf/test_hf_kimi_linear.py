"""A tiny random Kimi Linear built and saved by transformers 5.24 (``save_pretrained``, small shards) through
k3train's import and export:

* imported (``k3train.hf.from_pretrained``), its logits equal transformers' within 1e-5 relative and the loss of a
  batch (k3train's own loss path) equals transformers' loss -- the Kimi Linear model variants (standard residual,
  KDA with the softplus decay and the low-rank gate, MLA without q_lora and output gate, SwiGLU, a MoE without the
  latent projection, grouped top-k, the correction bias, the routed scaling, two shared experts) against an
  independent implementation (transformers' own torch fallbacks of KDA and the short conv run on CPU);
* import -> export is bit for bit, with the same key set and ``metadata.total_size`` as what ``save_pretrained``
  wrote (its dense first layer as ``block_sparse_moe.*_proj``, its experts per expert), and transformers loads the
  export back;
* ``k3train import-hf`` writes the run config; the real Trainer starts from the checkpoint (``checkpoint.load_hf``)
  and trains 2 steps in one process, in pp2 and in dp2 ep2 (MoonEP), the parallel runs' losses and parameters
  equal the one-process run's; that run's DCP checkpoint, exported by ``k3train export-hf`` and reloaded by
  ``from_pretrained``, gives the trained model's logits exactly.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import k3train.hf as hf
from dist_helpers import run_distributed
from hf_cases import VOCAB, assert_same_checkpoint, run_overrides, save_tiny_kimi_linear
from k3train.data.batch import Batch

STEPS = 2


@pytest.fixture(scope="module")
def kl(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_linear_hf")
    model, _ = save_tiny_kimi_linear(d)
    return d, model


def _ids(b: int = 2, t: int = 33, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (b, t), generator=g)  # no EOS (id 1): one document per row, as transformers


def test_logits_and_loss_match_transformers(kl):
    d, ref = kl
    ours = hf.from_pretrained(d)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids, labels=ids)
        got = hf.logits(ours, ids)
        loss = ours(Batch.from_samples(ids, eos_id=1))["loss"]
    rel = float((got - want.logits).abs().max() / want.logits.abs().max())
    print(f"\nkimi_linear parity: logits max rel diff {rel:.2e}, loss {float(loss):.7f} vs {float(want.loss):.7f}")
    assert rel < 1e-5
    assert abs(float(loss) - float(want.loss)) <= 1e-5 * abs(float(want.loss))


def test_import_export_round_trip_is_bit_identical(kl, tmp_path):
    from transformers import KimiLinearForCausalLM

    from k3train.hf.export import write_hf_shards

    d, _ = kl
    ours = hf.from_pretrained(d)
    out = tmp_path / "export"
    out.mkdir()
    write_hf_shards([ours], ours.hf_config, out, max_shard_bytes=400_000)
    n = assert_same_checkpoint(d, out)
    assert n > 100 and any(".block_sparse_moe.experts.7.w2.weight" in k for k in (out / "model.safetensors.index.json")
                           .read_text().split('"'))
    back = KimiLinearForCausalLM.from_pretrained(str(out)).float().eval()  # what an inference engine reads
    ids = _ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(hf.logits(ours, ids), back(ids).logits, rtol=1e-5, atol=1e-6)


def test_import_hf_writes_the_run_config(kl, tmp_path):
    from k3train.config import load_config
    from k3train.hf_commands import import_hf_main

    d, _ = kl
    out = tmp_path / "run.yaml"
    assert import_hf_main([str(d), "-o", str(out)]) == 0
    cfg = load_config(out, run_overrides(tmp_path / "r", 1))
    m = cfg.model
    assert (m.residual, m.hidden_act, m.routed_expert_hidden_size, m.use_full_rank_gate, m.num_expert_group) == \
        ("standard", "silu", None, False, 2)
    assert cfg.checkpoint.load_hf == str(d.resolve())
    assert import_hf_main([str(d), "-o", str(out)]) == 2  # never overwrites


def _snapshot(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()}


def _parallel_body(rank: int, world: int, run_yaml: str, tmp: str, ref: dict) -> None:
    from k3train.config import load_config
    from k3train.trainer import Trainer

    torch.set_num_threads(1)
    from k3train.hf.export import write_hf_shards

    for name, layout in (("pp2", ["--parallel.pp=2"]),
                         ("dp2_ep2", ["--parallel.dp=2", "--parallel.ep=2", "--parallel.zero=2"])):
        cfg = load_config(run_yaml, run_overrides(Path(tmp) / name, STEPS, layout), world_size=world)
        tr = Trainer(cfg)
        try:
            for fqn, p in tr.pm.model.named_parameters():  # the checkpoint's values, each rank its own slice
                want = ref["init"][fqn]
                if getattr(p, "_k3_expert_parallel", False) and p.shape != want.shape:
                    e0 = p._k3_shard_offset
                    want = want[e0:e0 + p.shape[0]]
                assert torch.equal(p.detach(), want), f"{name}: {fqn} is not the checkpoint's value"
            losses = [tr.train_step()["loss"] for _ in range(STEPS)]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
                                       msg=lambda m: f"{name}: losses {losses} vs {ref['losses']}: {m}")
            for fqn, p in tr.pm.model.named_parameters():
                want = ref["final"][fqn]
                if getattr(p, "_k3_expert_parallel", False) and p.shape != want.shape:
                    want = want[p._k3_shard_offset:p._k3_shard_offset + p.shape[0]]
                torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=2e-5,
                                           msg=lambda m, fqn=fqn: f"{name}: {fqn} after {STEPS} steps: {m}")
            # every rank writes its own tensors; the export holds exactly what the ranks hold
            out = Path(tmp) / f"{name}_export"
            if rank == 0:
                out.mkdir()
            dist.barrier()
            write_hf_shards(tr.pm.modules, cfg, out, dims=tr.dims, skip=tr.pm.runner.replica_params,
                            max_shard_bytes=300_000)
            back = dict(hf.from_pretrained(out).named_parameters())
            for fqn, p in tr.pm.model.named_parameters():
                want = back[fqn].detach()
                if getattr(p, "_k3_expert_parallel", False) and p.shape != want.shape:
                    want = want[p._k3_shard_offset:p._k3_shard_offset + p.shape[0]]
                assert torch.equal(p.detach(), want), f"{name}: exported {fqn} differs from the rank's"
        finally:
            tr.metrics.close()
        dist.barrier()


def test_training_after_import_and_export(kl, tmp_path):
    from k3train.config import load_config
    from k3train.hf_commands import export_hf_main, import_hf_main
    from k3train.trainer import Trainer

    d, _ = kl
    run_yaml = tmp_path / "run.yaml"
    assert import_hf_main([str(d), "-o", str(run_yaml)]) == 0
    tr = Trainer(load_config(run_yaml, run_overrides(tmp_path / "one", STEPS)))
    try:
        init = _snapshot(tr)
        losses = [tr.train_step()["loss"] for _ in range(STEPS)]
        final = _snapshot(tr)
        tr.save_checkpoint()
        ids = _ids(seed=3)
        with torch.no_grad():
            trained = hf.logits(tr.pm.model.eval(), ids)
    finally:
        tr.metrics.close()
    assert torch.equal(init["layers.1.ffn.experts.w_gate"][3], hf.from_pretrained(d).layers["1"].ffn.experts
                       .w_gate[3].detach())
    from k3train.preflight import starts_from_hf

    resumed = load_config(run_yaml, run_overrides(tmp_path / "one", STEPS + 1) + ["--checkpoint.resume=auto"])
    assert not starts_from_hf(resumed)  # a resume continues the run; checkpoint.load_hf only starts one
    # the one-process run's checkpoint -> export-hf -> from_pretrained: the trained model, exactly
    out = tmp_path / "exported"
    ckpt = tmp_path / "one" / "checkpoints" / f"step_{STEPS:08d}"
    assert export_hf_main(["--config", str(tmp_path / "one" / "config.yaml"), "--checkpoint", str(ckpt),
                           "-o", str(out)]) == 0
    with torch.no_grad():
        assert torch.equal(hf.logits(hf.from_pretrained(out), ids), trained)
    run_distributed(_parallel_body, 2, str(run_yaml), str(tmp_path),
                    {"init": init, "final": final, "losses": losses})


# ----------------------------------------------------------------------------------------------------------------
# bad checkpoints: one line naming the problem, from the run's preflight (before anything is built)
def _damage(d: Path, how: str) -> str:
    """Damage checkpoint copy ``d`` in one way; returns what the error line must name."""
    import json

    from safetensors.torch import load_file, save_file

    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    key = "model.layers.2.self_attn.q_proj.weight"
    if how == "missing tensor":
        del wm[key]
        index_path.write_text(json.dumps(index))
        return key
    if how == "extra tensor":
        wm["model.layers.2.self_attn.rotary_emb.inv_freq"] = wm[key]
        shard = d / wm[key]
        t = load_file(str(shard))
        t["model.layers.2.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        save_file(t, str(shard), metadata={"format": "pt"})
        index_path.write_text(json.dumps(index))
        return "model.layers.2.self_attn.rotary_emb.inv_freq"
    if how == "wrong shape":
        shard = d / wm[key]
        t = load_file(str(shard))
        t[key] = t[key][:, :32].contiguous()
        save_file(t, str(shard), metadata={"format": "pt"})
        return key
    if how == "truncated shard":
        shard = d / wm[key]
        shard.write_bytes(shard.read_bytes()[:-1000])
        return shard.name
    if how == "unmappable config":
        cj = json.loads((d / "config.json").read_text())
        cj["linear_attn_config"]["full_attn_layers"], cj["linear_attn_config"]["kda_layers"] = [1, 4], [2, 3]
        (d / "config.json").write_text(json.dumps(cj))
        return "full_attn_layers"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["missing tensor", "extra tensor", "wrong shape", "truncated shard",
                                 "unmappable config"])
def test_bad_checkpoint_is_one_line_before_anything_is_built(kl, tmp_path, how):
    import shutil

    from k3train.config import ConfigError
    from k3train.hf_commands import import_config_text
    from k3train.preflight import validate_run

    d, _ = kl
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(import_config_text(d).replace(str(d), str(bad)))
    needle = _damage(bad, how)
    with pytest.raises(ConfigError) as e:
        validate_run(run_yaml, run_overrides(tmp_path / "run", 1))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint.load_hf") and needle in msg, msg


def test_bad_checkpoint_through_the_entry_point(kl, tmp_path):
    """The real entry point: exit 2, one ``k3train: error:`` line naming the shard, no traceback, no run."""
    import shutil
    import subprocess
    import sys

    from k3train.runtime.process_groups import child_pythonpath
    from k3train.hf_commands import import_config_text

    d, _ = kl
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    needle = _damage(bad, "truncated shard")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(import_config_text(d).replace(str(d), str(bad)))
    env = {**{k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")},
           "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "k3train.train", "--config", str(run_yaml),
                          *run_overrides(tmp_path / "run", 1)], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


def test_fused_experts_and_expert_rows(kl, tmp_path):
    """transformers' fused layout (``mlp.experts.gate_up_proj [E, 2f, d]``, gate rows first, ``down_proj [E, d, f]``)
    reads to the same model; an expert-parallel shard reads only its experts' rows (safetensors slices)."""
    import json

    from safetensors.torch import save_file

    from hf_cases import read_checkpoint
    from k3train.hf.load import load_hf_weights
    from k3train.model.moe import GroupedExperts
    from moonep.shard import shard_experts

    d, _ = kl
    index, t = read_checkpoint(d)
    fused: dict[str, torch.Tensor] = {}
    for i in (1, 2, 3):
        b = f"model.layers.{i}.block_sparse_moe.experts."
        gate_up = [torch.cat([t.pop(f"{b}{e}.w1.weight"), t.pop(f"{b}{e}.w3.weight")]) for e in range(8)]
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([t.pop(f"{b}{e}.w2.weight") for e in range(8)])
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_file(t, str(out / "a.safetensors"))
    save_file(fused, str(out / "b.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {**{k: "a.safetensors" for k in t}, **{k: "b.safetensors" for k in fused}}}))
    full = hf.from_pretrained(d)
    got = hf.from_pretrained(out)
    for (n, a), (_, b) in zip(full.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    for src in (d, out):  # experts 4..7 of 8 (ep 2, rank 1): per-expert tensors, or rows of the fused stacks
        model = hf.from_pretrained(src)
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                shard_experts(m, 2, 1)
                m.w_gate.data.zero_()
        load_hf_weights([model], model.hf_config, src)
        ex = model.layers["2"].ffn.experts
        assert torch.equal(ex.w_gate, full.layers["2"].ffn.experts.w_gate[4:]) and ex.w_gate.shape[0] == 4


def test_k3train_model_with_mtp_exports_and_imports(tmp_path):
    """A model made by k3train (configs/tiny.yaml: Block AttnRes -> the kimi_k3 layout, SiTU-GLU, LatentMoE, MTP)
    exported without a source (fp32) reads back to the same parameters; the MTP layer in DeepSeek-V3's next-n names."""
    from k3train.config import load_config
    from k3train.hf.export import write_hf_shards
    from k3train.model.model import K3Model

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
                      ["--model.shared_expert_intermediate_size=32", "--model.num_hidden_layers=4"])
    model = K3Model(cfg.model)
    model.init_weights(5)
    write_hf_shards([model], cfg, tmp_path, dtype=torch.float32)
    names = (tmp_path / "model.safetensors.index.json").read_text()
    assert "language_model.model.layers.4.eh_proj.weight" in names and "shared_head.norm" in names
    back = hf.from_pretrained(tmp_path)
    for (n, a), (m, b) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(a, b), n


def test_fresh_kimi_linear_export_is_read_by_transformers(tmp_path):
    """A model k3train made (no imported source: published names, config.json fields, fp32) in the Kimi Linear
    variants loads in transformers' KimiLinearForCausalLM with the same logits."""
    from transformers import KimiLinearForCausalLM

    from model_variants import VARIANTS
    from k3train.config import load_config
    from k3train.hf.export import write_hf_shards
    from k3train.model.model import K3Model

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml",
                      [*VARIANTS["kimi_linear"], "--model.num_nextn_predict_layers=0", "--model.rms_norm_eps=1e-6",
                       "--model.shared_expert_intermediate_size=32", "--model.num_hidden_layers=4"])
    model = K3Model(cfg.model)
    model.init_weights(3)
    write_hf_shards([model], cfg, tmp_path, dtype=torch.float32)
    theirs = KimiLinearForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    ids = _ids(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(hf.logits(model.eval(), ids), theirs(ids).logits, rtol=1e-5, atol=1e-6)
