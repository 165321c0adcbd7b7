"""The layout space by its structure: every valid CORE (pp, vpp, dp, cp, ep, micro-batch size, schedule), each
with the memory knobs (ZeRO stage, MoonEP, recomputation, F/B pairing) its layouts take -- what the search bounds
a family of layouts at a time and expands only where a layout of it could be the best (a million layouts of K3 at
4K are 90 thousand cores).

A core is validated as :class:`~.layouts.Validator` validates a layout (the run validation, from a copy of the base
config with its layout keys set); ``zero``, ``moonep``, ``recompute`` and ``overlap_ep`` are then every value
validation accepts for them -- ``Config.validate`` checks them for membership only, independent of everything
else (the tests check the product against ``Validator.check`` of every full combination); ``overlap_ep`` only where
pairing applies to the core (``Config.pairing_blocker``). Two speed-ups change no answer: a schedule name is
resolved first (``resolve_schedule``, the same function the validation runs), so a name that cannot run at the
core's vpp, or that resolves to a schedule already tried there, is not validated again; and the candidates are
drawn from the divisors of the world size, the global batch and ``num_experts`` (values outside them fail
``Config.validate`` anyway, :mod:`.layouts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from k3train.config import Config, ConfigError, load_config
from k3train.planning.search.layouts import (Layout, Validator, candidate_values, canonical, layout_config,
                                             pinned_dims, schedules_to_try)
from parallel.pipeline.schedules import resolve_schedule


@dataclass(frozen=True)
class Core:
    """One valid core: its canonical dims (``lay``: the layout with every knob off), its validated config (shared
    by its layouts' configs, :func:`~.layouts.layout_config`) and whether F/B pairing applies to it."""
    lay: Layout
    cfg: Config
    pairable: bool

    @property
    def M(self) -> int:
        """Micro-batches per step."""
        return self.cfg.train.grad_accum_steps


@dataclass
class Space:
    """Every valid layout of a config for a world size, as cores x knobs (module docstring)."""
    base: Config
    world: int
    cores: list[Core]
    knobs: dict[str, list[Any]]  # zero, moonep, recompute, overlap_ep: the values the layouts take
    checked: int  # candidate cores validated

    def layouts(self, core: Core) -> list[Layout]:
        """The layouts of ``core`` (its knobs' product; MoonEP only with EP, pairing only where it applies)."""
        c, k = core.lay, self.knobs
        return [Layout(c.pp, c.vpp, c.dp, c.cp, c.ep, moonep, zero, c.mbs, rc, c.schedule, ov)
                for zero in k["zero"] for moonep in (k["moonep"] if c.ep > 1 else [False])
                for rc in k["recompute"] for ov in (k["overlap_ep"] if core.pairable else [False])]

    def __len__(self) -> int:
        return sum(self.count(c) for c in self.cores)

    def count(self, core: Core) -> int:
        k = self.knobs
        return (len(k["zero"]) * (len(k["moonep"]) if core.lay.ep > 1 else 1) * len(k["recompute"])
                * (len(k["overlap_ep"]) if core.pairable else 1))

    def pairs(self) -> Iterator[tuple[Layout, Config]]:
        """Every ``(layout, validated config)`` (the configs of one core share their model and train sections)."""
        for core in self.cores:
            for lay in self.layouts(core):
                yield lay, layout_config(core.cfg, lay)


def enumerate_space(config: str, overrides: list[str], world_size: int) -> Space:
    """The :class:`Space` of ``config`` + ``overrides`` (which must load; layout dims in them pin) for
    ``world_size``; its cores in the order of their dims."""
    base = load_config(config, overrides)
    pinned = pinned_dims(overrides)
    vals = candidate_values(base, world_size, pinned)
    v = Validator(base, world_size)
    cores: dict[Layout, Core] = {}
    checked = 0
    for dims in _candidate_cores(base, world_size, vals, pinned):
        checked += 1
        try:
            core = v.check(dims)
        except (ConfigError, ValueError):
            continue
        c0 = canonical(core)
        cores.setdefault(c0, Core(lay=c0, cfg=core, pairable=not core.pairing_blocker()))
    knobs = {"zero": [z for z in vals["zero"] if z in (0, 1, 2)], "moonep": vals["moonep"],
             "recompute": vals["recompute"], "overlap_ep": vals["overlap_ep"]}
    return Space(base=base, world=world_size, cores=[cores[k] for k in sorted(cores)], knobs=knobs, checked=checked)


def _candidate_cores(base: Config, world: int, vals: dict[str, list[Any]], pinned: dict[str, str]
                     ) -> Iterator[dict[str, Any]]:
    """The core dims worth validating: ``pp * dp * cp = world``, whole micro-batches per data-parallel rank (a
    multiple of pp of them when interleaved), ``ep`` dividing ``dp * cp``, and per ``(pp, vpp)`` each schedule
    the validation would run once (a name that does not resolve there fails its validation; one that resolves
    to a schedule already tried is the same core)."""
    L, gbs = base.model.num_hidden_layers, base.train.global_batch_size
    pin_dp = int(pinned["dp"]) if "dp" in pinned and pinned["dp"] != "-1" else None
    for pp in vals["pp"]:
        for cp in vals["cp"]:
            if world % (pp * cp):
                continue
            dp = world // (pp * cp)
            if pin_dp is not None and dp != pin_dp:
                continue
            for vpp in (vals["vpp"] if pp > 1 else [vals["vpp"][0] if len(vals["vpp"]) == 1 else 1]):
                if pp * vpp > L and not base.parallel.pp_layers:
                    break
                scheds = _resolving(schedules_to_try(vals["schedule"], pp), pp, vpp)
                for mbs in vals["mbs"]:
                    if gbs % (mbs * dp):
                        continue
                    if pp > 1 and vpp > 1 and (gbs // (mbs * dp)) % pp:
                        continue
                    for ep in vals["ep"]:
                        if (dp * cp) % ep:
                            continue
                        for sched in scheds:
                            yield dict(pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, mbs=mbs, schedule=sched)


def _resolving(names: list[str], pp: int, vpp: int) -> list[str]:
    """Of ``names``, the first spelling of each schedule they resolve to at ``(pp, vpp)``; a name that does not
    resolve there is dropped (its validation fails: ``Validator.check`` resolves it)."""
    out, seen = [], set()
    for n in names:
        try:
            r = resolve_schedule(n, pp, vpp) if pp > 1 else "none"
        except ConfigError:
            continue
        if r not in seen:
            seen.add(r)
            out.append(n)
    return out


def enumerate_layouts(config: str, overrides: list[str], world_size: int) -> tuple[list[tuple[Layout, Config]], int]:
    """``([(layout, validated config)], candidates checked)`` for every valid layout (canonical, deduplicated,
    sorted): :func:`enumerate_space`'s cores times their knobs."""
    space = enumerate_space(config, overrides, world_size)
    return sorted(space.pairs(), key=lambda x: astuple_fast(x[0])), space.checked


def astuple_fast(lay: Layout) -> tuple:
    """``dataclasses.astuple(lay)`` without its recursive deep copy (Layout holds scalars only)."""
    return (lay.pp, lay.vpp, lay.dp, lay.cp, lay.ep, lay.moonep, lay.zero, lay.mbs, lay.recompute, lay.schedule,
            lay.overlap_ep)
