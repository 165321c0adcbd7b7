"""Step runners: one training step's forward + backward over a list of micro-batches, on one rank.

``build_step_runner(model, cfg, dims)`` returns a :class:`LocalRunner` (pp = 1: plain gradient accumulation) or a
:class:`PipelineRunner` (pp > 1: the interleaved / 1F1B / AFAB schedule with cache-based AttnRes communication).
Both have the same interface:

    runner.modules                      [the rank's (pruned) model]  -- all chunks live in one module, full FQNs
    runner.chunks                       [(start, end)] layer range of each local chunk
    runner.chunk_params                 [[Parameter]] per local chunk (+ runner.shared_params: the MTP-shared
                                        embedding copy, reduced over the ``embd`` group at the end of the step)
    runner.replica_params               the last stage's copy of the shared embedding (exclude from grad norms)
    runner.on_chunk_backward_done       None or callable(params: list[Parameter]); called once per step for
                                        every group of parameters as soon as their gradients are final (the
                                        last micro-batch's backward of that chunk; the shared embedding after
                                        its cross-stage sum) -- Pipeline ZeRO-2: ``optimizer.reduce_chunk_grads``
    runner.forward_backward(micro_batches, norm) -> dict   (gradients accumulate into .grad)
    runner.forward_only(micro_batches, norm) -> dict       (evaluation: forward actions only, under no_grad;
                                                            the same loss statistics, no gradients, no hooks)
    runner.forward_only(micro_batches, norm, head=fn)      (the same forward actions; the last stage computes
                                                            ``fn(state, batch, seq) -> sums`` instead of
                                                            ``model.loss_sums``: a frozen model's pipeline under
                                                            a head of its own, e.g. the EAGLE-3 draft, which may
                                                            run its own forward + backward there)
    runner.current                      (kind 'F'|'B'|'EF'|'EB', virtual stage, micro-batch) of the compute
                                        running now (for diagnostic hooks, see k3train/runtime/nonfinite.py; the main
                                        thread's: a paired forward is not reported)
    runner.pair                         None, or the :class:`parallel.pairing.PairExecutor` of F/B pairing
                                        (``parallel.overlap_ep``): ``forward_backward`` runs a forward on its
                                        worker thread (side 1) while a backward of another micro-batch runs here
                                        (side 0) -- pp = 1: F(m+1) with B(m); pp > 1: adjacent F/B computes of
                                        the program (p2p_programs.pair_programs); ``with runner.unpaired():``
                                        runs the plain order (the non-finite diagnosis re-run)

Vision encoder (a vision model at pp > 1, ``parallel.encoder_schedule``): ``inline`` runs it inside the first
stage's forward (``embed_batch``) and its backward inside that stage's backward. ``bubbles`` / ``before`` give it
actions of its own on the first stage's rank (parallel/pipeline/schedules.py: ``place_encoder``, from static
costs: the partition's stage FLOPs and the micro-batch's media shapes): ``EF(m)`` runs ``encode_batch`` and keeps
the output, ``F(0, m)`` embeds a detached leaf copy of it (so ``B(0, m)`` stops there), ``EB(m)`` back-propagates
the leaf's gradient through the encoder. The chunk hook of the chunk holding the encoder fires after its last
``B`` and the last ``EB``; a forward-only pass runs each ``EF`` before its ``F``. The step stats' ``encoder_s``:
seconds in encoder actions (0 when inline). The encoder's activations (only its blocks' inputs under
``parallel.recompute``) live from ``EF(m)`` to ``EB(m)``.

Gradients after ``forward_backward`` are this rank's contributions to the global-batch mean loss (LossNorm);
the data-parallel reduction is the optimizer's job.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from k3train.model.attnres import AttnResState
from k3train.model.flops import vision_flops
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from k3train.runtime.fault_injection import raise_point
from parallel.comm_stats import ByteCounter
from parallel.pairing import PairExecutor
from parallel.pipeline.attnres_comm import AttnResCommPlan, BlockCache, StageInput
from parallel.pipeline.loss_norm import LossNorm
from parallel.pipeline.p2p import Instr, P2PTransport, build_programs
from parallel.pipeline.p2p_programs import insert_encoder_computes, pair_programs
from parallel.pipeline.partition import PipelinePartition, build_partition, describe_partition
from parallel.pipeline.schedules import (
    Action,
    Message,
    build_schedule,
    forward_only_schedule,
    place_encoder,
    resolve_schedule,
    simulate,
    theoretical_bubble,
)
from parallel.pipeline.stage import (
    build_stage_model,
    chunk_param_groups,
    recompute_chunk,
    recompute_unit,
    run_maybe_recomputed,
    shares_embedding,
)

log = logging.getLogger(__name__)

STAT_KEYS = ("lm_loss_sum", "mtp_loss_sum", "lm_tokens", "mtp_tokens")


def default_make_seq(batch: Any) -> Any:
    """``SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)`` (no context parallelism)."""
    return SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)


def _default_state_cls() -> type:
    return AttnResState


class StepRunner:
    """Shared parts of the runners (see module docstring)."""

    def __init__(self, model: nn.Module, cfg: Any, dims: Any, partition: PipelinePartition,
                 make_seq: Callable[[Any], Any], on_chunk_backward_done: Callable[[list[nn.Parameter]], None] | None,
                 recompute: bool) -> None:
        self.model, self.cfg, self.dims, self.partition = model, cfg, dims, partition
        self.modules: list[nn.Module] = [model]
        self.pp_rank = dims.pp_rank if partition.pp > 1 else 0
        self.chunks: list[tuple[int, int]] = partition.local_chunks(self.pp_rank)
        self.make_seq, self.on_chunk_backward_done, self.recompute = make_seq, on_chunk_backward_done, recompute
        if getattr(model, "vision", None) is not None:  # parallel.recompute: every ViT block checkpointed too
            model.vision.encoder.recompute_blocks = recompute
        # what is recomputed at once (parallel.recompute_granularity): a whole chunk here (run_maybe_recomputed),
        # or each layer / sublayer inside the model (K3Model.set_recompute)
        self.recompute_chunk = recompute_chunk(cfg, recompute)
        if hasattr(model, "set_recompute"):
            model.set_recompute(recompute_unit(cfg, recompute))
        self.counter = ByteCounter()
        self.shared_embedding = shares_embedding(model, partition)
        self.refresh_params()
        # copies of a parameter another stage also holds (the last stage's embedding copy): count them once in
        # a global gradient norm and save them once in checkpoints
        self.replica_params: list[nn.Parameter] = (list(self.shared_params)
                                                   if self.shared_embedding
                                                   and self.pp_rank == partition.placement.last_rank
                                                   else [])
        self.last_stats: dict[str, Any] = {}
        self.current: tuple[str, int, int] | None = None
        self.pair: PairExecutor | None = None
        self._head: Callable[[Any, Any, Any], dict[str, torch.Tensor]] | None = None  # forward_only(head=)

    def refresh_params(self) -> None:
        """Recompute ``chunk_params`` / ``shared_params`` from the model (called every step: expert parallelism
        replaces the routed-expert parameters after the runner is built)."""
        self.chunk_params, self.shared_params = chunk_param_groups(self.model, self.partition, self.pp_rank,
                                                                   self.shared_embedding)

    def sync_replica_weights(self) -> None:
        """Copy the shared embedding from the first stage to the last stage's replica (broadcast over ``embd``;
        e.g. after loading a checkpoint that saved it once). Call on every rank; a no-op without a replica."""
        group = self.dims.group("embd") if self.shared_embedding else None
        if group is None:
            return
        src = self.dims.ranks("embd")[0]
        with torch.no_grad():
            for p in self.shared_params:
                dist.broadcast(p.data, src=src, group=group)

    def enable_pairing(self, rank: int) -> None:
        """Pair the forward of micro-batch m+1 with the backward of micro-batch m (``parallel.overlap_ep``; the
        communicating modules must have side-1 resources: ``apply_expert_parallel(..., paired=True)``)."""
        if self.pair is None:
            self.pair = PairExecutor(rank)

    @contextlib.contextmanager
    def unpaired(self) -> Any:
        """Run the block's steps without F/B pairing (same results, one thread)."""
        pair, self.pair = self.pair, None
        try:
            yield
        finally:
            self.pair = pair

    def _hook(self, params: list[nn.Parameter]) -> None:
        if self.on_chunk_backward_done is not None and params:
            self.on_chunk_backward_done(params)

    def _new_stats(self) -> dict[str, Any]:
        # recv_wait_s: seconds blocked waiting for p2p receives (PipelineRunner; 0 without a pipeline);
        # encoder_s: seconds in the vision encoder's own actions (PipelineRunner, encoder_schedule != inline)
        return {k: 0.0 for k in STAT_KEYS} | {"loss": 0.0, "compute_s": 0.0, "recv_wait_s": 0.0, "encoder_s": 0.0}

    def _last_stage(self, state: Any, batch: Any, seq: Any) -> dict[str, torch.Tensor]:
        """What the last stage computes from the final state: ``model.loss_sums``, or forward_only's ``head``."""
        if self._head is not None:
            return self._head(state, batch, seq)
        return self.model.loss_sums(state, batch, seq)

    @staticmethod
    def _add_sums(stats: dict[str, Any], sums: dict[str, torch.Tensor], loss: torch.Tensor) -> None:
        # detached tensors (no device sync per micro-batch); converted by _finish_sums (a vector sum to a list)
        for k, v in sums.items():
            stats[k] = stats.get(k, 0.0) + v.detach().float()
        stats["loss"] = stats["loss"] + loss.detach().float()

    @staticmethod
    def _finish_sums(stats: dict[str, Any]) -> None:
        for k, v in stats.items():
            if isinstance(v, torch.Tensor):
                stats[k] = float(v) if v.dim() == 0 else v.tolist()

    def forward_backward(self, micro_batches: list[Any], norm: LossNorm) -> dict[str, Any]:
        raise NotImplementedError

    def forward_only(self, micro_batches: list[Any], norm: LossNorm) -> dict[str, Any]:
        raise NotImplementedError


