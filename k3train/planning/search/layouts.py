"""Every parallel layout of a config that the project's validation accepts for a world size.

A layout is ``pp, vpp, dp, cp, ep, moonep, zero, micro_batch_size, recompute, schedule, overlap_ep`` (the global
batch and everything else of the config stay fixed). A layout is VALID iff it passes the validation every run goes through
(``k3train.preflight.validate_run(..., for_training=False)``: ``Config.validate`` for the world size, then
``check_layout``: the project's partitioner and the schedule builder). :func:`enumerate_layouts` runs exactly those
checks, with two speed-ups that change no answer: the base config is parsed and validated once (each candidate is a
copy with its layout fields set, checked by ``Config.validate_layout``), and the partition / schedule of a ``(pp, vpp, seq_len)`` / ``(schedule, pp, vpp, M)`` is
built once and reused (both are pure functions of those arguments). Candidates are drawn from the divisors of the
world size, the global batch and ``num_experts`` -- values outside them fail ``Config.validate`` anyway (the
tests check this against a brute force over every value). The enumeration itself, by cores: :mod:`.space`.

Equivalent spellings are listed once, in canonical form: ``vpp=1`` and schedule ``none`` without a pipeline
(``build_partition`` ignores both at pp=1), the RESOLVED schedule name (``auto`` / ``interleaved`` at vpp=1 run
1F1B, see ``resolve_schedule``), ``moonep=false`` at ep=1 (no expert parallelism, nothing for MoonEP to do), ``overlap_ep=false`` where F/B
pairing does not apply (``Config.ep_overlap``: no EP, one micro-batch, a draft objective; the runner then runs unpaired).

Dimensions the user pinned on the command line (``--parallel.pp=2``, ``--train.micro_batch_size=1``, ...) are not
enumerated.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from k3train.config import Config, ConfigError
from parallel.pipeline.partition import build_partition
from parallel.pipeline.schedules import check_schedule, resolve_schedule

# layout dimension -> config key
KEYS = {"pp": "parallel.pp", "vpp": "parallel.vpp", "dp": "parallel.dp", "cp": "parallel.cp",
        "ep": "parallel.ep", "moonep": "parallel.moonep", "zero": "parallel.zero",
        "mbs": "train.micro_batch_size", "recompute": "parallel.recompute", "schedule": "parallel.schedule",
        "overlap_ep": "parallel.overlap_ep"}
SCHEDULE_NAMES = ("auto", "1f1b", "interleaved", "afab")


@dataclass(frozen=True, order=True)
class Layout:
    pp: int
    vpp: int
    dp: int
    cp: int
    ep: int
    moonep: bool
    zero: int
    mbs: int
    recompute: bool
    schedule: str  # resolved: '1f1b' | 'interleaved' | 'afab' | 'none' (pp = 1)
    overlap_ep: bool = False  # F/B pairing runs (parallel.overlap_ep where Config.ep_overlap applies)

    def overrides(self) -> list[str]:
        """The command-line overrides that select this layout (``pp_layers`` left to the partitioner)."""
        sched = "auto" if self.schedule == "none" else self.schedule
        vals = {**asdict(self), "schedule": sched}
        out = []
        for k, key in KEYS.items():
            v = vals[k]
            out.append(f"--{key}={str(v).lower() if isinstance(v, bool) else v}")
        return out + ["--parallel.pp_layers=[]"]

    def short(self) -> str:
        s = f"pp{self.pp}"
        s += f"v{self.vpp}" if self.vpp > 1 else ""
        s += f" dp{self.dp} cp{self.cp} ep{self.ep}{'M' if self.moonep else ''} z{self.zero} mb{self.mbs}"
        s += " rc" if self.recompute else ""
        return s + f" {self.schedule}" + (" paired" if self.overlap_ep else "")


def canonical(cfg: Config) -> Layout:
    """The canonical layout of a validated config (module docstring)."""
    p, t = cfg.parallel, cfg.train
    sched = "none" if p.pp == 1 else resolve_schedule(p.schedule, p.pp, p.vpp)
    return Layout(pp=p.pp, vpp=p.vpp if p.pp > 1 else 1, dp=p.dp, cp=p.cp, ep=p.ep,
                  moonep=bool(p.moonep) and p.ep > 1, zero=p.zero, mbs=t.micro_batch_size,
                  recompute=bool(p.recompute), schedule=sched, overlap_ep=cfg.ep_overlap()[0])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pinned_dims(overrides: Iterable[str]) -> dict[str, str]:
    """Layout dimensions fixed on the command line: ``{'pp': '2', ...}`` (values as written)."""
    by_key = {v: k for k, v in KEYS.items()}
    out = {}
    for o in overrides:
        key, _, val = o.lstrip("-").partition("=")
        if key in by_key:
            out[by_key[key]] = val
    return out


class Validator:
    """The run validation of one base config for one world size, memoising the pure pieces (module docstring)."""

    def __init__(self, base: Config, world_size: int) -> None:
        self.base, self.world = base, world_size
        self._parts: dict[tuple, Any] = {}
        self._scheds: dict[tuple, Any] = {}

    def partition(self, cfg: Config) -> Any:
        p = cfg.parallel
        key = (p.pp, p.vpp if p.pp > 1 else 1, tuple(p.pp_layers), cfg.train.seq_len)
        if key not in self._parts:
            try:
                self._parts[key] = build_partition(cfg.model, p, cfg.train.seq_len)
            except ConfigError as e:
                self._parts[key] = e
        r = self._parts[key]
        if isinstance(r, ConfigError):
            raise r
        return r

    def schedule(self, name: str, pp: int, vpp: int, M: int) -> None:
        """Raises ConfigError where ``build_schedule`` would (``check_schedule``: the same rules, nothing built --
        at K3 scale a schedule has pp x vpp x M actions and there are thousands of (pp, vpp, M))."""
        key = (name, pp, vpp, M)
        if key not in self._scheds:
            try:
                check_schedule(name, pp, vpp, M)
                self._scheds[key] = None
            except ConfigError as e:
                self._scheds[key] = e
        r = self._scheds[key]
        if isinstance(r, ConfigError):
            raise r

    def check(self, values: dict[str, Any]) -> Config:
        """The base config with ``values`` (layout dims) set, validated as ``validate_run(for_training=False)``
        does; raises ConfigError (or ParallelConfigError) when the layout is not accepted."""
        # a copy with fresh parallel/train sections (the checks write derived fields there); the other sections
        # are shared: the base passed Config.validate, and only the checks that read a layout key run again
        # (Config.validate_layout: the same verdict and error as validate for this copy)
        cfg = copy.copy(self.base)
        cfg.parallel, cfg.train = copy.copy(self.base.parallel), copy.copy(self.base.train)
        for k, v in values.items():
            sec, _, name = KEYS[k].partition(".")
            setattr(getattr(cfg, sec), name, v)
        cfg.parallel.pp_layers = list(self.base.parallel.pp_layers) if "pp" not in values else []
        cfg.validate_layout(self.world)
        self.partition(cfg)  # check_layout: the partitioner ...
        p = cfg.parallel
        if p.pp > 1 and cfg.train.grad_accum_steps:  # ... and the schedule
            self.schedule(resolve_schedule(p.schedule, p.pp, p.vpp), p.pp, p.vpp, cfg.train.grad_accum_steps)
        return cfg


def _parse(dim: str, text: str) -> Any:
    if dim in ("moonep", "recompute", "overlap_ep"):
        return text.strip().lower() in ("1", "true", "yes", "on")
    if dim == "schedule":
        return text.strip()
    return int(text)


def candidate_values(base: Config, world: int, pinned: dict[str, str]) -> dict[str, list[Any]]:
    """Per dimension, the values worth trying (a superset of every valid value; see the module docstring)."""
    m, t = base.model, base.train
    W = world
    vals: dict[str, list[Any]] = {
        "pp": [d for d in divisors(W) if d <= m.num_hidden_layers],
        "cp": [d for d in divisors(W) if t.seq_len % d == 0],
        "vpp": list(range(1, m.num_hidden_layers + 1)),
        "ep": [d for d in divisors(W) if m.num_experts == 0 or m.num_experts % d == 0],
        "mbs": divisors(t.global_batch_size),
        "zero": [0, 1, 2], "moonep": [False, True], "recompute": [False, True],
        "schedule": list(SCHEDULE_NAMES), "overlap_ep": [False, True],
    }
    for dim, text in pinned.items():
        if dim != "dp":
            vals[dim] = [_parse(dim, text)]
    return vals


def schedules_to_try(names: list[str], pp: int) -> list[str]:
    """Schedule names to validate at ``pp``: one at pp = 1 (ignored there); ``auto`` only when pinned, since it
    resolves to ``interleaved`` or ``1f1b``, both tried anyway (same canonical layout)."""
    if pp == 1:
        return names[:1]
    return names if names == ["auto"] else [n for n in names if n != "auto"]


def layout_config(core: Config, lay: Layout) -> Config:
    """The validated config of ``lay`` from the validated config of its core (same pp..schedule): ``zero``,
    ``moonep``, ``recompute`` and ``overlap_ep`` are set on a copy of the parallel section (no derived field
    depends on them)."""
    cfg = copy.copy(core)
    cfg.parallel = copy.copy(core.parallel)  # dataclasses.replace re-runs __init__: seconds at K3 scale
    cfg.parallel.zero, cfg.parallel.moonep, cfg.parallel.recompute = lay.zero, lay.moonep, lay.recompute
    cfg.parallel.overlap_ep = lay.overlap_ep
    return cfg
