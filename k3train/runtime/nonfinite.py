"""Non-finite loss or gradients: detect, name the first bad module, skip the step, stop after too many.

Detection is free: the optimizer already computes the step's GLOBAL grad norm (all-reduced over every rank)
and the trainer all-reduces the loss sums over the world, so :func:`step_is_finite` gives the same answer on
every rank and every rank takes the same branch (same collectives).

On a bad step the trainer calls :meth:`NonFiniteGuard.diagnose`: the step's forward/backward runs again on the
same micro-batches with hooks that record, in execution order, the first module output (forward hooks) or
gradient (hooks on each module's new output tensors and on every parameter) that is not finite. Every rank
runs the re-run (the same pipeline p2p and collectives as a training step), then the ranks' first-bad reports
are gathered over the world and the earliest by (forward before backward, virtual pipeline stage in execution
order, micro-batch, module order) is reported in one warning line naming the module FQN and the rank. The
skipped step touches no parameter, optimizer state (Muon momentum, Adam moments and step counters) or router
bias; ``train.max_skipped_steps`` consecutive skips stop the run (:class:`TrainingStopped`, exit code 3).
:meth:`NonFiniteGuard.assert_finite_state` refuses to write a checkpoint holding a non-finite tensor.

Fault injection (tests, debugging), read from the environment at start-up::

    K3TRAIN_INJECT_NAN="step=2,rank=1,module=layers.7.attn"     # that module's output is NaN at step 2
    K3TRAIN_INJECT_NAN="step=3+,rank=0,module=layers.1.ffn"     # ... at step 3 and every later step
    K3TRAIN_INJECT_NAN="step=2,module=lm_head,where=grad"       # the gradient of its output, every rank

``step`` is the 1-based optimizer step, ``rank`` the global rank (default: every rank holding the module),
``module`` an FQN of the model, ``where`` ``output`` (default) or ``grad``. A malformed value, a module the model
does not have or a rank outside the world is bad input, found before the run starts (k3train/preflight.py:
check_injection).
"""
from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from k3train.runtime.bad_input import ConfigError

log = logging.getLogger(__name__)

INJECT_ENV = "K3TRAIN_INJECT_NAN"
EXIT_TRAINING_STOPPED = 3


class TrainingStopped(RuntimeError):
    """The run cannot continue (too many consecutive non-finite steps, or a non-finite checkpoint)."""


def step_is_finite(grad_norm: float, loss_sums: Iterable[float]) -> bool:
    """Whether the step may update: the global grad norm and the globally summed losses are all finite.
    Inputs are all-reduced values, so every rank gets the same answer."""
    return math.isfinite(grad_norm) and all(math.isfinite(x) for x in loss_sums)


# --------------------------------------------------------------------------------------------------------------
# fault injection
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InjectSpec:
    step: int
    onward: bool  # every step from ``step`` on
    module: str
    rank: int | None = None
    where: str = "output"

    def fires_at(self, step: int) -> bool:
        return step >= self.step if self.onward else step == self.step


def injection_from_env(env: dict[str, str] | None = None) -> InjectSpec | None:
    """Parse ``K3TRAIN_INJECT_NAN`` (None when unset); a malformed value is a :class:`ConfigError`."""
    raw = (os.environ if env is None else env).get(INJECT_ENV, "").strip()
    if not raw:
        return None
    err = (f"{INJECT_ENV}={raw!r}: expected 'step=N[+],module=FQN[,rank=R][,where=output|grad]' "
           f"(e.g. 'step=2,rank=1,module=layers.3.attn')")
    kv: dict[str, str] = {}
    for part in raw.split(","):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in ("step", "rank", "module", "where") or k.strip() in kv:
            raise ConfigError(err)
        kv[k.strip()] = v.strip()
    if "step" not in kv or not kv.get("module") or kv.get("where", "output") not in ("output", "grad"):
        raise ConfigError(err)
    step_s = kv["step"]
    onward = step_s.endswith("+")
    try:
        step = int(step_s.rstrip("+"))
        rank = int(kv["rank"]) if "rank" in kv else None
    except ValueError:
        raise ConfigError(err) from None
    if step < 1 or (rank is not None and rank < 0):
        raise ConfigError(err)
    return InjectSpec(step=step, onward=onward, module=kv["module"], rank=rank, where=kv.get("where", "output"))


