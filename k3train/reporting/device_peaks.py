"""Published dense bf16 peak FLOP/s per GPU: the MFU denominator on CUDA (:mod:`k3train.reporting.metrics`) and the
planner's device table (:mod:`k3train.planning.calibration.devices`), from one table."""
from __future__ import annotations

# the planner's devices: bf16 dense peak per GPU (SXM parts; K3-SPEC "Facts for the planning tools"; GB200 / GB300:
# NVIDIA's NVL72 figures, 180 PFLOP/s dense bf16 over 72 GPUs)
BF16_DENSE_PEAK = {"h100": 989e12, "h200": 989e12, "b200": 2250e12, "gb200": 2500e12, "gb300": 2500e12}

# torch.cuda.get_device_name -> published dense bf16 peak per GPU. First match of a lower-case substring wins, so the
# PCIe / NVL H100 parts (lower clocks) come before plain "h100" (SXM: "NVIDIA H100 80GB HBM3"), and the Grace
# Blackwell parts ("NVIDIA GB200") before "b200", which their names contain.
CUDA_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", BF16_DENSE_PEAK["h100"]),
    ("h200", BF16_DENSE_PEAK["h200"]),
    ("gb200", BF16_DENSE_PEAK["gb200"]),
    ("gb300", BF16_DENSE_PEAK["gb300"]),
    ("b200", BF16_DENSE_PEAK["b200"]),
)


def published_bf16_peak(device_name: str) -> tuple[str, float] | None:
    """``(matched part, dense bf16 FLOP/s)`` for a CUDA device name such as ``"NVIDIA H200"``, else None."""
    low = device_name.lower()
    for part, flops in CUDA_BF16_PEAKS:
        if part in low:
            return part, flops
    return None
