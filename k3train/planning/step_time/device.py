"""One device as the step-time model sees it: compute, memory, links and, on a cpu, how its ranks share the
cores (the published GPUs and this host's cpu: :mod:`k3train.planning.calibration.devices`; a cluster of your own:
:mod:`k3train.planning.calibration.cluster`).

Ranks are placed as torchrun and ``ParallelDims`` place them: rank ``r`` on node ``r // gpus_per_node``, in the
NVLink domain ``r // nvlink_domain`` (the GPUs one NVLink fabric joins: a node of 8 on HGX/DGX H100, H200, B200; a
rack of 72 on GB200 / GB300 NVL72). Two ranks of one domain talk over NVLink, any others over the inter-node NICs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GB = 1e9


@dataclass
class Device:
    name: str
    peak_flops: float          # bf16 dense FLOP/s per device (cpu: measured fp32 matmul at the rank's threads)
    hbm_bytes: float           # device memory (cpu: host RAM / ranks on the host)
    hbm_bw: float              # bytes/s
    nvlink_bw: float           # bytes/s one direction, inside a node (cpu: gloo between local processes)
    internode_bw: float        # bytes/s one direction per device across nodes
    gpus_per_node: int = 8
    nvlink_domain: int = 0     # GPUs one NVLink fabric joins (0: a node, ``gpus_per_node``)
    lat_intra: float = 5e-6    # seconds per message / ring step inside a node
    lat_inter: float = 12e-6   # across nodes
    call_lat: dict[str, float] = field(default_factory=dict)  # per collective kind: seconds per call on top of its
    #                             ring steps (cpu: waiting for busy peers, cpu_bench.bench_loaded_collective; GPUs: none)
    compute_eff: float = 0.55
    link_eff: float = 0.8
    hbm_eff: float = 0.8
    cores: int = 0             # cpu: cores shared by the ranks of the host (0 = no sharing: a GPU each)
    threads: int = 1           # cpu: intra-op threads per rank
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def flops(self) -> float:
        return self.peak_flops * self.compute_eff

    @property
    def shares_cores(self) -> bool:
        """cpu: the ranks of the host compete for its cores (a GPU each otherwise)."""
        return self.is_cpu and self.cores > 0

    def rank_speed(self, busy: int) -> float:
        """A rank's compute speed (1 = alone on the host) while ``busy`` ranks compute at once. cpu: the
        calibrated curve ``calibration['concurrency'][n]`` (``bench_concurrency``), extended past its last point
        by processor sharing; plain ``min(1, cores / (threads x busy))`` without one. GPUs: 1."""
        if not self.shares_cores:
            return 1.0
        n = max(1, busy) * self.threads
        curve = {int(k): float(v) for k, v in self.calibration.get("concurrency", {}).items()}
        if not curve:
            return min(1.0, self.cores / n)
        top = max(curve)
        return curve[n] if n <= top else curve[top] * top / n  # measured for 1..top processes

    def call_cost(self, kind: str) -> float:
        """Seconds one collective call of ``kind`` costs beyond its ring steps (``call_lat``; the all-to-all's for
        p2p batches, which synchronise the same way)."""
        return self.call_lat.get(kind, self.call_lat.get("all_to_all", 0.0) if kind == "p2p" else 0.0)

    @property
    def domain_size(self) -> int:
        """GPUs per NVLink domain."""
        return max(1, self.nvlink_domain or self.gpus_per_node)

    def domain_of(self, rank: int) -> int:
        """The NVLink domain of global rank ``rank`` (module docstring)."""
        return rank // self.domain_size

    def link(self, intra: bool) -> tuple[float, float]:
        """``(latency s, bandwidth bytes/s)`` of a link inside an NVLink domain (``intra``) or between domains."""
        if intra:
            return self.lat_intra, self.nvlink_bw * self.link_eff
        return self.lat_inter, self.internode_bw * self.link_eff

    def describe(self) -> str:
        s = (f"device {self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s x {self.compute_eff:.2f} achievable, "
             f"{self.hbm_bytes / 2**30:.1f} GiB at {self.hbm_bw / GB:.3g} GB/s, intra-node {self.nvlink_bw / GB:.3g} "
             f"GB/s, inter-node {self.internode_bw / GB:.3g} GB/s (x {self.link_eff:.2f}), "
             f"{self.gpus_per_node} per node")
        if self.domain_size != self.gpus_per_node:
            s += f", NVLink domains of {self.domain_size}"
        if self.is_cpu:
            s += f", {self.cores} cores, {self.threads} thread(s)/rank; calibration {self.calibration.get('path', '')}"
            taken = self.calibration.get("taken")
            if taken:
                s += (f"\n  calibrated {taken['time']} under {taken['key']}, 1-minute load average then "
                      f"{taken['load1']:.2f}" + (" (over 0.5: if other work was running then, its timings and so every "
                                                 "prediction are off: delete the file and plan again on an idle "
                                                 "machine)" if taken["load1"] > 0.5 else ""))
        return s
