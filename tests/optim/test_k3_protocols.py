"""The K3 model satisfies the optimizer's protocols: per-head marking of KDA/MLA projections and QK-Clip on MLA."""
import pytest
import torch

from k3train.config.presets import tiny_config
from k3train.optim import build_optimizer
from parallel.dims import ParallelDims

model_mod = pytest.importorskip("k3train.model.model")
batch_mod = pytest.importorskip("k3train.data.batch")


def _tiny():
    cfg = tiny_config("--model.num_hidden_layers=4", "--model.num_nextn_predict_layers=0", world_size=1)
    m = model_mod.K3Model(cfg.model)
    m.init_weights(3)
    return cfg, m.train()


def test_grouping_on_k3_model():
    cfg, m = _tiny()
    opt = build_optimizer(m, cfg, ParallelDims(), zero=0, log_table=False)
    infos = {i.fqn: i for i in opt.infos}
    mc = cfg.model
    for li in range(mc.num_hidden_layers):
        if mc.layer_kind(li) == "kda":
            for n in ("q_proj", "k_proj", "v_proj"):
                inf = infos[f"layers.{li}.attn.{n}.weight"]
                assert inf.layout == "per_head" and inf.heads == mc.kda_num_heads
        else:
            q = infos[f"layers.{li}.attn.q_b_proj.weight"]
            kv = infos[f"layers.{li}.attn.kv_b_proj.weight"]
            assert q.layout == kv.layout == "per_head" and q.heads == kv.heads == mc.num_attention_heads
            assert kv.segments == (mc.qk_nope_head_dim, mc.v_head_dim)
    assert infos["embed_tokens.weight"].kind == infos["lm_head.weight"].kind == "adamw"
    assert any(i.layout == "stacked" for i in infos.values())
    assert not any("bias" in n and "router" in n for n in infos)  # router bias is a buffer
    n_mla = sum(mc.layer_kind(i) == "mla" for i in range(mc.num_hidden_layers))
    assert len(opt.qk_modules) == n_mla and all(len(t) == 3 for t in opt.qk_targets)


def test_qk_clip_on_k3_mla():
    cfg, m = _tiny()
    samples = torch.randint(3, cfg.model.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    batch = batch_mod.Batch.from_samples(samples, eos_id=cfg.model.eos_token_id, pad_id=cfg.model.pad_token_id)
    first_mla = next(i for i in range(cfg.model.num_hidden_layers) if cfg.model.layer_kind(i) == "mla")
    mla = m.layers[str(first_mla)].attn
    with torch.no_grad():  # make the logits large enough to clip
        mla.q_b_proj.weight.mul_(30.0)
    m(batch)
    before = mla.qk_max.clone()
    tau = float(before.median())
    cfg.optim.qk_clip_threshold = tau
    opt = build_optimizer(m, cfg, ParallelDims(), zero=0, log_table=False)
    out = opt.step(0.0)  # lr 0: only the clip changes weights
    assert out["qk_clipped_heads"] >= 1
    m(batch)  # the first MLA layer sees the same input again
    torch.testing.assert_close(mla.qk_max, torch.minimum(before, torch.tensor(tau)), rtol=1e-4, atol=1e-5)