class LocalRunner(StepRunner):
    """pp = 1: gradient accumulation over the micro-batches through the same interface."""

    def forward_backward(self, micro_batches: list[Any], norm: LossNorm) -> dict[str, Any]:
        """Forward + backward of every micro-batch on the whole model. Returns the summed loss statistics.
        With :attr:`pair`: F(0), then F(m+1) paired with B(m) for every m, then B(M-1) (the same gradient and
        statistics accumulation order as unpaired)."""
        t_step = time.perf_counter()
        stats = self._new_stats()
        self.counter.reset()
        self.refresh_params()
        if self.pair is not None and len(micro_batches) > 1:
            self._paired(micro_batches, norm, stats)
        else:
            for mb, batch in enumerate(micro_batches):
                self.current = ("F", 0, mb)
                sums, loss = self._forward_micro_batch(batch, norm)
                self.current = ("B", 0, mb)
                loss.backward()
                self._add_sums(stats, sums, loss)
        self.current = None
        for params in self.chunk_params:
            self._hook(params)
        self._finish_sums(stats)
        stats.update(self.counter.as_stats())
        stats["compute_s"] = stats["step_s"] = time.perf_counter() - t_step
        self.last_stats = stats
        return stats

    def _forward_micro_batch(self, batch: Any, norm: LossNorm) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        seq = self.make_seq(batch)  # outside recomputation: under CP it builds a collective context
        sums = run_maybe_recomputed(functools.partial(self._run, batch, seq), self.recompute_chunk)
        return sums, norm(sums)

    def _paired(self, micro_batches: list[Any], norm: LossNorm, stats: dict[str, Any]) -> None:
        """F(0); F(m+1) on the pair worker (side 1) while B(m) runs here (side 0); B(M-1) (see :attr:`pair`)."""
        def forward(mb: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            raise_point("pair_forward", mb)
            return self._forward_micro_batch(micro_batches[mb], norm)

        def backward(mb: int, loss: torch.Tensor) -> None:
            raise_point("pair_backward", mb)
            loss.backward()

        self.current = ("F", 0, 0)
        sums, loss = self._forward_micro_batch(micro_batches[0], norm)
        last = len(micro_batches) - 1
        for mb in range(last + 1):
            self.current = ("B", 0, mb)
            if mb < last:
                nxt, _ = self.pair.run(functools.partial(forward, mb + 1), functools.partial(backward, mb, loss),
                                       f"forward of micro-batch {mb + 1}", f"backward of micro-batch {mb}")
            else:
                loss.backward()
                nxt = None
            self._add_sums(stats, sums, loss)
            if nxt is not None:
                sums, loss = nxt

    def _run(self, batch: Any, seq: Any) -> dict[str, torch.Tensor]:
        state = self.model.forward_layers(self.model.embed_batch(batch), 0, self.partition.num_layers, seq)
        return self._last_stage(state, batch, seq)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Any], norm: Any, head: Callable[..., Any] | None = None
                     ) -> dict[str, Any]:
        """Loss statistics of every micro-batch, forward only (evaluation; ``head``: module docstring)."""
        stats = self._new_stats()
        self.refresh_params()
        self._head = head
        try:
            for mb, batch in enumerate(micro_batches):
                self.current = ("F", 0, mb)
                sums = self._run(batch, self.make_seq(batch))
                self._add_sums(stats, sums, norm(sums))
        finally:
            self._head = None
        self.current = None
        self._finish_sums(stats)
        return stats


