"""Device table of the planner: published GPU figures, ``cpu`` calibrated by microbenchmarks on this machine
(:mod:`k3train.planning.calibration.cpu_device`), and a cluster of your own (a device file, the cluster flags:
:mod:`k3train.planning.calibration.cluster`).

GPUs (per GPU; published dense figures, K3-SPEC "Facts for the planning tools"): bf16 dense peak FLOP/s, HBM
bytes and bandwidth, NVLink bandwidth (the published figure is bidirectional: one direction, 450 GB/s on Hopper,
900 GB/s on Blackwell, is what a transfer moves), the scale-out NIC per GPU (DGX / HGX H100, H200, B200 and GB200:
one 400 Gb/s ConnectX-7 per GPU = 50 GB/s; GB300: 800 Gb/s ConnectX-8), 8 GPUs a node on one NVLink switch; GB200 /
GB300 NVL72: 4 GPUs a compute tray, 72 on one NVLink fabric (a job of a power of two GPUs usually takes 64 of a
rack: ``--nvlink-domain 64``).

Achievable fractions of those peaks the step-time model uses:

* ``compute_eff`` 0.39 of the bf16 peak on training compute: what published BF16 MoE training reaches on H100
  (docs/planner.md "Against published runs", ``benchmarks/bench_published.py --implied-eff`` recomputes it). Each of
  NeMo AutoModel's five H100 runs (DeepSeek-V3 on 256 and 1,024 GPUs, Kimi K2, Qwen3-30B-A3B on one node,
  gpt-oss-120b), predicted by this model at its layout with its dispatch's bytes (DeepEP: one row per token and
  destination node under the benchmark's balanced gate), needs 0.35 to 0.44 for its published step, median 0.39;
  not used for it, Megatron-Core's Qwen3-235B run with NCCL's all-to-all needs 0.41, its DeepEP runs across nodes
  0.40, Megatron-Bridge's GB200 runs 0.37 and 0.39. Large GEMMs alone reach 0.6-0.7; a MoE step is grouped GEMMs
  of a few thousand rows each, attention, and memory-bound norms, activations and permutations. Blackwell: the
  same fraction (the GB200 runs agree with it).
* ``link_eff`` 0.8 of the link bandwidth for collectives and p2p; ``hbm_eff`` 0.8 for memory-bound updates (AdamW,
  Muon's elementwise part).

No overlap of communication with compute is assumed: what is hidden comes from the schedule the runtime executes
(the dispatcher's own order, F/B pairing, the per-chunk gradient reduction), never a factor. Every field is
overridable (``--device-field peak_flops=1.2e15``).
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any

from k3train.config import ConfigError
from k3train.planning.calibration.cluster import apply_cluster, is_device_file, read_device_file
from k3train.planning.step_time.device import GB, Device
from k3train.reporting.device_peaks import BF16_DENSE_PEAK

GPU_COMPUTE_EFF = 0.39  # module docstring


def _gpu(name: str, hbm_gb: float, hbm_bw: float, nvlink_gb_s: float, nic_gb_s: float, per_node: int = 8,
         domain: int = 0) -> Device:
    return Device(name, peak_flops=BF16_DENSE_PEAK[name], hbm_bytes=hbm_gb * GB, hbm_bw=hbm_bw,
                  nvlink_bw=nvlink_gb_s * GB, internode_bw=nic_gb_s * GB, gpus_per_node=per_node,
                  nvlink_domain=domain, compute_eff=GPU_COMPUTE_EFF)


PUBLISHED = {
    "h100": _gpu("h100", 80, 3.35e12, 450, 50),
    "h200": _gpu("h200", 141, 4.8e12, 450, 50),
    "b200": _gpu("b200", 180, 8e12, 900, 50),
    "gb200": _gpu("gb200", 186, 8e12, 900, 50, per_node=4, domain=72),
    "gb300": _gpu("gb300", 288, 8e12, 900, 100, per_node=4, domain=72),
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


def check_device(name: str, field_items: list[str], cluster: dict[str, Any] | None = None) -> Device:
    """The device ``--device`` names (a device of the table or a device file, ``*.yaml``) with the cluster flags'
    values (``cluster``, by device-file key: :func:`~k3train.planning.calibration.cluster.cluster_flags`) and then
    ``field_items`` (``--device-field``) applied; every one checked (ConfigError), nothing measured (``cpu``: the
    table's first GPU stands in, to check the fields). Loads no torch: the command line is checked first."""
    if is_device_file(name):
        dev = read_device_file(name, PUBLISHED)
    elif name.lower() not in DEVICE_NAMES:
        raise ConfigError(f"--device {name!r}: expected one of {', '.join(DEVICE_NAMES)}, or a device file (.yaml)")
    elif name.lower() == "cpu" and cluster:
        raise ConfigError(f"--device cpu: the cluster flags ({', '.join(cluster)}) describe GPUs; this host's ranks "
                          f"are measured")
    else:
        dev = PUBLISHED.get(name.lower(), PUBLISHED["h100"])
    return apply_fields(apply_cluster(dev, cluster or {}), field_items)


def get_device(name: str, world_size: int, field_items: list[str], calibration: str | None = None,
               log: Any = print, cluster: dict[str, Any] | None = None) -> Device:
    """The device of :func:`check_device`; ``cpu``: this host, calibrated for ``world_size`` ranks (cached)."""
    dev = check_device(name, field_items, cluster)
    if name.lower() != "cpu":
        return dev
    # lazy: torch (the cpu's microbenchmarks) is not loaded before the command line is checked
    from k3train.planning.calibration.cpu_device import calibrate_cpu
    from k3train.planning.calibration.host import cache_path  # lazy: as above

    return apply_fields(calibrate_cpu(world_size, cache_path(calibration), log), field_items)


def device_json(dev: Device) -> dict[str, Any]:
    return asdict(dev)
