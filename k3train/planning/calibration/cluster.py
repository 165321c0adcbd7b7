"""Your cluster described: a device file (YAML) passed as ``--device FILE.yaml``, and the cluster flags of
``tools/plan.py`` (``--gpus-per-node``, ``--nvlink-domain``, ``--internode-gbit-s``) on top of any device. Every key
is checked here, before any work (one ``ConfigError`` naming the key and the file: one line, exit 2).

A device file, in the units its keys name (every key optional when ``base`` names a device of the table)::

    base: h100                # start from a device of the table (calibration/devices.py)
    name: h800                # what the plan prints
    bf16_tflops: 989          # dense bf16 peak per GPU
    memory_gb: 80             # device memory per GPU (10^9 bytes)
    hbm_tb_s: 3.35            # memory bandwidth per GPU
    nvlink_gb_s: 200          # NVLink per GPU, one direction (the bidirectional figure / 2)
    internode_gbit_s: 400     # the scale-out NIC(s) per GPU, Gb/s as NICs are sold
    gpus_per_node: 8
    nvlink_domain: 8          # GPUs one NVLink fabric joins: 8 on a DGX/HGX node, 72 on an NVL72 rack
    compute_eff: 0.39         # the achievable fraction of bf16_tflops on training compute
    link_eff: 0.8             # of the link bandwidths, for collectives and p2p
    hbm_eff: 0.8              # of hbm_tb_s, for the optimizer's memory-bound updates
    latency_intra_us: 5       # seconds per message / ring step inside an NVLink domain, in microseconds
    latency_inter_us: 12      # between domains

Ranks are placed as torchrun and ``ParallelDims`` place them: ``gpus_per_node`` consecutive ranks a node, nodes
filling an NVLink domain in order (:class:`~k3train.planning.step_time.device.Device`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from k3train.config import ConfigError
from k3train.planning.step_time.device import GB, Device

# key -> (Device field, factor to the field's unit, integer?)
KEYS: dict[str, tuple[str, float, bool]] = {
    "bf16_tflops": ("peak_flops", 1e12, False),
    "memory_gb": ("hbm_bytes", GB, False),
    "hbm_tb_s": ("hbm_bw", 1e12, False),
    "nvlink_gb_s": ("nvlink_bw", GB, False),
    "internode_gbit_s": ("internode_bw", 1e9 / 8, False),
    "gpus_per_node": ("gpus_per_node", 1, True),
    "nvlink_domain": ("nvlink_domain", 1, True),
    "compute_eff": ("compute_eff", 1, False),
    "link_eff": ("link_eff", 1, False),
    "hbm_eff": ("hbm_eff", 1, False),
    "latency_intra_us": ("lat_intra", 1e-6, False),
    "latency_inter_us": ("lat_inter", 1e-6, False),
}
FRACTIONS = ("compute_eff", "link_eff", "hbm_eff")
# what a file without ``base`` must give (the rest have the Device defaults)
REQUIRED = ("bf16_tflops", "memory_gb", "hbm_tb_s", "nvlink_gb_s", "internode_gbit_s")
# tools/plan.py's cluster flags -> keys
FLAGS = {"gpus_per_node": "gpus_per_node", "nvlink_domain": "nvlink_domain", "internode_gbit_s": "internode_gbit_s"}


def is_device_file(name: str) -> bool:
    """Whether ``--device`` names a file (a path ending in .yaml / .yml) rather than a device of the table."""
    return name.lower().endswith((".yaml", ".yml"))


def read_device_file(path: str, table: dict[str, Device]) -> Device:
    """The device a YAML file describes (module docstring), checked."""
    p = Path(path)
    where = f"--device {path}"
    if not p.is_file():
        raise ConfigError(f"{where}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys ({', '.join(['base', 'name', *KEYS])})")
    data = dict(data)
    base_name = data.pop("base", None)
    name = data.pop("name", None)
    if base_name is not None and (not isinstance(base_name, str) or base_name.lower() not in table):
        raise ConfigError(f"{where}: base {base_name!r}: expected one of {', '.join(table)}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigError(f"{where}: name {name!r}: expected a non-empty string")
    if base_name is None:
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ConfigError(f"{where}: without a base device it needs {', '.join(missing)}")
        base = Device(name or p.stem, peak_flops=1.0, hbm_bytes=1.0, hbm_bw=1.0, nvlink_bw=1.0, internode_bw=1.0,
                      compute_eff=table["h100"].compute_eff)
    else:
        base = table[base_name.lower()]
    dev = apply_cluster(base, data, where)
    return dataclasses.replace(dev, name=name or (p.stem if base_name is None else f"{base.name} ({p.stem})"))


def apply_cluster(dev: Device, items: dict[str, Any], where: str | None = None) -> Device:
    """``dev`` with the keys of ``items`` (module docstring) set, every one checked; ``where`` names the source in
    the error (``--device FILE``; None: the items are the cluster flags, each named as its flag)."""
    out: dict[str, Any] = {}
    for key, value in items.items():
        here = f"{where}: {key}" if where else "--" + key.replace("_", "-")
        if key not in KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}: expected one of {', '.join(['base', 'name', *KEYS])}")
        field, factor, integer = KEYS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{here} {value!r}: expected {'an integer' if integer else 'a number'}")
        if not 0 < value < float("inf"):
            raise ConfigError(f"{here} {value!r}: must be positive and finite")
        if integer and value != int(value):
            raise ConfigError(f"{here} {value!r}: expected an integer")
        if key in FRACTIONS and value > 1:
            raise ConfigError(f"{here} {value!r}: a fraction of the peak, at most 1")
        out[field] = int(value) if integer else float(value) * factor
    dev = dataclasses.replace(dev, **out)
    node, domain = dev.gpus_per_node, dev.domain_size
    if node % domain and domain % node:
        raise ConfigError(f"{where or 'the cluster flags'}: nvlink_domain {domain} and gpus_per_node {node}: one "
                          f"must divide the other (NVLink joins part of a node or whole nodes)")
    return dev


def cluster_flags(values: dict[str, Any]) -> dict[str, Any]:
    """tools/plan.py's cluster flags that were given (``None``: not given), as device-file keys."""
    return {FLAGS[k]: v for k, v in values.items() if k in FLAGS and v is not None}
