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
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from k3train.model.attnres import AttnResState
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from k3train.optim.muon import HParams, adamw_step_, muon_step_
from k3train.parallelize import cast_params_to_bf16
from k3train.planning.calibration.host import median_time
from k3train.planning.dtypes import train_dtype
from k3train.planning.fakerun.sim_collectives import SimGroup, simulated_collectives
from k3train.planning.fakerun.synthetic import cp_rank_seq, trace_batch
from k3train.planning.step_time.facts import opt_sig
from moonep.shard import apply_expert_parallel
from parallel.pipeline.stage import run_maybe_recomputed

# bumped whenever what bench_layers runs changes, so a calibration file never serves times of an older method
# (2: EP layers through the real dispatcher, CP layers through KCP / MLA-CP; 3: the backward under recompute
# timed, fused AttnRes aggregation; 4: the KDA op keeps its solve for the backward; 5: EP set up by
# apply_expert_parallel, MoonEP layouts timed through MoonEP's own dispatcher; 6: MLA-CP balanced, head and token
# chunks; 7: the experts' weight gradients split from their input gradients, parallel.expert_wgrad_split)
LAYERS_VERSION = 7


def _time(fn, reps: int = 3) -> float:  # noqa: ANN001
    return median_time(fn, reps)


@dataclass
class _SimEPDims:
    """What :func:`moonep.shard.apply_expert_parallel` reads of a ``ParallelDims``, for rank 0 of a simulated EP
    group (:class:`k3train.planning.fakerun.sim_collectives.SimGroup`)."""
    ep: int
    ep_rank: int = 0

    def group(self, name: str) -> Any:
        assert name == "ep", name
        return SimGroup(self.ep, self.ep_rank, "ep")

    def ranks(self, name: str) -> list[int]:
        assert name == "ep", name
        return list(range(self.ep))