class PipelineRunner(StepRunner):
    """pp > 1: runs this rank's program (schedule + p2p posts), see parallel/pipeline/p2p.py."""

    def __init__(self, *args: Any, schedule: str, attnres_comm: str, wire_dtype: torch.dtype,
                 state_cls: type, post_ahead: bool = True, encoder_schedule: str = "inline", **kw: Any) -> None:
        super().__init__(*args, **kw)
        part, dims = self.partition, self.dims
        self.schedule, self.wire_dtype, self.state_cls = schedule, wire_dtype, state_cls
        self.placement = part.placement
        # the first stage's rank of a vision model runs the encoder as actions of its own (module docstring)
        self.encoder_schedule = (encoder_schedule if getattr(self.model, "vision", None) is not None
                                 and self.pp_rank == self.placement.first_rank else "inline")
        self._placed: dict[tuple, tuple[list[Action], list[Instr], float]] = {}  # encoder placements (LRU)
        # receives posted one compute ahead of their consumer (p2p_programs.py); False: the time-ordered posts
        self.post_ahead = post_ahead
        self.plan = AttnResCommPlan(part, attnres_comm)
        self.n_stages = part.num_stages
        self.hidden = self.cfg.model.hidden_size
        max_items = 2 + part.num_layers // part.block_size + 1
        self.p2p = P2PTransport(dims.ranks("pp"), part.pp, self.n_stages - 1, max_items, self.counter,
                                placement=self.placement)
        self.embd_group = dims.group("embd") if self.shared_embedding else None
        self._programs: dict[tuple[int, bool, bool, bool], tuple[list[Action], list[Instr], float]] = {}
        # the first compute of each pair -> the number of its trailing posts (p2p_programs.pair_programs)
        self._pair_firsts: dict[tuple[int, bool, bool, bool], dict[Action, int]] = {}
        self.device = next(self.model.parameters()).device
        self._forward_only = False  # set per step by begin_step

    # ---------------------------------------------------------------------------------------------------------
    def program(self, num_microbatches: int, forward_only: bool = False,
                micro_batches: list[Any] | None = None) -> tuple[list[Action], list[Instr], float]:
        """``(actions, program, simulated bubble)`` of this rank for ``num_microbatches`` (cached).
        ``forward_only``: the schedule's forward actions in their order (evaluation), see
        :func:`schedules.forward_only_schedule`. With encoder actions (module docstring) the first rank's
        program depends on the ``micro_batches``' media shapes too."""
        actions, program, bubble = self._fb_program(num_microbatches, forward_only)
        if self.encoder_schedule == "inline":
            return actions, program, bubble
        # (paired programs: an encoder compute put between the two computes of a pair just unpairs them)
        if micro_batches is None or len(micro_batches) != num_microbatches:
            raise ValueError("program(): the encoder placement needs the step's micro-batches")
        f, b, ef, eb = self.encoder_costs(micro_batches)
        key = (num_microbatches, forward_only, self.post_ahead, self._paired_programs(forward_only), tuple(ef),
               tuple(eb))
        if key not in self._placed:
            pp, vpp = self.partition.pp, self.partition.vpp
            sched = build_schedule(self.schedule, pp, vpp, num_microbatches, self._paired_programs(forward_only))
            if forward_only:
                sched = forward_only_schedule(sched)
            placed = place_encoder(sched, pp, vpp, f, b, ef, eb, self.encoder_schedule)[self.pp_rank]
            if len(self._placed) >= 64:  # media shapes vary from step to step: keep the latest few
                self._placed.pop(next(iter(self._placed)))
            self._placed[key] = (placed, insert_encoder_computes([program], [placed])[0], bubble)
        return self._placed[key]

    def encoder_costs(self, micro_batches: list[Any]) -> tuple[list[float], list[float], list[float], list[float]]:
        """Static costs the encoder placement uses, in forward-FLOPs of this rank for one micro-batch: per virtual
        stage (the partition's FLOPs per token x the micro-batch's tokens), and per micro-batch the vision
        tower's (:func:`k3train.model.flops.vision_flops` of its media; ``/ cp`` when ``batch.vision_cp`` shares
        the encoding over the CP group). Backward = 2 x forward (3 x under ``parallel.recompute``). Only shapes
        enter, so the first stage's CP ranks (same media, same slice length) agree on the placement."""
        vcfg, d = self.model.vision_cfg, self.cfg.model.hidden_size
        k = 3.0 if self.recompute else 2.0
        tokens = float(micro_batches[0].tokens.numel())
        f = [c * tokens for c in (self.partition.stage_costs or [1.0] * self.n_stages)]
        ef = []
        for batch in micro_batches:
            media = getattr(batch, "media", None)
            grids = media.grid_thw.tolist() if media is not None else []
            share = self.dims.cp if getattr(batch, "vision_cp", None) is not None else 1
            ef.append(float(sum(vision_flops(g, vcfg, d) for g in grids)) / share)
        return f, [k * x for x in f], ef, [k * x for x in ef]

    def _fb_program(self, num_microbatches: int, forward_only: bool) -> tuple[list[Action], list[Instr], float]:
        """The F/B schedule's ``(actions, program, bubble)`` of this rank (cached)."""
        paired = self._paired_programs(forward_only)
        key = (num_microbatches, forward_only, self.post_ahead, paired)
        if key not in self._programs:
            pp, vpp = self.partition.pp, self.partition.vpp
            sched = build_schedule(self.schedule, pp, vpp, num_microbatches, paired)
            if forward_only:
                sched = forward_only_schedule(sched)
            sim = simulate(sched, pp, vpp)
            programs = build_programs(sched, pp, vpp, sim, post_ahead=self.post_ahead)
            if paired:  # F/B pairing: adjacent F/B computes run together (every rank derives the same pairs)
                programs, firsts = pair_programs(programs, pp, vpp)
                self._pair_firsts[key] = firsts[self.pp_rank]
            self._programs[key] = (sched[self.pp_rank], programs[self.pp_rank], sim.bubble)
            if self.dims.rank == 0 and not forward_only:
                # the log's bubble from the partition table's stage costs (the program above is unchanged)
                costs = self.partition.stage_costs or [1.0] * (pp * vpp)
                unit = sum(costs) / len(costs) or 1.0
                real = simulate(sched, pp, vpp, [c / unit for c in costs], [2 * c / unit for c in costs]).bubble
                log.info("pipeline schedule %s: pp=%d vpp=%d M=%d; expected bubble %.3f (simulated with the "
                         "partition's stage costs, backward = 2 x forward; equal stages would give %.3f = "
                         "(pp-1)/(vpp*M+pp-1))", self.schedule, pp, vpp, num_microbatches, real,
                         theoretical_bubble(pp, vpp, num_microbatches))
        return self._programs[key]

    def _paired_programs(self, forward_only: bool) -> bool:
        return self.pair is not None and not forward_only

    def _specs(self, msg: Message, batches: list[Any]) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], list[str]]:
        B, T = batches[msg.mb].tokens.shape[:2]
        items = self.plan.payload(msg.stage).items()
        specs = [((B, T, self.hidden), self.wire_dtype)] * len(items)
        kinds = (["hidden" if it == "partial" else "block_cache" for it in items] if msg.kind == "act"
                 else ["grad"] * len(items))
        return specs, kinds

    # ---------------------------------------------------------------------------------------------------------
    def forward_backward(self, micro_batches: list[Any], norm: LossNorm) -> dict[str, Any]:
        """One step of the pipeline schedule over ``micro_batches`` (the same list on every pipeline rank of this
        pipeline: every stage needs the sequence layout, the last stage the labels). Collectives: p2p on the
        default group between this pipeline's ranks; an all-reduce over ``embd`` when the MTP shares the
        embedding. Returns this rank's stats (loss sums are non-zero on the last stage only) and p2p bytes."""
        program = self.begin_step(micro_batches, norm)
        firsts = self._pair_firsts.get((len(micro_batches), False, self.post_ahead, True), {})
        i = 0
        while i < len(program):
            ins = program[i]
            if (ins.op == "compute" and ins.action in firsts and i + 1 < len(program)
                    and program[i + 1].op == "compute"):
                n = firsts[ins.action]  # x's trailing posts: right after y in the paired program
                self.run_pair(ins.action, program[i + 1].action, program[i + 2:i + 2 + n])
                i += 2 + n
            else:
                self.run_instr(ins)
                i += 1
        return self.end_step()

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Any], norm: Any, head: Callable[..., Any] | None = None
                     ) -> dict[str, Any]:
        """Forward actions of the schedule only (evaluation): the same activation p2p between the same ranks,
        nothing saved for backward, no gradient messages, no embedding all-reduce. Every pipeline rank must
        call it with the same micro-batch count. Returns the loss statistics (non-zero on the last stage).
        ``head``: what the last stage computes instead of ``model.loss_sums`` (module docstring)."""
        program = self.begin_step(micro_batches, norm, forward_only=True)
        self._head = head
        try:
            for ins in program:
                self.run_instr(ins)
        finally:
            self._head = None
        return self.end_step(sync_shared=False)

    # The step in three parts, so that a test can interleave the programs of several ranks in one process.
    def begin_step(self, micro_batches: list[Any], norm: LossNorm, forward_only: bool = False) -> list[Instr]:
        """Reset per-step state; returns this rank's program for ``len(micro_batches)``."""
        self._t_step = time.perf_counter()
        self._forward_only = forward_only
        self.counter.reset()
        self.p2p.wait_s = 0.0
        self.refresh_params()
        self._batches, self._norm = micro_batches, norm
        self._seqs = [self.make_seq(b) for b in micro_batches]  # (may attach batch.vision_cp: before the costs)
        actions, program, _ = self.program(len(micro_batches), forward_only, micro_batches)
        self._stats = self._new_stats()
        # a chunk's gradients are final after its last B; the encoder's (first chunk) also after the last EB
        last: dict[int, int] = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
        last_eb = [i for i, a in enumerate(actions) if a.kind == "EB"]
        if last_eb:
            c0 = self.placement.chunk_of(0)
            last[c0] = max(last[c0], last_eb[-1])
        self._hook_after = {i: c for c, i in last.items()}
        self._idx_of = {a: i for i, a in enumerate(actions)}
        self._enc_out: dict[int, torch.Tensor] = {}  # EF output, until EB (forward-only: until F)
        self._enc_leaf: dict[int, torch.Tensor] = {}  # the detached copy F(0, m) embedded, until EB
        self._cache = BlockCache(self.plan, self.pp_rank)
        self._saved: dict[tuple[int, int], tuple[StageInput | None, Any]] = {}
        self._outbox: dict[Message, list[torch.Tensor]] = {}
        # (action, seconds computing: its receive waits excluded) of this step, in order, for benchmarks
        self.action_times: list[tuple[Action, float]] = []
        return program

    def run_instr(self, ins: Instr) -> None:
        """Execute one program instruction (post a receive, post a send, or run a forward/backward)."""
        if ins.op == "recv":
            specs, kinds = self._specs(ins.msg, self._batches)
            self.p2p.post_recv(ins.msg, specs, kinds, self.device)
        elif ins.op == "send":
            _, kinds = self._specs(ins.msg, self._batches)
            self.p2p.send(ins.msg, [t.to(self.wire_dtype) for t in self._outbox.pop(ins.msg)], kinds)
        else:
            a = ins.action
            if not a.is_encoder:  # encoder computes take no part in the p2p rules (p2p_programs.py)
                # sends get one compute of slack to complete before their buffers are waited for and released
                self.p2p.complete_sends(self.p2p.generation - 1)
                self.p2p.generation += 1
            t0, w0 = time.perf_counter(), self.p2p.wait_s
            self.current = (a.kind, self.placement.stage(self.pp_rank, a.chunk), a.mb)
            if a.kind == "F":
                self._forward(a)
            elif a.kind == "B":
                self._backward(a)
            elif a.kind == "EF":
                self._encoder_forward(a)
            else:
                self._encoder_backward(a)
            dt = time.perf_counter() - t0
            self._stats["compute_s"] += dt
            if a.is_encoder:
                self._stats["encoder_s"] += dt
            self.action_times.append((a, dt - (self.p2p.wait_s - w0)))  # without the time blocked on receives
            chunk = self._hook_after.get(self._idx_of[a])
            if chunk is not None:
                self._hook(list(self.chunk_params[chunk]))

    def run_pair(self, x: Action, y: Action, x_posts: list[Instr] = ()) -> None:
        """Run the adjacent computes ``x`` then ``y`` of the program as one paired action (:attr:`pair`): the F on
        the pair worker (side 1), the B here (side 0); hooks as after ``x`` then ``y``. ``x_posts``: ``x``'s
        trailing sends / receives (p2p_programs.pair_programs), posted by ``x``'s thread as soon as ``x``
        computed, while ``y`` may still run -- so the stage that waits for ``x``'s output does not wait for
        ``y`` too. They are the only posts during the pair (``y``'s come after it, from this thread), so this
        rank's sequence of p2p posts is the program's, whichever side ends first (P2PTransport is locked)."""
        if any(ins.op == "compute" for ins in x_posts):
            raise RuntimeError(f"run_pair: x's trailing posts hold a compute: {x_posts}")

        for _ in (x, y):  # the send-completion rule of two computes (p2p_programs.py), before both start
            self.p2p.complete_sends(self.p2p.generation - 1)
            self.p2p.generation += 1
        f, b = (x, y) if x.kind == "F" else (y, x)
        vf, vb = (self.placement.stage(self.pp_rank, a.chunk) for a in (f, b))
        t0, w0 = time.perf_counter(), self.p2p.wait_s
        self.current = ("B", vb, b.mb)

        def forward() -> None:
            raise_point("pair_forward", f.mb)
            self._forward(f)
            if f is x:
                for ins in x_posts:
                    self.run_instr(ins)

        def backward() -> None:
            raise_point("pair_backward", b.mb)
            self._backward(b)
            if b is x:
                for ins in x_posts:
                    self.run_instr(ins)

        self.pair.run(forward, backward, f"forward of micro-batch {f.mb} (virtual stage {vf})",
                      f"backward of micro-batch {b.mb} (virtual stage {vb})")
        dt = time.perf_counter() - t0
        self._stats["compute_s"] += dt
        for a in (x, y):  # half of the pair's time each (receive waits excluded)
            self.action_times.append((a, (dt - (self.p2p.wait_s - w0)) / 2))
        for a in (x, y):
            chunk = self._hook_after.get(self._idx_of[a])
            if chunk is not None:
                self._hook(list(self.chunk_params[chunk]))

    def end_step(self, sync_shared: bool = True) -> dict[str, Any]:
        """Wait for outstanding sends, check nothing leaked, sum the shared embedding's gradient copies
        (``sync_shared``), release them to the hook; returns the step's stats."""
        self.p2p.finish()
        if self._saved or self._outbox or self._enc_out or self._enc_leaf:
            raise RuntimeError(f"pipeline step left state behind: saved {sorted(self._saved)}, "
                               f"outbox {sorted(self._outbox)}, encoder outputs {sorted(self._enc_out)}, "
                               f"encoder leaves {sorted(self._enc_leaf)}")
        self._cache.check_empty()
        if sync_shared:
            self.sync_shared_embedding()
        stats = self._stats
        self._finish_sums(stats)
        stats.update(self.counter.as_stats())
        stats["recv_wait_s"] = self.p2p.wait_s
        stats["step_s"] = time.perf_counter() - self._t_step
        self.last_stats = stats
        self._batches, self._seqs, self._norm = [], [], None
        self.current = None
        return stats

    def _forward(self, a: Action) -> None:
        cache, saved, outbox, stats = self._cache, self._saved, self._outbox, self._stats
        batches, seqs, norm = self._batches, self._seqs, self._norm
        v = self.placement.stage(self.pp_rank, a.chunk)
        s, e = self.partition.bounds[v]
        first, last = self.placement.is_first(v), self.placement.is_last(v)
        batch, seq = batches[a.mb], seqs[a.mb]
        inp = None if first else cache.build_input(a.chunk, a.mb, self.p2p.wait(Message("act", v - 1, a.mb)))
        model = self.model
        leaf = None
        if first and self.encoder_schedule != "inline":  # embed EF(m)'s output through a leaf: B stops there
            enc = self._enc_out.pop(a.mb) if self._forward_only else self._enc_out[a.mb]
            leaf = enc.detach().requires_grad_(enc.requires_grad)
            if not self._forward_only:
                self._enc_leaf[a.mb] = leaf

        def run() -> Any:
            # the first stage embeds (a vision model, inline: the encoder on batch.media runs here, so its backward
            # runs inside this stage's backward; its parameters are this chunk's in every mode)
            if first:
                state = (model.embed(batch.tokens, media_embeds=leaf) if leaf is not None
                         else model.embed_batch(batch))
            else:
                state = self.state_cls(blocks=list(inp.blocks), partial=inp.partial)
            state = model.forward_layers(state, s, e, seq)
            return self._last_stage(state, batch, seq) if last else state

        out = run_maybe_recomputed(run, self.recompute_chunk)
        if last:
            loss = norm(out)
            self._add_sums(stats, out, loss)
            cache.after_forward(a.chunk, a.mb, [])  # the last chunk: frees this micro-batch's cache entry
            if not self._forward_only:
                saved[(a.chunk, a.mb)] = (inp, loss)
        else:
            outbox[Message("act", v, a.mb)] = cache.outgoing(v, out.blocks, out.partial)
            cache.after_forward(a.chunk, a.mb, out.blocks)
            if not self._forward_only:
                saved[(a.chunk, a.mb)] = (inp, out)

    def _backward(self, a: Action) -> None:
        cache, saved, outbox = self._cache, self._saved, self._outbox
        v = self.placement.stage(self.pp_rank, a.chunk)
        inp, out = saved.pop((a.chunk, a.mb))
        if self.placement.is_last(v):
            roots, grads = [out], [None]
        else:
            received = self.p2p.wait(Message("grad", v, a.mb))
            roots, grads = cache.output_grads(a.chunk, a.mb, out.blocks, out.partial, received)
        if roots:
            torch.autograd.backward(roots, grads)
        if inp is not None:
            outbox[Message("grad", v - 1, a.mb)] = cache.input_grads(a.chunk, a.mb, inp)

    def _encoder_forward(self, a: Action) -> None:
        """``EF(m)``: the vision tower on micro-batch ``m``'s media. Under ``parallel.recompute`` every ViT block
        checkpoints itself (``recompute_blocks``), so only the block inputs live until ``EB(m)``; wrapping the
        whole tower in a checkpoint as well would run its forward three times."""
        self._enc_out[a.mb] = self.model.encode_batch(self._batches[a.mb])

    def _encoder_backward(self, a: Action) -> None:
        """``EB(m)``: the gradient ``B(0, m)`` left on the embedded leaf, back through the encoder (zeros when
        none reached it, so the encoder's backward -- and any collective in it -- runs for every micro-batch)."""
        out, leaf = self._enc_out.pop(a.mb), self._enc_leaf.pop(a.mb)
        if out.requires_grad:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(out)
            torch.autograd.backward([out], [grad])

    def sync_shared_embedding(self, all_reduce: bool = True) -> None:
        """Sum the two copies' gradients of the MTP-shared embedding (first + last stage) over the ``embd`` group
        (skipped with ``all_reduce=False``, when the caller sums them itself), then release them to the hook."""
        if not self.shared_params:
            return
        for p in self.shared_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if all_reduce and self.embd_group is not None:
                dist.all_reduce(p.grad, group=self.embd_group)
        self._hook(self.shared_params)


