"""What the memory estimate reports: per traced chunk, per rank, and the whole estimate."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass
class ChunkTrace:
    """One local chunk, one micro-batch: bytes alive after F (``saved``), transient above the live base
    during F (``f_peak``) and during B (``b_peak``, on top of ``saved``)."""
    chunk: int
    stage: int
    layers: tuple[int, int]
    saved: int
    f_peak: int
    b_peak: int
    recv: int = 0      # received activation payload (held until B)
    grad_msg: int = 0  # incoming gradient payload (during B)
    # traced on two real micro-batches: (saved, f_peak, b_peak) above are at seg_lo padded KDA chunks, ``hi`` at
    # seg_hi; a micro-batch with n chunks is costed by linear interpolation (chunked KDA pads per document)
    seg_lo: int = 0
    seg_hi: int = 0
    hi: tuple[int, int, int] | None = None

    def at(self, segs: int | None) -> tuple[int, int, int]:
        lo = (self.saved, self.f_peak, self.b_peak)
        if self.hi is None or segs is None or self.seg_hi == self.seg_lo:
            return lo
        w = (segs - self.seg_lo) / (self.seg_hi - self.seg_lo)
        return tuple(int(round(a + w * (b - a))) for a, b in zip(lo, self.hi))


@dataclass
class RankMemory:
    rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    peak: int
    peak_at: str = ""
    measured_peak: int | None = None
    detail: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.measured_peak is None:
            d.pop("measured_peak")
        return d


@dataclass
class Estimate:
    layout: str
    ranks: list[RankMemory]
    stages: list[dict[str, Any]]
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "seconds": round(self.seconds, 2), "stages": self.stages,
                "ranks": [r.as_json() for r in self.ranks]}
