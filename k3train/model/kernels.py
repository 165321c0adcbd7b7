"""One kernel choice per op (KDA, MLA attention, routed experts): by device, dtype, what is installed, and the
``train.<op>_kernel`` settings -- made once at start-up, logged, and applied to the built model.

The pure-torch path of every op is always there and is what CPU runs. On CUDA:

========  =====================================================  ==========================================
op        backends (``train.<op>_kernel``)                       ``auto`` picks
========  =====================================================  ==========================================
kda       ``torch`` (k3train chunked), ``fla`` (fla chunk_kda)    fla on CUDA + bf16 when fla and triton are
                                                                 installed and KCP is off; else torch
mla       ``dense`` (reference), ``blockwise`` (torch, long       flex on CUDA (FlexAttention and triton
          context), ``flex`` (FlexAttention, document mask)      present); else blockwise if present,
                                                                 else dense
experts   ``grouped_mm`` (torch._grouped_mm), ``padded_bmm``,     grouped_mm where torch has it (CUDA: bf16,
          ``loop`` (per-expert reference)                        sm90+), else padded_bmm
========  =====================================================  ==========================================

Under KDA context parallelism (``parallel.cp > 1``) the KCP pass needs every segment's transition and local state
``(M, S~)`` (kcp/kda_cp.py); fla's ``chunk_kda`` returns outputs and final states only, so KCP keeps the torch op
and the start-up log says so.

Selection (:func:`choose_kernels`) is a pure function of its arguments: what is installed is an
:class:`Installed` value (``Installed.probe()`` asks ``importlib.util.find_spec`` -- triton is never imported on a
CPU machine), the device a :class:`Target`; tests pass both explicitly.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from k3train.config.kernels import BACKENDS, OPS, check_kernel_names, kernel_settings
from k3train.model.kda import KDALayer
from k3train.model.mla import MLA
from k3train.ops.mla_dense import attention_core

__all__ = ["OPS", "BACKENDS", "Installed", "Target", "KernelChoice", "KernelSettingError", "choose_kernels",
           "kernel_settings", "target_for", "check_kernel_names", "check_kernel_settings", "apply_kernels",
           "describe_kernels"]

FLA_MAX_HEAD_DIM = 256  # fla's chunk_kda asserts K <= 256


class KernelSettingError(ValueError):
    """A ``train.<op>_kernel`` setting that cannot run here; ``key`` names the setting."""

    def __init__(self, key: str, msg: str) -> None:
        super().__init__(f"{key}: {msg}")
        self.key, self.msg = key, msg


@dataclass(frozen=True)
class Installed:
    """What this process could use. ``mla_op_hook``: ``k3train.model.mla.MLA`` has the ``attention_op`` attribute
    (None: the blockwise path; else an op with ``attention_core``'s signature) that :func:`apply_kernels` sets."""

    fla: bool = False
    triton: bool = False
    grouped_mm: bool = False
    flex_attention: bool = False
    mla_blockwise: bool = False
    mla_op_hook: bool = False

    @classmethod
    def probe(cls) -> "Installed":
        """Look, without importing fla or triton (importing triton on a CPU machine is slow and may fail)."""
        def has(name: str) -> bool:
            try:
                return importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):  # a parent package missing, or a broken ``__spec__``
                return False



        return cls(fla=has("fla"), triton=has("triton"), grouped_mm=hasattr(torch, "_grouped_mm"),
                   flex_attention=has("torch.nn.attention.flex_attention"),
                   mla_blockwise=has("k3train.ops.mla_blockwise"), mla_op_hook=hasattr(MLA, "attention_op"))


@dataclass(frozen=True)
class Target:
    """Where the run computes: ``device_type`` ``'cpu'``/``'cuda'``, activation ``dtype`` (``'float32'`` /
    ``'bfloat16'``, the config's ``train.dtype``), CUDA compute ``capability`` (None on CPU), KCP degree ``cp``,
    and the model's KDA head dim and gate (``kda_lower_bound``: the gate's guaranteed lower bound, or None)."""

    device_type: str = "cpu"
    dtype: str = "float32"
    capability: tuple[int, int] | None = None
    cp: int = 1
    kda_head_dim: int = 128
    kda_lower_bound: float | None = -5.0