def build_step_runner(model: nn.Module | Callable[[], nn.Module] | None, cfg: Any, dims: Any, *,
                      make_seq: Callable[[Any], Any] | None = None,
                      on_chunk_backward_done: Callable[[list[nn.Parameter]], None] | None = None,
                      seed: int | None = None, device: torch.device | str | None = None,
                      wire_dtype: torch.dtype | None = None, state_cls: type | None = None,
                      num_microbatches: int | None = None, post_ahead: bool = True) -> StepRunner:
    """Build this rank's model stage and its step runner.

    Args:
        model: a zero-argument factory (built on meta, pruned, materialised on ``device``, ``init_weights(seed)``),
            a model instance (pruned in place, not re-initialised), or ``None`` for ``K3Model(cfg.model, cfg.vision)``.
        cfg: the validated :class:`k3train.config.Config` (``parallel.*``, ``model.*``, ``train.seq_len``).
        dims: :class:`parallel.dims.ParallelDims` with groups built (uses ``pp`` ranks and the ``embd`` group).
        make_seq: ``batch -> SeqInfo`` (default: no CP); under CP pass one that attaches the KCP context.
        on_chunk_backward_done: see module docstring.
        seed: init seed (default ``cfg.train.seed``); device: default CPU (or the instance's device).
        wire_dtype: dtype of p2p payloads (default fp32 for ``train.dtype=float32``, else bf16).
        num_microbatches: if given, validated against the schedule now (clear error at start-up).
        post_ahead: post every p2p receive one compute ahead of its consumer (default; False: the time-ordered
            posts, kept for benchmarks, see benchmarks/bench_pipeline.py).
    """
    pcfg = cfg.parallel
    part = build_partition(cfg.model, pcfg, cfg.train.seq_len)
    schedule = resolve_schedule(pcfg.schedule, pcfg.pp, pcfg.vpp) if part.pp > 1 else "none"
    if num_microbatches is not None and part.pp > 1:
        build_schedule(schedule, part.pp, part.vpp, num_microbatches)  # raises ConfigError if impossible
    if dims.rank == 0:
        log.info("%s", describe_partition(part))
    if model is None:
        def model() -> nn.Module:  # noqa: F811 - the default factory
            return K3Model(cfg.model, getattr(cfg, "vision", None))
    if device is None:
        device = next(model.parameters()).device if isinstance(model, nn.Module) else torch.device("cpu")
    pp_rank = dims.pp_rank if part.pp > 1 else 0
    stage_model = build_stage_model(model, part, pp_rank, cfg.train.seed if seed is None else seed,
                                     torch.device(device))
    make_seq = make_seq or default_make_seq
    common = dict(make_seq=make_seq, on_chunk_backward_done=on_chunk_backward_done, recompute=pcfg.recompute)
    if part.pp == 1:
        return LocalRunner(stage_model, cfg, dims, part, **common)
    if wire_dtype is None:
        wire_dtype = torch.float32 if cfg.train.dtype == "float32" else torch.bfloat16
    return PipelineRunner(stage_model, cfg, dims, part, schedule=schedule, attnres_comm=pcfg.attnres_comm,
                          wire_dtype=wire_dtype, state_cls=state_cls or _default_state_cls(),
                          post_ahead=post_ahead, encoder_schedule=getattr(pcfg, "encoder_schedule", "inline"),
                          **common)
