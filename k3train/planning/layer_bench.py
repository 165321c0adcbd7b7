"""CPU calibration of one config: the real forward and backward time of every layer, and of every optimizer update.

On a CPU, models of CPU size (tiny, small) spend most of a step in framework overhead (hundreds of small ops per
layer), which no FLOP count predicts. So for ``--device cpu`` the planner times the project's own modules on real
tensors, one piece at a time, at the micro-batch shape of a layout, single rank, at the thread count a rank gets:

* the embedding, each backbone layer ``i`` (``K3Model.forward_layers(state, i, i + 1)`` from its canonical AttnRes
  input state, then autograd backward of its outputs), and the head (final AttnRes, norm, LM head, MTP:
  ``loss_sums``) -- at ``[micro_batch_size, seq_len / cp]`` tokens, routed experts sharded for ``ep`` as the rank
  holds them (the local expert shard computing the ``N*k`` routed rows, as MoonEP balances them); under context
  parallelism through KCP's and MLA-CP's own code for the last CP rank, collectives simulated locally;
* every parameter's optimizer update (``muon_step_`` / ``adamw_step_`` with its real shape and head split).

Communication is NOT in these times (no process group): the planner adds it from the gloo calibration. Results
are cached in the calibration file, keyed by the model section, shape, ep, dtype and thread count.

Isolated timings miss what the trainer does around them, and how much they miss depends on the host (a host with
a fast matmul shrinks the layers' times, not the Python and bookkeeping around them). So a plan also runs the real
trainer once per config on this host -- one process, the config's micro-batch, one micro-batch per step -- and
puts its phases beside its own prediction of that run (:class:`TrainerAnchor`): the forward + backward and the
optimizer step scale the isolated layer and update times, and the gradient-norm phase and the step's work outside
the phases are added to every layout's step.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3train.planning.devices import host_key, load_cache, median_time, save_cache


# bumped whenever what bench_layers runs changes, so a calibration file never serves times of an older method
# (2: EP layers through the real dispatcher, CP layers through KCP / MLA-CP; 3: the backward under recompute
# timed, fused AttnRes aggregation; 4: the KDA op keeps its solve for the backward; 5: EP set up by
# apply_expert_parallel, MoonEP layouts timed through MoonEP's own dispatcher; 6: MLA-CP balanced, head and token
# chunks; 7: the experts' weight gradients split from their input gradients, parallel.expert_wgrad_split)
LAYERS_VERSION = 7


def _key(cfg: Any, *parts: Any) -> str:
    import dataclasses

    model = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
    h = hashlib.sha1(model.encode()).hexdigest()[:12]
    return "|".join([h, cfg.train.dtype, *map(str, parts)])


def _time(fn, reps: int = 3) -> float:  # noqa: ANN001
    return median_time(fn, reps)


@dataclass
class _SimEPDims:
    """What :func:`moonep.shard.apply_expert_parallel` reads of a ``ParallelDims``, for rank 0 of a simulated EP
    group (:class:`k3train.planning.sim_collectives.SimGroup`)."""
    ep: int
    ep_rank: int = 0

    def group(self, name: str) -> Any:
        from k3train.planning.sim_collectives import SimGroup

        assert name == "ep", name
        return SimGroup(self.ep, self.ep_rank, "ep")

    def ranks(self, name: str) -> list[int]:
        assert name == "ep", name
        return list(range(self.ep))


def _model(cfg: Any, ep: int, moonep: bool = False) -> torch.nn.Module:
    from k3train.model.model import K3Model
    from k3train.parallelize import cast_params_to_bf16

    torch.manual_seed(0)
    m = K3Model(cfg.model, cfg.vision)
    if ep > 1:
        # the real expert-parallel set-up (moonep.shard.apply_expert_parallel: the dispatchers, their shared
        # token buffers and replica pool) on a simulated group: the collectives and MoonEP's point-to-point replica
        # transfers do the local work only (k3train.planning.sim_collectives; the planner's link model adds the
        # communication), so a timed layer holds the dispatcher's host work -- the routing-count exchange, the
        # MoonEP plan and token layout, the replica-pool fetches and the gradient reduce-back rounds, the index
        # shuffles around the all-to-alls
        from moonep.shard import apply_expert_parallel

        apply_expert_parallel(m, _SimEPDims(ep), moonep=moonep, separate_weight_group=False,
                              split_wgrad=cfg.parallel.expert_wgrad_split)
    if cfg.train.dtype == "bfloat16":
        cast_params_to_bf16([m])
    m.train()
    return m


def _cp_seq(cfg: Any, B: int, T: int) -> tuple[Any, Any]:
    """``(batch, seq)`` of the LAST context-parallel rank (the longest MLA context) with its real KCP context,
    built by every CP rank as threads (as the memory estimator does); its collectives are then simulated locally
    (:mod:`k3train.planning.sim_collectives`: the same shapes and work, no peers), so a timed layer runs KCP's
    and MLA-CP's own code -- the fold, the augmented pass, the halo -- with the communication left to the
    planner's link model."""
    from k3train.model.seq import SeqInfo
    from k3train.parallelize import seq_builder
    from k3train.planning.memory import _single_rank_cp, trace_batch
    from k3train.planning.sim_collectives import run_ranks, simulated_collectives

    C = cfg.parallel.cp
    row = [trace_batch(cfg, B, T, r)[0] for r in range(C)]
    with simulated_collectives():
        ctx_seq = run_ranks(C, lambda g: seq_builder(cfg, C, g)(row[g.rank]), "cp")[C - 1]
    seq = SeqInfo(ctx_seq.doc_ids, ctx_seq.positions, ctx_seq.cu_seqlens, _single_rank_cp(ctx_seq.cp, C - 1, C))
    return row[C - 1], seq