def _nan_like(x: Any) -> Any:
    """``x`` with every floating tensor (also inside tuples/lists/dataclasses) replaced by NaN."""
    if isinstance(x, torch.Tensor):
        return x * float("nan") if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_nan_like(v) for v in x)
    if hasattr(x, "__dataclass_fields__"):
        return type(x)(**{k: _nan_like(getattr(x, k)) for k in x.__dataclass_fields__})
    return x


class NaNInjector:
    """Forward hook that makes ``spec.module``'s output (or the gradient of its output) NaN at the spec's steps.
    Fires in every forward of those steps, re-runs included, so a diagnostic re-run sees the same fault."""

    def __init__(self, spec: InjectSpec, model: nn.Module) -> None:
        self.spec, self.step = spec, 0
        mods = dict(model.named_modules())
        if spec.module not in mods:
            held = sorted({n.split(".")[1] for n in mods if n.startswith("layers.") and n.count(".") == 1}, key=int)
            raise ConfigError(f"{INJECT_ENV}: module {spec.module!r} is not on this rank (its layers: {held})")
        self.handle = mods[spec.module].register_forward_hook(self._hook)
        log.warning("fault injection: NaN %s of %s at step %d%s", spec.where, spec.module, spec.step,
                    " and later" if spec.onward else "", extra={"rank_specific": True})  # only the injecting rank

    def _hook(self, mod: nn.Module, args: Any, out: Any) -> Any:
        if not mod.training or not self.spec.fires_at(self.step):  # training forwards only (not evaluation)
            return None
        if self.spec.where == "output":
            return _nan_like(out)
        for t in _float_tensors(out):
            if t.requires_grad:
                t.register_hook(lambda g: g * float("nan"))
        return None


# --------------------------------------------------------------------------------------------------------------
# diagnosis
# --------------------------------------------------------------------------------------------------------------
def _float_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _float_tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _float_tensors(v)]
    if hasattr(x, "__dataclass_fields__"):
        return [t for k in x.__dataclass_fields__ for t in _float_tensors(getattr(x, k))]
    return []


def _all_finite(ts: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for t in ts)


def _in_backward_pass() -> bool:
    return torch._C._current_graph_task_id() != -1


class FirstNonFinite:
    """Hooks on every submodule and parameter of ``model`` recording this rank's earliest non-finite event.

    Order key: ``(0, virtual stage, micro-batch, s, n)`` for a forward output, ``(1, -virtual stage, micro-batch,
    s, n)`` for a gradient (backward runs from the last stage down; ``s`` orders the vision encoder's own actions
    before stage 0's forward and after its backward), ``n`` the firing index within the runner's current
    action (``runner.current = (kind, virtual stage, micro-batch)``). Forward hooks fired by activation
    recomputation inside backward are ignored; a gradient hook goes on each tensor only at the first module that
    produced it (outputs passed through unchanged, e.g. earlier AttnRes blocks, keep their producer)."""

    def __init__(self, model: nn.Module, runner: Any) -> None:
        self.runner = runner
        self.best: tuple[tuple, str, str] | None = None  # (key, fqn, what)
        self._ctx: Any = None
        self._n = 0
        self._hooked: set[int] = set()
        self._keep: list[torch.Tensor] = []  # keeps hooked tensors alive so ids stay unique during the re-run
        self._handles = [m.register_forward_hook(functools.partial(self._on_output, name))
                         for name, m in model.named_modules() if name]
        self._handles += [p.register_hook(functools.partial(self._on_grad, name, "gradient of parameter"))
                          for name, p in model.named_parameters() if p.requires_grad]

    def _key(self, backward: bool) -> tuple:
        ctx = getattr(self.runner, "current", None) or ("F", 0, 0)
        if ctx != self._ctx:
            self._ctx, self._n = ctx, 0
        self._n += 1
        kind, v, mb = ctx
        # the vision encoder's own actions (EF/EB, parallel/pipeline/runner.py) feed / follow stage 0's F / B
        sub = int(kind == "EB") if backward else int(kind != "EF")
        return (1, -v, mb, sub, self._n) if backward else (0, v, mb, sub, self._n)

    def _record(self, key: tuple, ts: list[torch.Tensor], fqn: str, what: str) -> None:
        if (self.best is None or key < self.best[0]) and not _all_finite(ts):
            self.best = (key, fqn, what)

    def _on_output(self, fqn: str, mod: nn.Module, args: Any, out: Any) -> None:
        if _in_backward_pass():
            return
        ts = _float_tensors(out)
        self._record(self._key(False), ts, fqn, "forward output")
        for t in ts:
            if t.requires_grad and id(t) not in self._hooked:
                self._hooked.add(id(t))
                self._keep.append(t)
                t.register_hook(functools.partial(self._on_grad, fqn, "gradient of the output"))

    def _on_grad(self, fqn: str, what: str, g: torch.Tensor) -> None:
        if g is not None:
            self._record(self._key(True), [g], fqn, what)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._keep = [], []