@dataclass(frozen=True)
class KernelChoice:
    """``backend`` is one of ``BACKENDS[op]`` (never ``auto``); ``label`` is what the start-up log prints."""

    op: str
    backend: str
    label: str
    reason: str = ""

    def line(self) -> str:
        return f"{self.op}: {self.label}" + (f" -- {self.reason}" if self.reason else "")


_LABELS = {
    ("kda", "torch"): "k3train chunked (torch)",
    ("kda", "fla"): "fla chunk_kda (triton)",
    ("mla", "dense"): "dense reference (torch sdpa, fp32)",
    ("mla", "blockwise"): "k3train blockwise (torch)",
    ("mla", "flex"): "FlexAttention, document BlockMask (triton)",
    ("experts", "grouped_mm"): "torch._grouped_mm (padded bmm for rows not 16-byte aligned)",
    ("experts", "padded_bmm"): "padded bmm (torch)",
    ("experts", "loop"): "per-expert loop reference (torch)",
}


def target_for(cfg: Any, device: torch.device | str | None = None) -> Target:
    """The :class:`Target` of a run: ``device`` (the resolved one) or else ``train.device`` (``auto``: CUDA when
    available)."""
    if device is None:
        want = cfg.train.device
        device = "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"
    dev = torch.device(device)
    cap = None
    if dev.type == "cuda" and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability(dev if dev.index is not None else None))
    m = cfg.model
    bound = float(m.gate_lower_bound) if m.kda_decay_form == "lower_bounded" else None
    return Target(device_type=dev.type, dtype=cfg.train.dtype, capability=cap, cp=int(cfg.parallel.cp),
                  kda_head_dim=int(m.kda_head_dim), kda_lower_bound=bound)


# ----------------------------------------------------------------------------------------------------------------
# Selection (pure)
# ----------------------------------------------------------------------------------------------------------------
def _kda(want: str, t: Target, inst: Installed) -> KernelChoice:
    key = "train.kda_kernel"
    why_not = None
    if t.device_type != "cuda":
        why_not = f"fla's chunk_kda is a Triton kernel and needs CUDA (device is {t.device_type})"
    elif not (inst.fla and inst.triton):
        why_not = "flash-linear-attention (package 'fla') and triton are not both installed (pip install k3train[gpu])"
    elif t.cp > 1:
        why_not = (f"KDA context parallelism (parallel.cp={t.cp}) needs each segment's transition and local state "
                   "(M, S~), which fla's chunk_kda does not return")
    elif t.kda_head_dim > FLA_MAX_HEAD_DIM:
        why_not = f"fla's chunk_kda supports head dims <= {FLA_MAX_HEAD_DIM}, model.kda_head_dim={t.kda_head_dim}"
    if want == "fla":
        if why_not:
            raise KernelSettingError(key, f"'fla' cannot run here: {why_not}; use 'auto' or 'torch'")
        return KernelChoice("kda", "fla", _LABELS["kda", "fla"], "forced by train.kda_kernel")
    if want == "torch":
        return KernelChoice("kda", "torch", _LABELS["kda", "torch"], "forced by train.kda_kernel")
    if why_not is None and t.dtype != "bfloat16":
        why_not = "fp32 training keeps the exact torch op (set train.kda_kernel=fla to use fla's kernel in fp32)"
    if why_not is None:
        return KernelChoice("kda", "fla", _LABELS["kda", "fla"])
    if t.cp > 1:
        return KernelChoice("kda", "torch", "k3train chunked (torch) under KCP", why_not)
    return KernelChoice("kda", "torch", _LABELS["kda", "torch"], why_not if t.device_type == "cuda" else "")


