"""Typed run configuration: the sections together (:class:`Config`), where each value came from, and the one
:meth:`Config.validate` that runs each section's check in a fixed order.

One YAML file describes one run (k3train/config/load.py reads it and the ``--section.key=value`` overrides).
Every section is a dataclass in its own module, beside its check (model.py, parallel.py, train.py, optim.py,
data.py, logs.py, checkpoint.py, vision.py; draft.py checks ``train.objective``); a check takes its section, the
other sections it reads and the reporter (:meth:`Config.need`, :meth:`Config.origin`; typed in report.py), never
the whole :class:`Config`. Unknown keys, wrong types and inconsistent values raise :class:`ConfigError` naming the
key (and the file). Derived values are computed once, in :meth:`Config.validate`, and stored on the objects
(fields marked ``derived``) so the resolved config written to the run directory is complete.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3train.config.checkpoint import CheckpointConfig, check_checkpoint
from k3train.config.data import DataConfig, check_data
from k3train.config.draft import check_objective
from k3train.config.logs import LoggingConfig, check_logging
from k3train.config.model import ModelConfig, check_model
from k3train.config.optim import OptimConfig, check_optim
from k3train.config.parallel import ParallelConfig, check_collective_timeout, check_parallel
from k3train.config.train import TrainConfig, check_train
from k3train.config.vision import VisionConfig, check_vision
from k3train.runtime.bad_input import ConfigError

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "vision": VisionConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    source: str = field(default="<defaults>", metadata={"derived": True})
    # "section.key" -> where its value was set ("in FILE:LINE" / "from the command line: --k=v"), for messages
    origins: dict[str, str] = field(default_factory=dict, metadata={"derived": True}, repr=False, compare=False)

    def origin(self, *keys: str) -> str:
        """Where the values of ``keys`` came from, for an error message: the file and line, the command-line
        argument, or the default -- so a bad override is never blamed on the file."""
        found = list(dict.fromkeys(self.origins[k] for k in keys if k in self.origins))
        cli = [o for o in found if o.startswith("from the command line")]
        found = cli or found  # several keys involved: the command line changed what the file had
        if found:
            return "; ".join(found)
        return f"default value; not set in {self.source}" if all("." in k for k in keys) else f"in {self.source}"

    def need(self, cond: bool, key: str, msg: str, *src: str) -> None:
        """Raise :class:`ConfigError` for ``key`` unless ``cond``; the message names where ``src`` (default:
        ``key``) was set. What every section's check calls."""
        if not cond:
            raise ConfigError(f"{key}: {msg} ({self.origin(*(src or (key,)))})")

    def validate(self, world_size: int | None = None) -> Config:
        """Check consistency and compute derived fields. ``world_size`` (when given) must match the layout.

        The checks run in this order and the first failing one raises, so which error a config with several
        problems reports is fixed: sizes and counts, model, parallel layout, train, objective, optim, data,
        logging, collective timeout, checkpoint, vision."""
        need, origin = self.need, self.origin
        m, p, t, d, v = self.model, self.parallel, self.train, self.data, self.vision
        check_counts(self)
        check_model(m, need)
        check_parallel(p, m, world_size, need)
        check_train(t, m, p, d, need, origin)
        check_objective(t, m, p, self.checkpoint, need)
        check_optim(self.optim, need)
        check_data(d, m, v, need, origin)
        check_logging(self.logging, need)
        check_collective_timeout(p, need)
        check_checkpoint(self.checkpoint, need)
        check_vision(v, m, need)
        return self

    def validate_layout(self, world_size: int) -> Config:
        """The checks of :meth:`validate` that read a layout key (``parallel.pp / vpp / dp / cp / ep / zero /
        moonep / recompute / schedule / overlap_ep / pp_layers``, ``train.micro_batch_size``), in its order, with
        their derived fields -- for a copy of a config that :meth:`validate` accepted with only layout keys
        changed to positive values: the other checks (model, optim, data, logging, collective timeout,
        checkpoint, vision; the sizes' ``>= 0``) read none or pass for them, so :meth:`validate` fails exactly
        where this does, with the same error.
        The planner checks a hundred thousand layouts of one config with it (tests/planning/test_plan.py checks
        the two against each other)."""
        m, p, t = self.model, self.parallel, self.train
        check_parallel(p, m, world_size, self.need)
        check_train(t, m, p, self.data, self.need, self.origin)
        check_objective(t, m, p, self.checkpoint, self.need)
        return self

    def ep_overlap(self) -> tuple[bool, str]:
        """Whether ``parallel.overlap_ep`` pairs the forward of micro-batch m+1 with the backward of micro-batch m
        in this run (validated config), and why not when it does not (for the log line)."""
        why = "parallel.overlap_ep=false" if not self.parallel.overlap_ep else self.pairing_blocker()
        return not why, why

    def pairing_blocker(self) -> str:
        """Why F/B pairing cannot apply to this layout whatever ``parallel.overlap_ep`` says ("" when it can)."""
        m, p, t = self.model, self.parallel, self.train
        return ("no expert parallelism (ep = 1 or no routed experts)" if p.ep == 1 or m.num_experts == 0
                else "one micro-batch per step" if t.grad_accum_steps < 2
                else "train.objective=eagle3 runs its own step" if t.objective != "lm"
                else "")

    def to_dict(self) -> dict[str, Any]:
        """Settable fields per section, plus a ``derived`` section (ignored when loaded back)."""
        out: dict[str, Any] = {}
        derived: dict[str, Any] = {}
        for s in SECTIONS:
            sec = getattr(self, s)
            out[s] = {}
            for f in dataclasses.fields(sec):
                v = getattr(sec, f.name)
                v = list(v) if isinstance(v, list) else v
                if f.metadata.get("derived"):
                    derived[f"{s}.{f.name}"] = v
                else:
                    out[s][f.name] = v
        out["derived"] = derived
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


@functools.lru_cache(maxsize=None)
def count_fields(cls: type) -> tuple[str, ...]:
    """Field names of a config section that are sizes or counts by name (must be >= 0)."""
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.name.endswith(("_size", "_layers", "_heads", "_dim", "steps", "interval"))
                 and f.name not in ("first_k_dense_replace",))


def check_counts(cfg: Config) -> None:
    """Every size or count of every section (by name: :func:`count_fields`) is >= 0."""
    for sec_name in SECTIONS:
        sec = getattr(cfg, sec_name)
        for name in count_fields(type(sec)):
            v = getattr(sec, name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cfg.need(v >= 0, f"{sec_name}.{name}", f"must be >= 0, got {v}")
