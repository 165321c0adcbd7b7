"""Device table of the planner: published GPU figures, and ``cpu`` calibrated by microbenchmarks on this machine
(:mod:`k3train.planning.calibration.cpu_device`).

GPUs (per GPU; published dense figures, K3-SPEC "Facts for the planning tools"): bf16 dense peak FLOP/s, HBM
bytes and bandwidth, NVLink bandwidth (the published figure is bidirectional: one direction, 450 GB/s on Hopper,
is what a ring step moves), the scale-out NIC per GPU (400 Gb/s = 50 GB/s), 8 GPUs per node. Stated achievable
efficiencies (fractions of those peaks that the planner assumes): ``compute_eff`` 0.55 of the bf16 peak for
model matmuls (large-GEMM throughput; the end-to-end MFU the plan reports is lower: bubble, communication and
optimizer come on top), ``link_eff`` 0.8 of the link bandwidth for collectives and p2p, ``hbm_eff`` 0.8 for
memory-bound updates (AdamW, Muon's elementwise part). No overlap of communication with compute is assumed: the
runtime issues every EP all-to-all in line, so the planner charges all of it (what is hidden must come from a
schedule the runtime executes, not a factor). Every field is overridable
(``--device-field peak_flops=1.2e15``).
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from k3train.config import ConfigError
from k3train.planning.calibration.cpu_device import calibrate_cpu
from k3train.planning.calibration.host import cache_path
from k3train.planning.step_time.device import GB, Device
from k3train.reporting.device_peaks import BF16_DENSE_PEAK

PUBLISHED = {
    "h100": Device("h100", peak_flops=BF16_DENSE_PEAK["h100"], hbm_bytes=80 * GB, hbm_bw=3.35e12, nvlink_bw=450 * GB,
                   internode_bw=50 * GB),
    "h200": Device("h200", peak_flops=BF16_DENSE_PEAK["h200"], hbm_bytes=141 * GB, hbm_bw=4.8e12, nvlink_bw=450 * GB,
                   internode_bw=50 * GB),
    "b200": Device("b200", peak_flops=BF16_DENSE_PEAK["b200"], hbm_bytes=180 * GB, hbm_bw=8e12, nvlink_bw=900 * GB,
                   internode_bw=100 * GB),
}


DEVICE_NAMES = ("cpu", *PUBLISHED)


def apply_fields(dev: Device, items: list[str]) -> Device:
    """``["peak_flops=1e15", ...]`` -> a copy with those fields set (ConfigError naming a bad one)."""
    kinds = {f.name: f.type for f in fields(Device) if f.name not in ("name", "calibration", "call_lat")}
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or k not in kinds:
            raise ConfigError(f"--device-field {it!r}: expected FIELD=VALUE with FIELD one of {', '.join(kinds)}")
        try:
            out[k] = int(float(v)) if kinds[k] in ("int", int) else float(v)
        except ValueError:
            raise ConfigError(f"--device-field {it!r}: {v!r} is not a number") from None
        if out[k] < 0 or (k in ("peak_flops", "hbm_bytes", "hbm_bw", "nvlink_bw", "internode_bw") and out[k] == 0):
            raise ConfigError(f"--device-field {it!r}: must be positive")
    return replace(dev, **out)


def get_device(name: str, world_size: int, field_items: list[str], calibration: str | None = None,
               log: Any = print) -> Device:
    name = name.lower()
    if name not in DEVICE_NAMES:
        raise ConfigError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}")
    apply_fields(PUBLISHED["h100"], field_items)  # bad fields are reported before any calibration
    dev = calibrate_cpu(world_size, cache_path(calibration), log) if name == "cpu" else PUBLISHED[name]
    return apply_fields(dev, field_items)


def device_json(dev: Device) -> dict[str, Any]:
    return asdict(dev)
