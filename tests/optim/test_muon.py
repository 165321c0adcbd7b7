"""Muon / Per-Head Muon / AdamW steps against a plain reference written here; parameter grouping."""
import copy
import math

import pytest
import torch
from torch import nn

from k3train.config import OptimConfig
from k3train.optim import build_optimizer, mark_per_head
from k3train.optim.param_groups import build_param_infos
from parallel.dims import ParallelDims

from optim_testing_models import TinyNet, tiny_batch


# ---------------------------------------------------------------------------------------------------------------
# the plain reference: one matrix at a time, float64 Newton-Schulz, torch.optim.AdamW for the rest
def ref_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def ref_muon_step(w, g, m, lr, wd, mu, nesterov, blocks):
    """``blocks``: list of row-slices of a 2-D ``w`` (or ``None`` entries meaning 'index i of a 3-D w')."""
    m.mul_(mu).add_(g)
    d = g + mu * m if nesterov else m.clone()
    upd = torch.zeros_like(w, dtype=torch.float64)
    for b in blocks:
        blk = d[b]
        upd[b] = ref_ns(blk) * 0.2 * math.sqrt(max(blk.shape))
    w.mul_(1 - lr * wd).sub_(lr * upd.float())


def muon_blocks(name, p, per_head):
    if p.ndim == 3:
        return [i for i in range(p.shape[0])]
    if per_head and name == "attn.q_proj.weight" or per_head and name in ("attn.k_proj.weight", "attn.v_proj.weight"):
        return [slice(h * 8, (h + 1) * 8) for h in range(2)]
    if per_head and name == "kv.weight":  # 2 heads x (3 k rows, 5 v rows)
        return [slice(h * 8 + o, h * 8 + o + s) for h in range(2) for o, s in ((0, 3), (3, 5))]
    return [slice(None)]


MUON = {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.o_proj.weight", "kv.weight",
        "mix.weight", "experts", "expert_out"}
ADAMW_DECAY = {"embed_tokens.weight", "lm_head.weight", "conv"}
ADAMW_NO_DECAY = {"mix.bias", "norm"}


def _cfg(**kw):
    base = dict(lr=0.05, weight_decay=0.1, qk_clip_threshold=0.0)
    return OptimConfig(**{**base, **kw})


def test_grouping_rule():
    infos = {i.fqn: i for i in build_param_infos([TinyNet()], _cfg())}
    assert set(infos) == MUON | ADAMW_DECAY | ADAMW_NO_DECAY  # frozen param and buffer excluded
    for n in MUON:
        assert infos[n].kind == "muon", n
    for n in ADAMW_DECAY | ADAMW_NO_DECAY:
        assert infos[n].kind == "adamw" and infos[n].decay == (n in ADAMW_DECAY), n
    assert infos["attn.q_proj.weight"].layout == "per_head" and infos["experts"].layout == "stacked"
    assert infos["kv.weight"].segments == (3, 5)
    off = {i.fqn: i for i in build_param_infos([TinyNet()], _cfg(per_head_muon=False))}
    assert off["attn.q_proj.weight"].layout == "matrix"
    assert all(i.kind == "adamw" for i in build_param_infos([TinyNet()], _cfg(name="adamw")))
    forced = {i.fqn: i for i in build_param_infos([TinyNet()], _cfg(adamw_param_patterns=["mix"]))}
    assert forced["mix.weight"].kind == "adamw" and forced["embed_tokens.weight"].kind == "muon"


def test_shared_module_params_counted_once():
    net = TinyNet()
    opt = build_optimizer([net, net.attn, nn.ModuleDict({"embed_tokens": net.embed_tokens})], _cfg(),
                          ParallelDims(), zero=0)
    assert len(opt.infos) == len(MUON | ADAMW_DECAY | ADAMW_NO_DECAY)
    assert "tensors" in opt.describe() and "muon/per_head" in opt.describe()


def test_mark_per_head_validation():
    w = nn.Parameter(torch.zeros(12, 4))
    with pytest.raises(ValueError, match="divisible"):
        mark_per_head(w, 5)
    with pytest.raises(ValueError, match="segments"):
        mark_per_head(w, 2, segments=(2, 2))
    with pytest.raises(ValueError, match="2-D"):
        mark_per_head(nn.Parameter(torch.zeros(12)), 2)
    assert mark_per_head(w, 3)._k3_head_split == (3, 4)