def _tensors_of_state(state: Any, name: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """``(dotted name, local tensor)`` of every tensor in a nested dict (DTensor shards as their local part)."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors_of_state(v, f"{name}.{k}" if name else str(k))
    elif isinstance(state, torch.Tensor):
        yield name, state.to_local() if hasattr(state, "to_local") else state


class NonFiniteGuard:
    """The trainer's non-finite handling (see module docstring). ``model``/``runner``: this rank's stage."""

    def __init__(self, model: nn.Module, runner: Any, rank: int, max_skipped_steps: int,
                 comm_device: torch.device) -> None:
        self.model, self.runner, self.rank = model, runner, rank
        self.max_skipped, self.comm_device = max_skipped_steps, comm_device
        self.consecutive = 0
        spec = injection_from_env()
        self.injector = (NaNInjector(spec, model) if spec is not None and spec.rank in (None, rank)
                         and (spec.rank is not None or spec.module in dict(model.named_modules())) else None)

    def begin_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run (for fault injection)."""
        if self.injector is not None:
            self.injector.step = step

    def diagnose(self, run_step: Any) -> dict[str, Any]:
        """Re-run the step (``run_step()``: the same forward/backward) with recording hooks on every rank, then
        agree over the world on the earliest non-finite event. Collective (world). Returns
        ``{"module", "rank", "what", "stage", "micro_batch"}`` (``module`` None when the re-run was finite)."""
        rec = FirstNonFinite(self.model, self.runner)
        try:
            run_step()
        finally:
            rec.remove()
        mine = None if rec.best is None else (rec.best[0], rec.best[1], rec.best[2], self.rank)
        reports = [mine]
        if dist.is_initialized():
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, mine)
        found = [r for r in reports if r is not None]
        if not found:
            return {"module": None, "rank": None, "what": None, "stage": None, "micro_batch": None}
        key, fqn, what, rank = min(found, key=lambda r: (r[0], r[3]))
        return {"module": fqn, "rank": rank, "what": what, "stage": abs(key[1]), "micro_batch": key[2]}

    def after_step(self, step: int, skipped: bool, detail: str = "", report: dict[str, Any] | None = None) -> None:
        """Count consecutive skips and log one warning line per skipped step (rank 0)."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        if self.rank == 0:
            r = report or {}
            where = (f"first non-finite value: {r['what']} of {r['module']} on rank {r['rank']} (virtual stage "
                     f"{r['stage']}, micro-batch {r['micro_batch']})" if r.get("module")
                     else "the diagnostic re-run found no non-finite module output or gradient")
            log.warning("step %d: non-finite %s; %s; step skipped (%d in a row, limit train.max_skipped_steps=%d)",
                        step, detail, where, self.consecutive, self.max_skipped)

    def raise_if_exhausted(self, step: int) -> None:
        if self.consecutive >= self.max_skipped:
            raise TrainingStopped(f"stopping at step {step}: {self.consecutive} consecutive steps had a non-finite "
                                  f"loss or gradient (train.max_skipped_steps={self.max_skipped}); parameters are "
                                  f"those before the first skipped step, the last complete checkpoint is kept")

    def assert_finite_state(self, state: dict[str, Any], step: int) -> None:
        """Raise :class:`TrainingStopped` on every rank if any rank's checkpoint tensors hold a non-finite value
        (never write such a checkpoint). Collective (world) when distributed."""
        bad = next((name for name, t in _tensors_of_state(state)
                    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())), None)
        reports = [bad]
        if dist.is_initialized():
            flag = torch.tensor([0.0 if bad is None else 1.0], device=self.comm_device)
            dist.all_reduce(flag)
            if float(flag) == 0.0:
                return
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, bad)
        found = [(r, name) for r, name in enumerate(reports) if name is not None]
        if found:
            r, name = found[0]
            raise TrainingStopped(f"refusing to write the step {step} checkpoint: {name} holds non-finite values "
                                  f"on rank {r}; the last complete checkpoint is kept")
