"""Kernel selection per op (k3train/model/kernels.py): which backend for which device, dtype, installation and
setting -- pure logic, tested on CPU with explicit ``Installed`` / ``Target`` values; plus the config validator's
one-line errors, the start-up application to a built model, the FlexAttention MLA op's forward on CPU and the
published GPU peaks."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from k3train.config import ConfigError, load_config
from k3train.model.kernels import (Installed, KernelChoice, KernelSettingError, Target, apply_kernels, choose_kernels,
                                  describe_kernels, kernel_settings, target_for)

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
ALL = Installed(fla=True, triton=True, grouped_mm=True, flex_attention=True, mla_blockwise=True, mla_op_hook=True)
NONE = Installed()
CPU = Target()
H200_BF16 = Target(device_type="cuda", dtype="bfloat16", capability=(9, 0))


def pick(settings: dict[str, str], target: Target, inst: Installed) -> dict[str, str]:
    return {op: c.backend for op, c in choose_kernels(settings, target, inst).items()}


def test_cpu_always_runs_the_torch_ops_even_with_everything_installed():
    assert pick({}, CPU, ALL) == {"kda": "torch", "mla": "blockwise", "experts": "grouped_mm"}
    assert pick({}, Target(dtype="bfloat16"), ALL)["kda"] == "torch"
    assert pick({}, CPU, NONE) == {"kda": "torch", "mla": "dense", "experts": "padded_bmm"}


def test_cuda_bf16_picks_the_field_kernels_when_installed():
    assert pick({}, H200_BF16, ALL) == {"kda": "fla", "mla": "flex", "experts": "grouped_mm"}
    lines = describe_kernels(choose_kernels({}, H200_BF16, ALL))
    assert lines[0] == "kda: fla chunk_kda (triton)"
    no_fla = choose_kernels({}, H200_BF16, Installed(grouped_mm=True))
    assert no_fla["kda"].backend == "torch" and "not both installed" in no_fla["kda"].reason
    assert no_fla["kda"].line().startswith("kda: k3train chunked (torch)")
    # an MLA layer without the attention_op hook can only be its dense self, and the selection says why
    unwired = choose_kernels({}, H200_BF16, Installed(fla=True, triton=True, flex_attention=True))["mla"]
    assert unwired.backend == "dense" and "attention op" in unwired.reason


def test_cuda_fp32_and_old_gpus_keep_exact_or_supported_paths():
    fp32 = Target(device_type="cuda", dtype="float32", capability=(9, 0))
    assert pick({}, fp32, ALL) == {"kda": "torch", "mla": "flex", "experts": "padded_bmm"}
    a100 = Target(device_type="cuda", dtype="bfloat16", capability=(8, 0))
    c = choose_kernels({}, a100, ALL)["experts"]
    assert c.backend == "padded_bmm" and "sm90" in c.reason and "sm80" in c.reason
    # forcing fla in fp32 on CUDA is allowed (a user's choice), forcing grouped_mm on sm80 is not
    assert pick({"kda": "fla"}, fp32, ALL)["kda"] == "fla"
    with pytest.raises(KernelSettingError, match=r"^train\.experts_kernel: 'grouped_mm' cannot run here.*sm90"):
        choose_kernels({"experts": "grouped_mm"}, a100, ALL)


def test_kcp_keeps_the_torch_kda_op_and_says_why():
    kcp = Target(device_type="cuda", dtype="bfloat16", capability=(9, 0), cp=4)
    c = choose_kernels({}, kcp, ALL)["kda"]
    assert c.backend == "torch" and "under KCP" in c.label and "(M, S~)" in c.reason
    with pytest.raises(KernelSettingError, match=r"^train\.kda_kernel: 'fla' cannot run here: KDA context"):
        choose_kernels({"kda": "fla"}, kcp, ALL)
    big = Target(device_type="cuda", dtype="bfloat16", capability=(9, 0), kda_head_dim=512)
    assert choose_kernels({}, big, ALL)["kda"].backend == "torch"


@pytest.mark.parametrize("settings, target, inst, match", [
    ({"kda": "fla"}, CPU, ALL, r"^train\.kda_kernel: 'fla' cannot run here: .*needs CUDA"),
    ({"kda": "fla"}, H200_BF16, NONE, r"^train\.kda_kernel: 'fla' cannot run here: .*not both installed"),
    ({"kda": "triton"}, CPU, ALL, r"^train\.kda_kernel: must be one of auto, torch, fla, got 'triton'"),
    ({"mla": "flex"}, CPU, ALL, r"^train\.mla_kernel: 'flex' cannot run here: .*needs CUDA"),
    ({"mla": "flex"}, H200_BF16, Installed(flex_attention=True, triton=True), r"^train\.mla_kernel: 'flex' is not wired"),
    ({"mla": "blockwise"}, CPU, Installed(mla_op_hook=True), r"^train\.mla_kernel: 'blockwise' needs k3train\.ops"),
    ({"experts": "grouped_mm"}, H200_BF16, NONE, r"^train\.experts_kernel: .*no torch\._grouped_mm"),
    ({"attn": "torch"}, CPU, ALL, r"^train\.attn_kernel: unknown op 'attn'"),
])
def test_bad_settings_raise_one_line_naming_the_key(settings, target, inst, match):
    with pytest.raises(KernelSettingError, match=match) as e:
        choose_kernels(settings, target, inst)
    assert "\n" not in str(e.value)


def test_forced_torch_paths_are_always_allowed():
    for target in (CPU, H200_BF16):
        got = pick({"kda": "torch", "mla": "dense", "experts": "loop"}, target, ALL)
        assert got == {"kda": "torch", "mla": "dense", "experts": "loop"}


def test_the_config_validator_reports_kernel_settings_with_their_origin():
    cfg = load_config(TINY, ["--train.kda_kernel=torch", "--train.experts_kernel=padded_bmm"])
    assert kernel_settings(cfg.train) == {"kda": "torch", "mla": "auto", "experts": "padded_bmm"}
    t = target_for(cfg, "cpu")
    assert (t.device_type, t.dtype, t.cp, t.kda_head_dim, t.kda_lower_bound) == ("cpu", "float32", 1, 16, -5.0)
    assert target_for(load_config(TINY, ["--model.kda_decay_form=softplus"]), "cpu").kda_lower_bound is None
    # a backend name is checked by the config validator (no torch needed) ...
    with pytest.raises(ConfigError, match=r"^train\.mla_kernel: must be one of auto, dense, blockwise, flex, got "
                                          r"'flash' \(from the command line: --train\.mla_kernel=flash\)$"):
        load_config(TINY, ["--train.mla_kernel=flash"])
    # ... whether a forced one can run here by the machine checks before training (a GPU run can still be planned
    # on a CPU machine: tools that only trace the model skip them)
    from k3train.preflight import check_devices

    fla = load_config(TINY, ["--train.kda_kernel=fla"])
    if not torch.cuda.is_available():  # here forcing fla can never run
        with pytest.raises(ConfigError, match=r"^train\.kda_kernel: 'fla' cannot run here: .*\(from the command "
                                              r"line: --train\.kda_kernel=fla\)$"):
            check_devices(fla)
    check_devices(load_config(TINY, ["--train.kda_kernel=torch", "--train.mla_kernel=dense"]))


def test_apply_kernels_points_the_built_layers_at_the_choice():
    from k3train.model.kda import KDALayer
    from k3train.model.model import K3Model
    from k3train.ops.kda_fla import fla_chunk_kda

    cfg = load_config(TINY)
    model = K3Model(cfg.model)
    from k3train.model.mla import MLA
    from k3train.ops.mla_dense import attention_core
    from k3train.ops.mla_flex import flex_attention_core

    choices = {"kda": KernelChoice("kda", "fla", "fla"), "mla": KernelChoice("mla", "dense", "dense"),
               "experts": KernelChoice("experts", "loop", "loop")}
    counts = apply_kernels([model], choices, cfg.model)
    kda_layers = [m for m in model.modules() if isinstance(m, KDALayer)]
    assert counts["kda"] == len(kda_layers) >= 6
    assert all(isinstance(m.kda_op, functools.partial) and m.kda_op.func is fla_chunk_kda
               and m.kda_op.keywords == {"g_lower_bound": -5.0} for m in kda_layers)
    dispatchers = [m.dispatcher for m in model.modules() if hasattr(m, "dispatcher")]
    assert counts["experts"] == len(dispatchers) > 0 and all(d.impl == "loop" for d in dispatchers)
    mlas = [m for m in model.modules() if isinstance(m, MLA)]
    assert counts["mla"] == len(mlas) > 0 and all(m.attention_op is attention_core for m in mlas)
    for backend, op in (("flex", flex_attention_core), ("blockwise", None)):
        apply_kernels([model], {**choices, "mla": KernelChoice("mla", backend, backend)}, cfg.model)
        assert all(m.attention_op is op for m in mlas)
    # the fla op refuses CPU tensors with one line before importing anything
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        fla_chunk_kda(x, x, x, x, torch.zeros(1, 4, 1))


def test_probe_finds_what_this_machine_has_without_importing_triton():
    had_triton = "triton" in sys.modules
    inst = Installed.probe()
    assert inst.grouped_mm == hasattr(torch, "_grouped_mm")
    assert inst.flex_attention
    if not had_triton:
        assert "triton" not in sys.modules


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_mla_forward_matches_the_dense_reference_on_cpu():
    """FlexAttention's unfused CPU path (forward only): the document + causal BlockMask and the per-head max logit
    equal the dense reference's (the CUDA kernel and gradients: tests/gpu/test_mla_flex.py)."""
    from k3train.ops.mla_dense import MaskInfo, attention_core, masked_logit_max
    from k3train.ops.mla_flex import flex_attention_with_max

    g = torch.Generator().manual_seed(0)
    B, H, T = 2, 2, 40
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 3 + [1] * 30 + [2] * 7])
    pos = torch.stack([torch.cat([torch.arange(15), torch.arange(25)]),
                       torch.cat([torch.arange(3), torch.arange(30), torch.arange(7)])])
    mi = MaskInfo(doc, pos, doc, pos)
    q, k = (torch.randn(B, H, T, 24, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, 16, generator=g)
    o, mx = flex_attention_with_max(q, k, v, mi, 24 ** -0.5)
    assert o.dtype == torch.float32 and o.shape == (B, H, T, 16)
    torch.testing.assert_close(o, attention_core(q, k, v, mi, 24 ** -0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mx, masked_logit_max(q, k, mi, 24 ** -0.5), atol=1e-5, rtol=1e-5)
    # a wrong mask would show: dropping the document condition changes the output
    leaky = MaskInfo(torch.zeros_like(doc), pos, torch.zeros_like(doc), pos)
    assert (flex_attention_with_max(q, k, v, leaky, 24 ** -0.5)[0] - o).abs().max() > 1e-2


def test_flex_fp32_tiles_fit_a_hopper_sm_and_training_dtypes_keep_inductors_choice():
    """On an H200 (torch 2.11) FlexAttention with fp32 inputs at K3's qk width 192 failed to compile: inductor's
    default 64 x 64 forward tile in 3 stages needs ~281 KiB of shared memory, an SM has 227 KiB. The options chosen
    instead hold the Q tile and, per stage, the K and V tiles within it; bf16 and narrow heads keep the default."""
    from k3train.ops.mla_flex import kernel_options

    def fwd_smem(opts, dqk=192, dv=128, size=4):
        return size * (opts["fwd_BLOCK_M"] * dqk + opts["fwd_num_stages"] * opts["fwd_BLOCK_N"] * (dqk + dv))

    assert fwd_smem({"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3}) > 227 * 1024  # the failing one
    opts = kernel_options(torch.float32, 192)
    assert opts is not None and fwd_smem(opts) <= 227 * 1024
    assert 128 % opts["fwd_BLOCK_M"] == 0 and 128 % opts["fwd_BLOCK_N"] == 0  # divide the BlockMask's 128 blocks
    assert kernel_options(torch.bfloat16, 192) is None and kernel_options(torch.float32, 128) is None


def test_published_bf16_peaks_by_cuda_device_name():
    from k3train.reporting.device_peaks import published_bf16_peak

    assert published_bf16_peak("NVIDIA H200") == ("h200", 989e12)
    assert published_bf16_peak("NVIDIA H100 80GB HBM3") == ("h100", 989e12)
    assert published_bf16_peak("NVIDIA H100 PCIe") == ("h100 pcie", 756e12)
    assert published_bf16_peak("NVIDIA B200") == ("b200", 2250e12)
    assert published_bf16_peak("NVIDIA GB200") == ("gb200", 2500e12)  # not B200, whose name it contains
    assert published_bf16_peak("NVIDIA A100-SXM4-80GB") is None


def test_mfu_denominator_on_a_known_gpu_is_its_published_peak(monkeypatch):
    from k3train.reporting.metrics import resolve_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    flops, source = resolve_peak_flops(0.0, torch.device("cuda", 0))
    assert flops == 989e12 and "published dense bf16 peak of H200" in source
    assert resolve_peak_flops(5e14, torch.device("cuda", 0)) == (5e14, "logging.peak_flops")