def _mla(want: str, t: Target, inst: Installed) -> KernelChoice:
    key = "train.mla_kernel"
    if want in ("blockwise", "flex") and not inst.mla_op_hook:
        raise KernelSettingError(key, f"{want!r} is not wired into k3train/model/mla.py (MLA has no "
                                      "attention_op); use 'auto' or 'dense'")
    if want == "blockwise" and not inst.mla_blockwise:
        raise KernelSettingError(key, "'blockwise' needs k3train.ops.mla_blockwise, which is not present")
    flex_why_not = None
    if t.device_type != "cuda":
        flex_why_not = f"FlexAttention's fused kernel needs CUDA (device is {t.device_type})"
    elif not (inst.flex_attention and inst.triton):
        flex_why_not = "torch.nn.attention.flex_attention or triton is not available"
    if want == "flex":
        if flex_why_not:
            raise KernelSettingError(key, f"'flex' cannot run here: {flex_why_not}; use 'auto', 'dense' or "
                                          "'blockwise'")
        return KernelChoice("mla", "flex", _LABELS["mla", "flex"], "forced by train.mla_kernel")
    if want in ("dense", "blockwise"):
        return KernelChoice("mla", want, _LABELS["mla", want], "forced by train.mla_kernel")
    if not inst.mla_op_hook:
        return KernelChoice("mla", "dense", _LABELS["mla", "dense"],
                            "k3train/model/mla.py does not take an attention op" if t.device_type == "cuda"
                            else "")
    if flex_why_not is None:
        return KernelChoice("mla", "flex", _LABELS["mla", "flex"])
    if inst.mla_blockwise:
        return KernelChoice("mla", "blockwise", _LABELS["mla", "blockwise"])
    return KernelChoice("mla", "dense", _LABELS["mla", "dense"])


def _experts(want: str, t: Target, inst: Installed) -> KernelChoice:
    key = "train.experts_kernel"
    why_not = None
    if not inst.grouped_mm:
        why_not = "this torch has no torch._grouped_mm"
    elif t.device_type == "cuda" and t.dtype != "bfloat16":
        why_not = "torch._grouped_mm on CUDA is bf16-only (train.dtype is float32)"
    elif t.device_type == "cuda" and (t.capability or (0, 0)) < (9, 0):
        why_not = f"torch._grouped_mm on CUDA needs sm90+ (this GPU is sm{''.join(map(str, t.capability or ()))})"
    elif t.device_type not in ("cpu", "cuda"):
        why_not = f"torch._grouped_mm has no {t.device_type} kernel"
    if want == "grouped_mm":
        if why_not:
            raise KernelSettingError(key, f"'grouped_mm' cannot run here: {why_not}; use 'auto' or 'padded_bmm'")
        return KernelChoice("experts", "grouped_mm", _LABELS["experts", "grouped_mm"], "forced by train.experts_kernel")
    if want in ("padded_bmm", "loop"):
        return KernelChoice("experts", want, _LABELS["experts", want], "forced by train.experts_kernel")
    if why_not is None:
        return KernelChoice("experts", "grouped_mm", _LABELS["experts", "grouped_mm"])
    return KernelChoice("experts", "padded_bmm", _LABELS["experts", "padded_bmm"], why_not)


_CHOOSERS = {"kda": _kda, "mla": _mla, "experts": _experts}


def choose_kernels(settings: dict[str, str], target: Target, installed: Installed) -> dict[str, KernelChoice]:
    """The backend of every op in :data:`OPS`. ``settings``: ``{op: 'auto' | backend}`` (missing ops: auto).
    Raises :class:`KernelSettingError` naming ``train.<op>_kernel`` for an unknown op or backend, or a forced
    backend that cannot run on ``target`` with ``installed``."""
    for op, want in settings.items():
        if op not in BACKENDS:
            raise KernelSettingError(f"train.{op}_kernel", f"unknown op {op!r} (known: {', '.join(OPS)})")
        if want not in BACKENDS[op]:
            raise KernelSettingError(f"train.{op}_kernel",
                                     f"must be one of {', '.join(BACKENDS[op])}, got {want!r}")
    return {op: _CHOOSERS[op](settings.get(op, "auto"), target, installed) for op in OPS}


