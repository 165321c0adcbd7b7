"""The search's rows (one per valid layout: its bounds, prediction, traced memory and why it was skipped) and its
result."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from k3train.model.flops import model_flops_per_token
from k3train.planning.search.layouts import Layout
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.predict import Prediction


@dataclass
class Row:
    layout: Layout
    cfg: Any = field(repr=False, default=None)
    mem_bound: int = 0
    lower_bound_s: float = 0.0
    pred: Prediction | None = None
    peak_bytes: int | None = None
    stage_peaks: list[int] = field(default_factory=list)
    fits: bool | None = None
    skipped: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # measure_step's phases (``--measure``)
    peak_is_bound: bool = False  # peak_bytes is a lower bound (the trace stopped once a chunk exceeded the device)
    bound_key: tuple = field(repr=False, default=())  # what its static memory bound reads (``PieceBounds``)
    mem_upper: int | None = None  # an upper bound on its peak (``memory_upper``): it fits on it, untraced

    @property
    def measured_step_s(self) -> float | None:
        return self.measured.get("step_time_s")

    def tokens_per_s(self, cfg: Any) -> float | None:
        if self.pred is None:
            return None
        return cfg.train.global_batch_size * cfg.train.seq_len / self.pred.step_s

    def as_json(self, cfg: Any, world: int, peak_flops: float) -> dict[str, Any]:
        return {"layout": asdict(self.layout), "fits": self.fits, "peak_bytes": self.peak_bytes,
                "peak_is_lower_bound": self.peak_is_bound,
                "stage_peak_bytes": self.stage_peaks or None, "memory_lower_bound_bytes": self.mem_bound,
                "memory_upper_bound_bytes": self.mem_upper,
                "predicted_step_s": self.pred.step_s if self.pred else None,
                "predicted_tokens_per_s": self.tokens_per_s(cfg),
                "predicted_tokens_per_s_per_device": (self.tokens_per_s(cfg) or 0) / world if self.pred else None,
                "mfu": mfu(self, cfg, world, peak_flops) if self.pred else None,
                "breakdown": self.pred.breakdown() if self.pred else None,
                "breakdown_detail": self.pred.detail if self.pred else None, "skipped": self.skipped or None,
                "measured_step_s": self.measured_step_s, "measured_phases": self.measured or None}


@dataclass
class SearchStatus:
    """How a search ended: ``done`` (not stopped by a budget: ``stopped_by`` names the one that stopped it),
    whether its answer is ``proven`` within the model -- its best the best of the space, or no layout fitting --
    (no layout left out could beat it: bounds, simulations and memory estimates only), how many layouts were left
    that could (``left``: a step-time lower bound below the best, or any when none fits; ``lowest_left_s``), and
    how many of those a heuristic ruled out instead (``heuristic``: too big by the family rule of a layout traced
    too big), and, stopped by a budget, the fastest simulated layout whose memory it did not decide
    (``candidate``)."""
    done: bool = True
    proven: bool = False
    stopped_by: str = ""
    left: int = 0
    lowest_left_s: float | None = None
    heuristic: int = 0
    candidate: str = ""  # stopped by a budget: the fastest simulated layout whose memory is not decided

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PlanResult:
    rows: list[Row]
    world: int
    device: Device
    base_cfg: Any
    candidates: int
    seconds: dict[str, float]
    notes: list[str]
    status: SearchStatus = field(default_factory=SearchStatus)
    layouts: int = 0  # valid layouts in the space (``rows`` holds those the search examined)

    def ranked(self) -> list[Row]:
        ok = [r for r in self.rows if r.pred is not None and r.fits]
        return sorted(ok, key=lambda r: r.pred.step_s)


def mfu(row: Row, cfg: Any, world: int, peak_flops: float) -> float:
    """Model FLOPs/s (``k3train.model.flops``, as the trainer's MFU) over the devices' peak."""
    tps = row.tokens_per_s(cfg) or 0.0
    return model_flops_per_token(cfg.model, cfg.train.seq_len) * tps / (world * peak_flops)