@pytest.mark.parametrize("nesterov,per_head", [(True, True), (False, True), (True, False)])
def test_step_matches_plain_reference(nesterov, per_head):
    cfg = _cfg(muon_nesterov=nesterov, per_head_muon=per_head)
    net = TinyNet(seed=3)
    ref = copy.deepcopy(net)
    opt = build_optimizer(net, cfg, ParallelDims(), zero=0, grad_clip=0.0)
    rp = dict(ref.named_parameters())
    adamw = torch.optim.AdamW([{"params": [rp[n] for n in sorted(ADAMW_DECAY)], "weight_decay": cfg.weight_decay},
                               {"params": [rp[n] for n in sorted(ADAMW_NO_DECAY)], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    moms = {n: torch.zeros_like(rp[n]) for n in MUON}
    for step in range(3):
        lr = cfg.lr * (1.0 - 0.2 * step)
        net.loss_sum(*tiny_batch(step)).backward()
        for n, p in net.named_parameters():  # identical gradients: the test isolates the update rule
            if p.requires_grad:
                rp[n].grad = p.grad.clone()
        out = opt.step(lr)
        opt.zero_grad()
        with torch.no_grad():
            for n in MUON:
                ref_muon_step(rp[n].data, rp[n].grad, moms[n], lr, cfg.weight_decay, cfg.muon_momentum, nesterov,
                              muon_blocks(n, rp[n], per_head))
            for g in adamw.param_groups:
                g["lr"] = lr
            adamw.step()
        assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
        for n, p in net.named_parameters():
            torch.testing.assert_close(p.data, rp[n].data, atol=2e-6, rtol=1e-5, msg=f"{n} at step {step}")
    # the momentum buffers are exactly the reference's
    sd = opt.state_dict()
    for n in MUON:
        torch.testing.assert_close(sd[f"{n}.momentum_buffer"], moms[n], atol=1e-6, rtol=1e-6)


def _one_step_update(heads: int, per_head: bool) -> torch.Tensor:
    lin = nn.Linear(16, heads * (24 // heads), bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(0)))
    mark_per_head(lin.weight, heads)
    before = lin.weight.detach().clone()
    g = torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(1))
    # make one head's gradient much larger: whole-matrix Muon lets it dominate, per-head does not
    g[: 24 // heads] *= 1000.0
    lin.weight.grad = g
    opt = build_optimizer(lin, _cfg(per_head_muon=per_head, weight_decay=0.0), ParallelDims(), zero=0)
    opt.step(1.0)
    return before - lin.weight.detach()


def test_per_head_equals_whole_with_one_head_and_differs_otherwise():
    torch.testing.assert_close(_one_step_update(1, True), _one_step_update(1, False), atol=0, rtol=0)
    ph, whole = _one_step_update(4, True), _one_step_update(4, False)
    assert (ph - whole).abs().max() > 1e-2
    # per head, every head's update has the Moonlight RMS ~0.2 whatever its gradient scale
    rms = ph.view(4, 6, 16).pow(2).mean((1, 2)).sqrt()
    assert ((rms > 0.12) & (rms < 0.25)).all(), rms
    rms_whole = whole.view(4, 6, 16).pow(2).mean((1, 2)).sqrt()
    # whole-matrix: the big-gradient head takes the leading singular directions; the others' directions have
    # tiny singular values that 5 NS steps lift only partly, so those heads get a much smaller update
    assert rms_whole[0] > 3 * rms_whole[1:].max(), rms_whole


def test_bf16_params_keep_fp32_master():
    net = TinyNet(seed=5, dtype=torch.bfloat16)
    opt = build_optimizer(net, _cfg(), ParallelDims(), zero=0)
    n_master = sum(1 for k in opt.state_dict() if k.endswith(".master"))
    assert n_master == len(opt.infos)
    fp32_bytes = sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
    assert opt.state_bytes() >= fp32_bytes * 2  # state + master
    net.loss_sum(*tiny_batch(0)).backward()
    opt.step(0.01)
    sd = opt.state_dict()
    for n, p in net.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(p.data, sd[f"{n}.master"].to(torch.bfloat16), atol=0, rtol=0)
            assert not torch.equal(sd[f"{n}.master"], sd[f"{n}.master"].bfloat16().float()) or p.numel() < 8