# forced backends that run wherever k3train runs (no probing needed)
_ALWAYS = {"auto", "torch", "dense", "padded_bmm", "loop"}


def check_kernel_settings(cfg: Any) -> tuple[str, str] | None:
    """For the machine checks before training (k3train/preflight.py): ``(key, message)`` of the first forced
    backend that cannot run on this device with what is installed, else None. Tools that only trace the model
    (memory, plan) skip it, so a GPU run can be planned on a laptop."""
    bad = check_kernel_names(cfg.train)
    if bad is not None:
        return bad
    settings = kernel_settings(cfg.train)
    if set(settings.values()) <= _ALWAYS:
        return None
    try:
        choose_kernels(settings, target_for(cfg), Installed.probe())
    except KernelSettingError as e:
        return e.key, e.msg
    return None


def describe_kernels(choices: dict[str, KernelChoice]) -> list[str]:
    """One start-up log line per op, e.g. ``kda: fla chunk_kda (triton)``."""
    return [choices[op].line() for op in OPS if op in choices]


# ----------------------------------------------------------------------------------------------------------------
# Applying the choice to a built model
# ----------------------------------------------------------------------------------------------------------------
_EXPERTS_IMPL = {"grouped_mm": "auto", "padded_bmm": "padded_bmm", "loop": "loop"}  # 'auto': per-call alignment


def apply_kernels(modules: Iterable[nn.Module], choices: dict[str, KernelChoice], model_cfg: Any) -> dict[str, int]:
    """Point the built model's layers at the chosen kernels; returns how many layers each op changed.

    * kda = fla: every ``KDALayer.kda_op`` (the attribute the layer calls at ``cp == 1``) becomes
      :func:`k3train.ops.kda_fla.fla_chunk_kda` with the config's gate bound. KCP's op (``seq.cp.kda``) is not
      touched; the selection never picks fla under KCP.
    * experts: ``impl`` of every MoE layer's dispatcher (the local one or the EP one); ``grouped_mm`` maps to
      ``'auto'`` so rows that break ``torch._grouped_mm``'s 16-byte alignment still fall back per call.
    * mla: ``MLA.attention_op``: None for ``blockwise`` (the layer's own
      :func:`k3train.ops.mla_blockwise.blockwise_mla_attention`), :func:`k3train.ops.mla_dense.attention_core` for
      ``dense``, :func:`k3train.ops.mla_flex.flex_attention_core` for ``flex``.
    """
    counts = {op: 0 for op in OPS}
    kda_op = None
    if choices["kda"].backend == "fla":
        from k3train.ops.kda_fla import fla_chunk_kda  # lazy: imports fla, optional (CUDA + triton)

        bound = float(model_cfg.gate_lower_bound) if model_cfg.kda_decay_form == "lower_bounded" else None
        kda_op = functools.partial(fla_chunk_kda, g_lower_bound=bound)
    mla_backend = choices["mla"].backend
    if mla_backend == "flex":
        # lazy: FlexAttention loads torch's compiler stack; only when chosen
        from k3train.ops.mla_flex import flex_attention_core as mla_op
    elif mla_backend == "dense":
        mla_op = attention_core
    else:
        mla_op = None  # blockwise: the layer's default path
    impl = _EXPERTS_IMPL.get(choices["experts"].backend)
    for root in modules:
        for mod in root.modules():
            if kda_op is not None and isinstance(mod, KDALayer):
                mod.kda_op = kda_op
                counts["kda"] += 1
            elif isinstance(mod, MLA) and hasattr(mod, "attention_op"):
                mod.attention_op = mla_op
                counts["mla"] += 1
            disp = getattr(mod, "dispatcher", None)
            if impl is not None and disp is not None and hasattr(disp, "impl"):
                disp.impl = impl
                counts["experts"] += 1
    return counts