def _model(cfg: Any, ep: int, moonep: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    m = K3Model(cfg.model, cfg.vision)
    if ep > 1:
        # the real expert-parallel set-up (moonep.shard.apply_expert_parallel: the dispatchers, their shared
        # token buffers and replica pool) on a simulated group: the collectives and MoonEP's point-to-point replica
        # transfers do the local work only (k3train.planning.fakerun.sim_collectives; the planner's link model adds the
        # communication), so a timed layer holds the dispatcher's host work -- the routing-count exchange, the
        # MoonEP plan and token layout, the replica-pool fetches and the gradient reduce-back rounds, the index
        # shuffles around the all-to-alls
        apply_expert_parallel(m, _SimEPDims(ep), moonep=moonep, separate_weight_group=False,
                              split_wgrad=cfg.parallel.expert_wgrad_split)
    if cfg.train.dtype == "bfloat16":
        cast_params_to_bf16([m])
    m.train()
    return m


def _cp_seq(cfg: Any, B: int, T: int) -> tuple[Any, Any]:
    """``(batch, seq)`` of the LAST context-parallel rank (the longest MLA context) with its real KCP context,
    built by every CP rank as threads (as the memory estimator does); its collectives are then simulated locally
    (:mod:`k3train.planning.fakerun.sim_collectives`: the same shapes and work, no peers), so a timed layer runs
    KCP's and MLA-CP's own code -- the fold, the augmented pass, the halo -- with the communication left to the
    planner's link model."""
    C = cfg.parallel.cp
    row = [trace_batch(cfg, B, T, r)[0] for r in range(C)]
    return row[C - 1], cp_rank_seq(cfg, row, C - 1)


def bench_layers(cfg: Any, B: int, T: int, ep: int, threads: int, moonep: bool = False) -> dict[str, Any]:
    """``{'embed': [f, b, b_rc], 'layers': [[f, b, b_rc], ...], 'head': [f, b, b_rc]}`` seconds for one ``[B, T]``
    micro-batch, with MoonEP also ``'p2p_layers': [[calls, bytes] forward + [calls, bytes] backward, ...]`` and
    ``'p2p_head'`` (the point-to-point its dispatchers issued for one micro-batch: the link model charges them) (``b_rc``: the backward under ``parallel.recompute``, its re-run forward included)
    (``T`` = the rank's segment: ``seq_len / cp``; under ``cfg.parallel.cp > 1`` through the real KCP / MLA-CP
    code of the last CP rank, :func:`_cp_seq`; ``moonep``: the EP layers through MoonEP's dispatcher)."""
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
        return _LayerBench(cfg, model, batch, seq, p2p_log).run(moonep and ep > 1)
    finally:
        stack.close()
        torch.set_num_threads(old)


class _LayerBench:
    """The timed pieces of :func:`bench_layers` on one model, micro-batch and sequence layout: each from its
    canonical AttnRes input state (random, seeded by the layer), forward alone, forward + backward, and forward +
    backward under the runner's recompute checkpoint."""

    def __init__(self, cfg: Any, model: torch.nn.Module, batch: Any, seq: Any, p2p_log: list[tuple[int, int]]) -> None:
        self.cfg, self.model, self.batch, self.seq, self.p2p_log = cfg, model, batch, seq, p2p_log
        self.B, self.T = batch.tokens.shape
        self.bs = cfg.model.attn_res_block_size

    def leaves(self, s: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(s)
        n = 1 + s // self.bs + (1 if s % self.bs else 0)
        d, dtype = self.cfg.model.hidden_size, train_dtype(self.cfg)
        return [torch.randn(self.B, self.T, d, generator=g, dtype=dtype).requires_grad_() for _ in range(n)]

    def state_of(self, lv: list[torch.Tensor], s: int) -> Any:
        nb = 1 + s // self.bs
        return AttnResState(blocks=list(lv[:nb]), partial=lv[nb] if s % self.bs else None)

    def roots_of(self, out: Any, s: int) -> list[torch.Tensor]:
        r = list(out.blocks[1 + s // self.bs:]) + ([out.partial] if out.partial is not None else [])
        return [t for t in r if t.requires_grad]

    def fb(self, fwd) -> tuple[float, float, float]:  # noqa: ANN001
        model = self.model

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

    def p2p_of(self, fwd) -> list[int]:  # noqa: ANN001
        """``[calls, bytes]`` of point-to-point in one forward, then in its backward (MoonEP's replica
        fetches and gradient reduce-back, as its dispatcher issues them for this micro-batch)."""
        log = self.p2p_log
        log.clear()
        roots = fwd()
        f = [len(log), sum(b for _, b in log)]
        log.clear()
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        self.model.zero_grad(set_to_none=True)
        return f + [len(log), sum(b for _, b in log)]

    def run(self, count_p2p: bool) -> dict[str, Any]:
        """The embedding, every layer, the head (``count_p2p``: and the point-to-point of each MoE layer)."""
        cfg, model, batch, seq = self.cfg, self.model, self.batch, self.seq
        L = cfg.model.num_hidden_layers

        def embed() -> list[torch.Tensor]:
            st = model.embed(batch.tokens)
            return [st.blocks[0]]

        out: dict[str, Any] = {"embed": list(self.fb(embed)), "layers": []}
        for i in range(L):
            lv = self.leaves(i)

            def layer(i: int = i, lv: list = lv) -> list[torch.Tensor]:
                return self.roots_of(model.forward_layers(self.state_of(lv, i), i, i + 1, seq), i)

            out["layers"].append(list(self.fb(layer)))
            if count_p2p:
                out.setdefault("p2p_layers", []).append(self.p2p_of(layer))
        lv = self.leaves(L)
        mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0

        def head() -> list[torch.Tensor]:
            o = model.loss_sums(self.state_of(lv, L), batch, seq)
            return [o["lm_loss_sum"] + mtp_w * o["mtp_loss_sum"]]

        out["head"] = list(self.fb(head))
        if count_p2p:
            out["p2p_head"] = self.p2p_of(head)  # the MTP layer's MoE
        return out


def bench_optimizer(cfg: Any, infos: list[Any], threads: int) -> dict[str, float]:
    """Seconds of one update per distinct parameter signature (``sig(info)`` -> s)."""
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
