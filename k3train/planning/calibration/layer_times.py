"""The per-config CPU timings the step-time model reads, cached in the calibration file, and the trainer anchor
that scales them.

Isolated timings miss what the trainer does around them, and how much they miss depends on the host (a host with
a fast matmul shrinks the layers' times, not the Python and bookkeeping around them). So a plan also runs the real
trainer once per config on this host -- one process, the config's micro-batch, one micro-batch per step -- and
puts its phases beside its own prediction of that run (:class:`TrainerAnchor`): the forward + backward and the
optimizer step scale the isolated layer and update times, and the gradient-norm phase and the step's work outside
the phases are added to every layout's step.

"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3train.config import load_config
from k3train.planning.calibration.anchor import run_anchor, run_concurrency
from k3train.planning.calibration.host import host_key, load_cache, save_cache
from k3train.planning.calibration.layer_bench import LAYERS_VERSION, bench_layers, bench_optimizer
from k3train.planning.step_time.facts import ParamFacts, opt_sig


def _key(cfg: Any, *parts: Any) -> str:
    model = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
    h = hashlib.sha1(model.encode()).hexdigest()[:12]
    return "|".join([h, cfg.train.dtype, *map(str, parts)])


# the trainer anchor (calibration/anchor_run.py): one process, one micro-batch per step, the real trainer and the
# isolated layers in turns; bumped when what it runs changes
ANCHOR_VERSION = 2


_ANCHOR_LAYOUT = ["--parallel.pp=1", "--parallel.vpp=1", "--parallel.dp=1", "--parallel.cp=1", "--parallel.ep=1",
                  "--parallel.moonep=false", "--parallel.zero=0", "--parallel.recompute=false",
                  "--parallel.pp_layers=[]", "--parallel.schedule=auto"]


@dataclass
class TrainerAnchor:
    """What the real trainer does on this host beyond the isolated timings, from one real run of the config in one
    process (``[B, T]`` = the config's micro-batch, one per step), against the planner's own prediction of that run:

    * ``fb_scale``: the trainer's forward + backward (the pipeline runner, the loss over micro-batches, autograd
      across layers) over the sum of the isolated per-layer times at the same shape, measured in turns in one
      process (the median of the rounds' ratios);
    * ``opt_scale``: the real optimizer step (``DistributedOptimizer.step``: Muon/AdamW over every parameter, its
      bookkeeping, QK-Clip) over the sum of the isolated per-parameter updates;
    * ``grad_norm_s``: the gradient-norm phase with no peer (every parameter's squared norm, the clip scaling);
    * ``host_step_s``: the step's work outside the three timed phases (data loader, loss-token counts, zero_grad,
      the router-balance update, metrics)."""
    fb_scale: float
    opt_scale: float
    grad_norm_s: float
    host_step_s: float
    measured: dict[str, float]
    predicted: dict[str, float]

    def describe(self) -> str:
        m = self.measured
        return (f"trainer anchor (1 process, [{int(m['B'])}, {int(m['T'])}] per step): step {m['step_time_s']:.4f} s "
                f"= fwd+bwd {m['time_forward_backward_s']:.4f} (x{self.fb_scale:.3f} the isolated layers) + grad "
                f"norm {self.grad_norm_s:.4f} + optimizer {m['time_optimizer_s']:.4f} (x{self.opt_scale:.3f} the "
                f"isolated updates) + other {self.host_step_s:.4f}")


def anchor_overrides(overrides: list[str], B: int) -> list[str]:
    """The user's overrides without the layout dimensions, then the anchor's layout: one process, one
    ``B``-row micro-batch per step."""
    drop = ("--parallel.", "--train.micro_batch_size", "--train.global_batch_size")
    kept = [o for o in overrides if not o.startswith(drop)]
    return kept + _ANCHOR_LAYOUT + [f"--train.micro_batch_size={B}", f"--train.global_batch_size={B}"]


def anchor_batch(config: str, overrides: list[str]) -> int:
    """The anchor's rows per micro-batch: the config's own ``train.micro_batch_size`` (with the user's override
    of it, if any), whatever the layout being predicted uses."""
    mbs = [o for o in overrides if o.startswith("--train.micro_batch_size")]
    return load_config(config, mbs).train.micro_batch_size


class LayerTimes:
    """Cached per-config CPU timings (:mod:`k3train.planning.calibration.layer_bench`)."""

    def __init__(self, path: Path, threads: int, log: Any = print, config: str | None = None,
                 overrides: list[str] | None = None) -> None:
        self.path, self.threads, self.log = path, threads, log
        self.data = load_cache(path)
        self.host = host_key(threads)
        self.dirty = False
        # the config file and overrides of the plan: the trainer anchor runs them (None: no anchor)
        self.config, self.overrides = config, list(overrides or [])
        self._anchor: dict[str, TrainerAnchor | None] = {}
        self._anchor_b: int | None = None

    def _anchor_shape(self, cfg: Any) -> tuple[int, int]:
        """``[B, T]`` of the anchor's one-process runs: the config's own micro-batch, its sequence length."""
        if self._anchor_b is None:
            self._anchor_b = anchor_batch(self.config, self.overrides)
        return self._anchor_b, cfg.train.seq_len

    def anchor(self, cfg: Any) -> TrainerAnchor | None:
        """The :class:`TrainerAnchor` of ``cfg``'s model at the config's own micro-batch (:func:`anchor_batch`;
        one anchor serves every layout of a plan; its run measured once, cached)."""
        if self.config is None:
            return None

        B, T = self._anchor_shape(cfg)
        k = _key(cfg, f"anchor-v{ANCHOR_VERSION}", f"v{LAYERS_VERSION}", f"B={B}", f"T={T}", cfg.optim.name,
                 cfg.optim.ns_steps, cfg.optim.per_head_muon)
        if k in self._anchor:
            return self._anchor[k]
        slot = self.data.setdefault(self.host, {}).setdefault("anchor", {})
        if k not in slot:
            self.log(f"anchoring on the real trainer: 1 process, [{B}, {T}] tokens per step, in turns with the "
                     f"isolated layers ...")
            slot[k] = run_anchor(self.config, anchor_overrides(self.overrides, B), self.threads)
            self.dirty = True
        rounds = slot[k]["rounds"]

        def med(xs: list[float]) -> float:
            xs = sorted(xs)
            return xs[len(xs) // 2]

        m = {key: med([r[key] for r in rounds]) for key in rounds[0]}
        m.update(B=B, T=T)
        fb_scale = med([r["time_forward_backward_s"] / r["isolated_fb_s"] for r in rounds])
        one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=1, ep=1),
                                  train=dataclasses.replace(cfg.train, micro_batch_size=B))
        infos = ParamFacts.build(one).infos
        opt_t = self.optimizer(one, infos)
        opt = sum(opt_t[opt_sig(inf)] for inf in infos)
        fbm, gn, om = m["time_forward_backward_s"], m["time_grad_norm_s"], m["time_optimizer_s"]
        a = TrainerAnchor(fb_scale=fb_scale, opt_scale=om / opt, grad_norm_s=gn,
                          host_step_s=max(0.0, m["step_time_s"] - fbm - gn - om), measured=m,
                          predicted={"forward_backward_s": m["isolated_fb_s"], "optimizer_s": opt})
        self._anchor[k] = a
        return a

    def _slot(self) -> dict[str, Any]:
        return self.data.setdefault(self.host, {}).setdefault("layers", {})

    def layers(self, cfg: Any, B: int, T: int, ep: int, moonep: bool = False) -> dict[str, Any]:
        cp = cfg.parallel.cp
        moonep = moonep and ep > 1
        k = _key(cfg, f"v{LAYERS_VERSION}", f"B={B}", f"T={T}", f"ep={ep}", *([f"cp={cp}"] if cp > 1 else []),
                 *(["moonep"] if moonep else []))
        slot = self._slot()
        if k not in slot:
            self.log(f"timing layers at [{B}, {T}] tokens, ep={ep}{' (MoonEP)' if moonep else ''}"
                     f"{f', cp={cp} (KCP code)' if cp > 1 else ''} ...")
            slot[k] = bench_layers(cfg, B, T, ep, self.threads, moonep)
            self.dirty = True
        return slot[k]

    def concurrency(self, cfg: Any, procs: int) -> dict[str, float] | None:
        """How fast a rank steps while ``n = 1..procs`` ranks of this host step at once: ``n`` copies of the trainer
        anchor's one-process trainer (this config, its own micro-batch) in lock-step
        (:func:`.anchor_run.concurrency_curve`; cached). Without a config (no anchor): None."""
        if self.config is None:
            return None
        B, T = self._anchor_shape(cfg)
        k = _key(cfg, f"trainer-v{ANCHOR_VERSION}", f"v{LAYERS_VERSION}", f"B={B}", f"T={T}", cfg.optim.name,
                 "lockstep")
        slot = self.data.setdefault(self.host, {}).setdefault("concurrency", {})
        if len(slot.get(k, {})) < procs:
            self.log(f"calibrating concurrency on the real trainer: 1..{procs} one-process copies of [{B}, {T}] "
                     f"steps at once, in rounds ...")
            slot[k] = run_concurrency(self.config, anchor_overrides(self.overrides, B), procs, self.threads)
            self.dirty = True
        return slot[k]

    def optimizer(self, cfg: Any, infos: list[Any]) -> dict[str, float]:
        slot = self.data.setdefault(self.host, {}).setdefault("optimizer", {})
        k = _key(cfg, cfg.optim.name, cfg.optim.ns_steps, cfg.optim.ns_dtype, cfg.optim.per_head_muon)
        have = slot.setdefault(k, {})
        missing = [inf for inf in infos if opt_sig(inf) not in have]
        if missing:
            self.log(f"timing {len(missing)} optimizer update shape(s) ...")
            have.update(bench_optimizer(cfg, missing, self.threads))
            self.dirty = True
        return have

    def optimizer_in_trainer(self, cfg: Any, infos: list[Any]) -> dict[str, float]:
        """:meth:`optimizer`'s isolated update times scaled by the trainer anchor's ``opt_scale`` (what the
        real optimizer step takes per parameter on this host)."""
        a = self.anchor(cfg)
        s = a.opt_scale if a is not None else 1.0
        return {k: v * s for k, v in self.optimizer(cfg, infos).items()}

    def save(self) -> None:
        if self.dirty:
            fresh = load_cache(self.path)  # keep what another run added meanwhile
            for host, v in self.data.items():
                for sec, d in v.items():
                    fresh.setdefault(host, {}).setdefault(sec, {}).update(d)
            save_cache(self.path, fresh)
            self.dirty = False
