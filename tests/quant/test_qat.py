"""MXFP4 QAT of the routed experts (k3train/quant/qat.py) against a reference that quantizes the weights explicitly
(a copy of the model whose expert weights are replaced by their MX fake-quant, run without QAT): outputs, input
gradients and the straight-through weight gradients equal; MXFP8 inputs against an explicit per-expert loop; the
trainer's wiring and the validator; pp2 x vpp2 (with activation recomputation) and dp2 x ep2 with MoonEP equal
one process, and differ from the run without QAT (so these checks can fail)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from k3train.config import ConfigError, load_config
from k3train.config.presets import tiny_model_config
from k3train.data.batch import Batch
from k3train.model.model import K3Model
from k3train.model.moe import GroupedExperts, LatentMoE, LocalDispatcher, grouped_expert_ffn
from k3train.model.ffn import situ_glu
from k3train.quant.mx import fake_quant
from k3train.quant.qat import (NO_QUANT, ExpertQuant, apply_qat, expert_weight_from_mxfp4,
                               expert_weight_to_mxfp4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # pipeline_harness

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _quantize_weight(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 of an expert weight ``[E, in, out]``, blocks of 32 along ``in`` (the matmul's reduction dim)."""
    return fake_quant(w.detach().transpose(-1, -2), "mxfp4").transpose(-1, -2).contiguous()