def bench_layers(cfg: Any, B: int, T: int, ep: int, threads: int, moonep: bool = False) -> dict[str, Any]:
    """``{'embed': [f, b, b_rc], 'layers': [[f, b, b_rc], ...], 'head': [f, b, b_rc]}`` seconds for one ``[B, T]``
    micro-batch, with MoonEP also ``'p2p_layers': [[calls, bytes] forward + [calls, bytes] backward, ...]`` and
    ``'p2p_head'`` (the point-to-point its dispatchers issued for one micro-batch: the link model charges them) (``b_rc``: the backward under ``parallel.recompute``, its re-run forward included)
    (``T`` = the rank's segment: ``seq_len / cp``; under ``cfg.parallel.cp > 1`` through the real KCP / MLA-CP
    code of the last CP rank, :func:`_cp_seq`; ``moonep``: the EP layers through MoonEP's dispatcher)."""
    import contextlib

    from k3train.model.attnres import AttnResState
    from k3train.model.seq import SeqInfo
    from k3train.planning.memory import trace_batch
    from k3train.planning.sim_collectives import simulated_collectives
    from parallel.pipeline.stage import run_maybe_recomputed

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    cp = cfg.parallel.cp > 1
    stack = contextlib.ExitStack()
    try:
        model = _model(cfg, ep, moonep)
        if cp:
            batch, seq = _cp_seq(cfg, B, T)
        else:
            batch, _ = trace_batch(cfg, B, T)
            seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
        p2p_log: list[tuple[int, int]] = []
        if cp or ep > 1:
            stack.enter_context(simulated_collectives(p2p_log))
        d, bs, L = cfg.model.hidden_size, cfg.model.attn_res_block_size, cfg.model.num_hidden_layers
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32

        def leaves(s: int) -> list[torch.Tensor]:
            g = torch.Generator().manual_seed(s)
            n = 1 + s // bs + (1 if s % bs else 0)
            return [torch.randn(B, T, d, generator=g, dtype=dtype).requires_grad_() for _ in range(n)]

        def state_of(lv: list[torch.Tensor], s: int) -> Any:
            nb = 1 + s // bs
            return AttnResState(blocks=list(lv[:nb]), partial=lv[nb] if s % bs else None)

        def roots_of(out: Any, s: int) -> list[torch.Tensor]:
            r = list(out.blocks[1 + s // bs:]) + ([out.partial] if out.partial is not None else [])
            return [t for t in r if t.requires_grad]

        def fb(fwd) -> tuple[float, float]:  # noqa: ANN001
            def f_only() -> None:
                with torch.no_grad():
                    fwd()

            def both() -> None:
                roots = fwd()
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                model.zero_grad(set_to_none=True)

            def both_rc() -> None:  # parallel.recompute: the forward under the runner's own checkpoint
                roots = run_maybe_recomputed(fwd, True)
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                model.zero_grad(set_to_none=True)

            tf = _time(f_only)
            # forward with autograd on, then backward: backward = total - forward (grad-mode forward is slower);
            # under recompute the backward re-runs the forward with autograd on, inside the checkpoint's hooks,
            # which costs more than the no-grad forward (tiny: 1.44x a step without recompute, not 1.24x)
            tfb = _time(both)
            tfb_rc = _time(both_rc)
            return tf, max(0.0, tfb - tf), max(0.0, tfb_rc - tf)

        def p2p_of(fwd) -> list[int]:  # noqa: ANN001
            """``[calls, bytes]`` of point-to-point in one forward, then in its backward (MoonEP's replica
            fetches and gradient reduce-back, as its dispatcher issues them for this micro-batch)."""
            p2p_log.clear()
            roots = fwd()
            f = [len(p2p_log), sum(b for _, b in p2p_log)]
            p2p_log.clear()
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
            model.zero_grad(set_to_none=True)
            return f + [len(p2p_log), sum(b for _, b in p2p_log)]

        def embed() -> list[torch.Tensor]:
            st = model.embed(batch.tokens)
            return [st.blocks[0]]

        out: dict[str, Any] = {"embed": list(fb(embed)), "layers": []}
        for i in range(L):
            lv = leaves(i)

            def layer(i: int = i, lv: list = lv) -> list[torch.Tensor]:
                return roots_of(model.forward_layers(state_of(lv, i), i, i + 1, seq), i)

            out["layers"].append(list(fb(layer)))
            if moonep and ep > 1:
                out.setdefault("p2p_layers", []).append(p2p_of(layer))
        lv = leaves(L)
        mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0

        def head() -> list[torch.Tensor]:
            o = model.loss_sums(state_of(lv, L), batch, seq)
            return [o["lm_loss_sum"] + mtp_w * o["mtp_loss_sum"]]

        out["head"] = list(fb(head))
        if moonep and ep > 1:
            out["p2p_head"] = p2p_of(head)  # the MTP layer's MoE
        return out
    finally:
        stack.close()
        torch.set_num_threads(old)


def bench_optimizer(cfg: Any, infos: list[Any], threads: int) -> dict[str, float]:
    """Seconds of one update per distinct parameter signature (``sig(info)`` -> s)."""
    from k3train.optim.muon import HParams, adamw_step_, muon_step_

    hp = HParams.from_config(cfg.optim, 1e-3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    try:
        for inf in infos:
            k = opt_sig(inf)
            if k in out:
                continue
            w = torch.randn(inf.param.shape)
            g, s1, s2 = torch.randn_like(w), torch.zeros_like(w), torch.zeros_like(w)
            step = torch.zeros(())
            if inf.kind == "muon":
                out[k] = _time(lambda: muon_step_(w, g, s1, hp, inf), 2)
            else:
                out[k] = _time(lambda: adamw_step_(w, g, s1, s2, step, hp, inf.decay), 2)
    finally:
        torch.set_num_threads(old)
    return out


def opt_sig(inf: Any) -> str:
    return f"{inf.kind}|{inf.layout}|{tuple(inf.param.shape)}|{inf.heads}|{tuple(inf.segments)}"


# the trainer anchor (k3train.planning.anchor): one process, one micro-batch per step, the real trainer and the
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
    from k3train.config import load_config

    mbs = [o for o in overrides if o.startswith("--train.micro_batch_size")]
    return load_config(config, mbs).train.micro_batch_size


class LayerTimes:
    """Cached per-config CPU timings (module docstring)."""

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
        import dataclasses

        from k3train.planning.step_time import ParamFacts

        B, T = self._anchor_shape(cfg)
        k = _key(cfg, f"anchor-v{ANCHOR_VERSION}", f"v{LAYERS_VERSION}", f"B={B}", f"T={T}", cfg.optim.name,
                 cfg.optim.ns_steps, cfg.optim.per_head_muon)
        if k in self._anchor:
            return self._anchor[k]
        slot = self.data.setdefault(self.host, {}).setdefault("anchor", {})
        if k not in slot:
            from k3train.planning.anchor import run_anchor

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
        (:func:`k3train.planning.anchor.concurrency_curve`; cached). Without a config (no anchor): None."""
        if self.config is None:
            return None
        B, T = self._anchor_shape(cfg)
        k = _key(cfg, f"trainer-v{ANCHOR_VERSION}", f"v{LAYERS_VERSION}", f"B={B}", f"T={T}", cfg.optim.name,
                 "lockstep")
        slot = self.data.setdefault(self.host, {}).setdefault("concurrency", {})
        if len(slot.get(k, {})) < procs:
            from k3train.planning.anchor import run_concurrency

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