def _explicitly_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """The reference: a copy without QAT whose routed-expert weights ARE their MXFP4 values."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, GroupedExperts):
            m.quant = NO_QUANT
            for name in EXPERT_WEIGHTS:
                getattr(m, name).data = _quantize_weight(getattr(m, name))
    return ref


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _is_expert(name: str) -> bool:
    return ".experts." in name and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


# ---- one layer, one model -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,impl", [(torch.float64, "padded_bmm"), (torch.float64, "loop"),
                                        (torch.float32, "grouped_mm"), (torch.float32, "padded_bmm")])
def test_latent_moe_qat_equals_explicitly_quantized_weights(dtype, impl):
    torch.manual_seed(0)
    moe = LatentMoE(tiny_model_config()).to(dtype)
    moe.dispatcher = LocalDispatcher(impl)
    plain = copy.deepcopy(moe)
    assert apply_qat([moe], "mxfp4") == 1 and moe.experts.quant == ExpertQuant("mxfp4")
    ref = _explicitly_quantized(moe)
    x = torch.randn(24, moe.d, dtype=dtype)
    outs = {}
    for key, m in (("qat", moe), ("ref", ref), ("plain", plain)):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
        outs[key] = (y.detach(), xi.grad, _grads(m))
    (y, gx, gw), (y_ref, gx_ref, gw_ref), (y_plain, _, gw_plain) = outs["qat"], outs["ref"], outs["plain"]
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref)
    assert gw.keys() == gw_ref.keys()
    for name in gw:  # the experts' gradient is the reference's gradient w.r.t. the quantized weights (STE)
        assert torch.equal(gw[name], gw_ref[name]), name
    # the master weights stay unquantized, and QAT changes the numbers
    assert not torch.equal(moe.experts.w_gate, ref.experts.w_gate)
    assert (y - y_plain).abs().max() > 1e-2 * y_plain.abs().max()
    g_down, g_down_plain = gw["experts.w_down"], gw_plain["experts.w_down"]
    assert (g_down - g_down_plain).abs().max() > 1e-2 * g_down_plain.abs().max()


@pytest.mark.parametrize("dtype,impl", [(torch.float64, "padded_bmm"), (torch.float64, "loop"),
                                        (torch.float32, "grouped_mm")])
def test_mxfp8_inputs_equal_an_explicit_per_expert_loop(dtype, impl):
    g = torch.Generator().manual_seed(1)
    E, L, F, N = 3, 64, 32, 20
    ws = [torch.randn(E, L, F, generator=g, dtype=dtype) / 8, torch.randn(E, L, F, generator=g, dtype=dtype) / 8,
          torch.randn(E, F, L, generator=g, dtype=dtype) / 6]
    x = torch.randn(N, L, generator=g, dtype=dtype) * 3
    offsets = torch.tensor([7, 7, N], dtype=torch.int32)  # expert 1 gets no rows
    gy = torch.randn(N, L, generator=g, dtype=dtype)

    xq, wq = x.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in ws]
    y = grouped_expert_ffn(xq, offsets, *wq, impl=impl, quant=ExpertQuant("mxfp4", "mxfp8"))
    y.backward(gy)

    def ste(t: torch.Tensor, fmt: str) -> torch.Tensor:  # the textbook straight-through form
        return t + (fake_quant(t.detach(), fmt) - t).detach()

    xr, wr = x.clone().requires_grad_(True), [w.clone().requires_grad_(True) for w in ws]
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        xe = ste(xr[start:end], "mxfp8")
        wg, wu, wd = (ste(w[e].transpose(0, 1), "mxfp4").transpose(0, 1) for w in wr)
        outs.append(ste(situ_glu(xe @ wg, xe @ wu), "mxfp8") @ wd)
        start = end
    y_ref = torch.cat(outs)
    y_ref.backward(gy)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(xq.grad, xr.grad, **tol)
    for a, b in zip(wq, wr):
        torch.testing.assert_close(a.grad, b.grad, **tol)
    y_w4 = grouped_expert_ffn(x, offsets, *ws, impl=impl, quant=ExpertQuant("mxfp4"))
    assert (y.detach() - y_w4).abs().max() > 1e-3 * y_w4.abs().max()  # the inputs were quantized


def _batch(seed: int, vocab: int, T: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, vocab, (1, T + 1), generator=g)
    s[:, 5] = 1
    return Batch.from_samples(s, eos_id=1)


def _loss(model: K3Model, batch: Batch, n_tokens: float) -> torch.Tensor:
    out = model(batch)
    return out["lm_loss_sum"] / n_tokens + 0.3 * out["mtp_loss_sum"] / n_tokens


def test_k3model_qat_equals_explicitly_quantized_weights():
    cfg = tiny_model_config()
    model = K3Model(cfg)
    model.init_weights(7)
    assert apply_qat([model], "mxfp4") == cfg.num_hidden_layers - cfg.first_k_dense_replace + 1  # + the MTP layer's
    ref = _explicitly_quantized(model)
    b = _batch(0, cfg.vocab_size)
    loss, loss_ref = _loss(model, b, 16.0), _loss(ref, b, 16.0)
    loss.backward()
    loss_ref.backward()
    assert torch.equal(loss, loss_ref)
    g, g_ref = _grads(model), _grads(ref)
    assert g.keys() == g_ref.keys() and any(_is_expert(n) for n in g)
    for name in g:
        assert torch.equal(g[name], g_ref[name]), name


def test_mxfp4_export_dequantizes_to_the_qat_forward_bit_for_bit():
    """The served weights (packed E2M1 + E8M0, per expert [out, in]) reproduce what QAT trained with."""
    cfg = tiny_model_config()
    model = K3Model(cfg)
    model.init_weights(3)
    apply_qat([model], "mxfp4")
    served = copy.deepcopy(model)
    for m in served.modules():
        if isinstance(m, GroupedExperts):
            m.quant = NO_QUANT
            for name in EXPERT_WEIGHTS:
                w = getattr(m, name)
                packed, scales = expert_weight_to_mxfp4(w)
                assert packed.shape == (w.shape[0], w.shape[2], w.shape[1] // 2)
                assert scales.shape == (w.shape[0], w.shape[2], w.shape[1] // 32)
                w.data = expert_weight_from_mxfp4(packed, scales, w.dtype)
    b = _batch(1, cfg.vocab_size)
    with torch.no_grad():
        a, s = model(b), served(b)
    assert torch.equal(a["lm_loss_sum"], s["lm_loss_sum"]) and torch.equal(a["mtp_loss_sum"], s["mtp_loss_sum"])


# ---- configuration and wiring ---------------------------------------------------------------------------------
def test_validator_rejects_qat_on_widths_that_are_not_multiples_of_32():
    assert load_config(TINY, ["--train.qat=mxfp4", "--train.qat_activations=mxfp8"]).train.qat == "mxfp4"
    cases = [(["--train.qat=mxfp4", "--model.moe_intermediate_size=48"], ["train.qat", "moe_intermediate_size=48"]),
             (["--train.qat=mxfp4", "--model.routed_expert_hidden_size=40"],
              ["train.qat", "routed_expert_hidden_size=40"]),
             (["--train.qat=int4"], ["train.qat", "'int4'"]),
             (["--train.qat_activations=mxfp8"], ["train.qat_activations", "train.qat=mxfp4"])]
    for over, words in cases:
        with pytest.raises(ConfigError) as e:
            load_config(TINY, over)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), (over, msg)
    load_config(TINY, ["--model.moe_intermediate_size=48"])  # without QAT any width is fine


def test_parallelize_applies_qat_to_every_routed_expert():
    from k3train.parallelize import parallelize
    from parallel.dims import ParallelDims

    cfg = load_config(TINY, ["--train.qat=mxfp4", "--train.qat_activations=mxfp8", "--train.device=cpu",
                             "--train.global_batch_size=2", "--train.micro_batch_size=1"], world_size=1)
    pm = parallelize(cfg, ParallelDims(world_size=1, rank=0), torch.device("cpu"))
    experts = [m for mod in pm.runner.modules for m in mod.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 8 and all(m.quant == ExpertQuant("mxfp4", "mxfp8") for m in experts)


# ---- parallel layouts -----------------------------------------------------------------------------------------
def test_pipeline_pp2_vpp2_with_recompute_equals_one_process():
    from k3train.config.presets import tiny_pipeline_config as tiny_cfg
    from pipeline_harness import assert_grads_match, full_model, in_process_pipeline, make_batches
    from parallel.pipeline import LossNorm
    from reference_step import single_process_step

    sizes = ["--model.routed_expert_hidden_size=32", "--model.moe_intermediate_size=32", "--train.qat=mxfp4"]
    cfg = tiny_cfg(pp=2, vpp=2, recompute=True, micro_batches=4, extra=sizes)
    batches = make_batches(cfg, 4)
    norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
    ref_model = full_model(cfg)
    plain_grads, _ = single_process_step(copy.deepcopy(ref_model), batches, norm)
    apply_qat([ref_model], "mxfp4")
    ref_grads, ref_stats = single_process_step(ref_model, batches, norm)

    def qat_model() -> K3Model:
        m = K3Model(cfg.model, cfg.vision)
        apply_qat([m], cfg.train.qat)
        return m

    runners, stats = in_process_pipeline(cfg, batches, norm=norm, model_factory=qat_model)
    assert sum(s["loss"] for s in stats) == pytest.approx(ref_stats["loss"], rel=1e-6)
    for run in runners:
        for mod in run.modules:
            assert_grads_match(mod, ref_grads)
    held = {n for run in runners for mod in run.modules for n, _ in mod.named_parameters()}
    assert held == set(ref_grads)  # every parameter checked (the tied embedding on two stages)
    diff = max((ref_grads[k] - plain_grads[k]).abs().max() / plain_grads[k].abs().max()
               for k in ref_grads if _is_expert(k))
    assert diff > 1e-2  # QAT moved the expert gradients far past the tolerance above


def _ep_body(rank: int, ws: int) -> None:
    from moonep import apply_expert_parallel, collect_moonep_metrics, param_reduce_group
    from parallel.dims import ParallelDims

    cfg = tiny_model_config()
    dims = ParallelDims(dp=ws, ep=ws, world_size=ws, rank=rank).build_groups()
    batches = [_batch(s, cfg.vocab_size) for s in range(ws)]
    n_tok = float(sum(b.loss_mask.sum() for b in batches))
    refs = {}
    for qat in ("none", "mxfp4"):
        ref = K3Model(cfg)
        ref.init_weights(7)
        apply_qat([ref], qat)
        total = sum(_loss(ref, b, n_tok) for b in batches)
        total.backward()
        refs[qat] = (total.detach(), dict(ref.named_parameters()))

    model = K3Model(cfg)
    apply_expert_parallel(model, dims, moonep=True)
    model.init_weights(7)
    apply_qat([model], "mxfp4")  # after sharding, as the trainer does
    loss = _loss(model, batches[rank], n_tok)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, refs["mxfp4"][0], atol=1e-5, rtol=1e-5)
    worst_plain = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        group = param_reduce_group(name, p, dims)
        if group is not None:
            dist.all_reduce(grad, group=group)
        want, plain = (refs[q][1][name].grad for q in ("mxfp4", "none"))
        if getattr(p, "_k3_expert_parallel", False):
            n = p.shape[0]
            want, plain = want[rank * n:(rank + 1) * n], plain[rank * n:(rank + 1) * n]
            worst_plain = max(worst_plain, float((plain - want).abs().max() / want.abs().max()))
        torch.testing.assert_close(grad, want if want is not None else torch.zeros_like(p), atol=1e-6, rtol=1e-4,
                                   msg=name)
    m = collect_moonep_metrics(model)
    assert m["moonep/replicas"] > 0  # replicas were computed with (and must be quantized like their owners)
    assert worst_plain > 1e-2  # without QAT the expert gradients are far from these


def test_dp2_ep2_moonep_qat_equals_one_process():
    run_distributed(_ep_body, 2)
