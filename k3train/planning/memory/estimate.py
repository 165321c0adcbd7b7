"""The estimate: per-rank memory of one training step (see :mod:`k3train.planning.memory`)."""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.optim.param_groups import build_param_infos
from k3train.optim.zero import assign_owners
from k3train.parallelize import ParallelModel
from k3train.planning.dtypes import dtype_bytes
from k3train.planning.fakerun.synthetic import trace_batch
from k3train.planning.memory.buffers import bucket_transient, ep_buffers, payload_tensors
from k3train.planning.memory.cache import EstimateCache
from k3train.planning.memory.chunk import trace_chunk
from k3train.planning.memory.compose import whole_traces
from k3train.planning.memory.fake_model import build_full, build_stage
from k3train.planning.memory.limits import TraceTooBig, check_deadline
from k3train.planning.memory.media import MediaCase, media_pixel_bytes
from k3train.planning.memory.optimizer import optimizer_state_bytes, optimizer_transient
from k3train.planning.memory.results import ChunkTrace, Estimate, RankMemory
from k3train.planning.memory.run_data import data_microbatches, segments
from k3train.planning.memory.walk import walk_schedule
from k3train.planning.programs import forwards_before_first_backward, paired_programs, rank_programs, single_program
from moonep.shard import mark_expert_params
from parallel.dims import ParallelDims
from parallel.pipeline.attnres_comm import AttnResCommPlan
from parallel.pipeline.partition import build_partition
from parallel.pipeline.schedules import resolve_schedule
from parallel.pipeline.stage import chunk_param_groups, shares_embedding


def _nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def estimate(cfg: Config, world_size: int, cache: EstimateCache | None = None,
             media: MediaCase | None = None) -> Estimate:
    """Per-rank memory of one training step of ``cfg`` on ``world_size`` ranks (see :mod:`k3train.planning.memory`).

    ``media`` (a vision model): what the first stage's encoder is traced on (:class:`MediaCase`; default
    ``auto``: on multimodal data the worst case -- every position of the micro-batch a placeholder of the largest
    images the config allows --, on text data no media). The
    step's media pixels (float32, every micro-batch of the step, on every rank: the loader holds them) are in
    ``buffers`` (``detail["media_pixels"]``).

    ``cache`` (optional, :class:`~k3train.planning.memory.cache.EstimateCache`; one per model config): shares the
    fake mode, the fake full model per ep (``cache.full_model(cfg, ep, fake)``), the composed per-layer fits
    (``cache.pieces``) and the optimizer-transient traces (``cache.ns``) across calls -- the planner's speed-up."""
    t0 = time.perf_counter()
    media = (media or MediaCase()).resolved(cfg)
    media.check(cfg)
    lay = _StepLayout.of(cfg, world_size)
    fake = cache.fake if cache is not None else FakeTensorMode(allow_non_fake_inputs=True)
    ranks: list[RankMemory] = []
    batches: _TracedBatches | None = None
    piece_cache: dict = cache.pieces if cache is not None else {}
    stages: list[dict[str, Any]] = []
    if cache is not None:
        full = cache.full_model(cfg, lay.E, fake)
    else:
        full = build_full(cfg, lay.E, 0, fake)
        mark_expert_params(full)
    for pp_rank in range(lay.P):
        check_deadline(getattr(cache, "deadline", None))
        model, infos, groups = _stage_model(cfg, full, lay, pp_rank)
        if batches is None:
            batches = _TracedBatches.of(cfg, lay, media)
        params = _nbytes(list(model.parameters())) + _nbytes(list(model.buffers()))
        traces_cp = _stage_traces(cfg, full, lay, pp_rank, batches, fake, piece_cache, media, cache, params)
        stage = _StageRanks(cfg, lay, pp_rank, model, infos, groups, traces_cp, params, fake, cache)
        ranks += [stage.rank(d, c, batches, media) for d in range(lay.D) for c in range(lay.C)]
        stages.append({"pp_rank": pp_rank, "chunks": [asdict(t) for t in traces_cp[lay.C - 1].values()],
                       "layers": [list(x) for x in lay.part.local_chunks(pp_rank)]})
        del model, stage
    ranks.sort(key=lambda r: r.rank)
    if piece_cache:  # per-signature bytes (saved, f_peak, b_peak) of the composed traces, for the report
        stages.append({"pieces": {"/".join(str(x) for x in k): v for k, v in piece_cache.items()}})
    pc = cfg.parallel
    layout = (f"world={world_size} pp={lay.P} vpp={lay.part.vpp} dp={lay.D} cp={lay.C} ep={lay.E} zero={pc.zero} "
              f"moonep={pc.moonep} recompute={pc.recompute} dtype={cfg.train.dtype} mbs={lay.B} "
              f"seq={cfg.train.seq_len} M={lay.M}; traced on {batches.source} micro-batch{media.note(cfg)}")
    return Estimate(layout=layout, ranks=ranks, stages=stages, seconds=time.perf_counter() - t0)


class _Groups(dict):
    """Every group of a kind as global-rank lists (``ParallelDims.all_group_ranks``), enumerated on first use."""

    def __init__(self, dims: ParallelDims) -> None:
        super().__init__()
        self.dims = dims

    def __missing__(self, kind: str) -> list[list[int]]:
        self[kind] = self.dims.all_group_ranks(kind)
        return self[kind]


@dataclass
class _StepLayout:
    """What the estimate reads of the layout: the dims, the partition, the AttnRes plan, each pipeline rank's
    program (paired as the runner pairs it) and its forwards before the first backward."""
    dims0: ParallelDims
    part: Any
    plan: Any
    M: int
    B: int
    T: int
    in_flight: list[list[int]]
    programs: list[list[Any]]
    pair_firsts: list[Any]
    groups: _Groups

    @property
    def P(self) -> int:
        return self.dims0.pp

    @property
    def D(self) -> int:
        return self.dims0.dp

    @property
    def C(self) -> int:
        return self.dims0.cp

    @property
    def E(self) -> int:
        return self.dims0.ep

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> "_StepLayout":
        pc = cfg.parallel
        dims0 = ParallelDims.from_config(pc, world_size, 0)
        P = dims0.pp
        part = build_partition(cfg.model, pc, cfg.train.seq_len)
        M = cfg.train.grad_accum_steps
        plan = AttnResCommPlan(part, pc.attnres_comm) if P > 1 else None
        paired = cfg.ep_overlap()[0]  # F/B pairing: its schedule (one more warm-up forward) and paired programs
        schedule = resolve_schedule(pc.schedule, P, part.vpp) if P > 1 else "none"
        in_flight = forwards_before_first_backward(schedule, P, part.vpp, M, paired)
        programs = rank_programs(schedule, P, part.vpp, M, paired) if P > 1 else [single_program(M)]
        # F/B pairing (parallel.overlap_ep): the program the runner executes, two computes at once in every pair
        programs, pair_firsts = paired_programs(cfg, programs, P, part.vpp)
        return cls(dims0=dims0, part=part, plan=plan, M=M, B=cfg.train.micro_batch_size,
                   T=cfg.train.seq_len // dims0.cp, in_flight=in_flight, programs=programs, pair_firsts=pair_firsts,
                   groups=_Groups(dims0))


def _stage_model(cfg: Config, full: nn.Module, lay: _StepLayout, pp_rank: int) -> tuple[nn.Module, list[Any], list]:
    """Pipeline rank ``pp_rank``'s real stage, its parameters' infos with ZeRO owners over the real group ranks
    (identical for every pipeline of this stage), and its chunks' parameter groups."""
    model = build_stage(full, lay.part, pp_rank)
    infos = build_param_infos([model], cfg.optim,
                              functools.partial(ParallelModel.grad_group_fn, None))  # the trainer's groups
    rank0 = lay.dims0.rank_of(pp_rank, 0, 0)
    for inf in infos:
        inf.group_ranks = next(g for g in lay.groups[inf.group] if rank0 in g)
    if cfg.parallel.zero >= 1:
        assign_owners(infos, cfg.optim.ns_steps)
    groups, shared = chunk_param_groups(model, lay.part, pp_rank, shares_embedding(model, lay.part))
    if shared:
        groups[0 if pp_rank == 0 else len(groups) - 1] += shared
    return model, infos, groups


@dataclass
class _TracedBatches:
    """The micro-batches traced per CP rank ``(batch, batch with the most padding, their rows of CP segments)``
    (the run's own when its data can be read: the least and the most padded of each CP rank), the document
    segments of every micro-batch of the costed steps and one step's media pixels per (dp, cp) rank (rank
    (0, 0)'s for all when there are more than 16 data ranks), and what they are, for the layout line."""
    cp: dict[int, tuple[Any, Any, Any, Any]]
    segs: dict[tuple[int, int], list[list[int | None]]]
    px: dict[tuple[int, int], int]
    source: str

    @classmethod
    def of(cls, cfg: Config, lay: _StepLayout, media: MediaCase) -> "_TracedBatches":
        B, T, C, D = lay.B, lay.T, lay.C, lay.D
        coords = ([(d, c) for d in range(D) for c in range(C)] if D * C <= 16
                  else [(0, c) for c in range(C)] if C <= 16 else [])
        data = {dc: data_microbatches(cfg, *dc) for dc in coords}
        segs: dict[tuple[int, int], list[list[int | None]]] = {}
        px: dict[tuple[int, int], int] = {}
        if data and all(data.values()) and tuple(data[(0, 0)][0][0].tokens.shape) == (B, T):
            nch = functools.partial(segments, chunk=cfg.model.kda_chunk_size)
            cp = {}
            for cr in range(C):  # (micro-batch, its row of CP segments) by padded chunks of rank cr
                flat = sorted(((st[i][j], [data[(d, c)][i][j] for c in range(C)])
                               for (d, c0), st in data.items() if c0 == cr
                               for i in range(len(st)) for j in range(len(st[i]))), key=lambda x: nch(x[0]))
                hi = flat[-1] if nch(flat[-1][0]) > nch(flat[0][0]) else (None, None)
                cp[cr] = (flat[0][0], hi[0], flat[0][1], hi[1])
            segs = {dc: [[nch(mb) for mb in step] for step in st] for dc, st in data.items()}
            px = {dc: max(media_pixel_bytes(cfg, step, media) for step in st) for dc, st in data.items()}
            source = ("the run's data (steps 2-3; the least and most padded micro-batch of each CP rank, "
                      "others interpolated by their padded KDA chunks)")
        else:
            cp = {cr: (trace_batch(cfg, B, T, cr)[0], None, None, None) for cr in range(C)}
            source = trace_batch(cfg, 1, 1)[1]
        if not whole_traces(cfg, B, T):
            pc = cfg.parallel
            unit = "sublayer" if pc.recompute_granularity == "sublayer" and pc.recompute else "layer"
            source = (f"per-{unit} traces (trace_chunk: 3 token counts each, in the token-chunked regime "
                      f"of the MoE and the LM-head cross-entropy), fitted and composed for {B * T} tokens "
                      "(one document per row; MLA on short documents)")
        return cls(cp=cp, segs=segs, px=px, source=source)


def _stage_traces(cfg: Config, full: nn.Module, lay: _StepLayout, pp_rank: int, batches: _TracedBatches,
                  fake: FakeTensorMode, piece_cache: dict, media: MediaCase, cache: EstimateCache | None,
                  params: int) -> dict[int, dict[int, ChunkTrace]]:
    """Per CP rank, per local chunk: its traced micro-batch (:func:`trace_chunk`). Under the cache's ``limit``
    (the device's bytes): :class:`TraceTooBig` once one chunk and the stage's weights hold more."""
    *fwd, _ = lay.in_flight[pp_rank]
    limit = getattr(cache, "limit", None)  # the device's bytes: what the stage's weights leave to one chunk
    traces_cp: dict[int, dict[int, ChunkTrace]] = {}
    try:
        for cr in range(lay.C):
            batch, batch_hi, row, row_hi = batches.cp[cr]
            traces_cp[cr] = {c: trace_chunk(cfg, full, lay.part, lay.plan,
                                            lay.part.stage(pp_rank, c) if lay.P > 1 else 0, c, batch, fake,
                                            piece_cache, batch_hi, cr, (row, row_hi), media,
                                            getattr(cache, "deadline", None),
                                            None if limit is None else limit - params, max(1, fwd.count(c)))
                             for c in range(len(lay.part.local_chunks(pp_rank)))}
    except TraceTooBig as e:  # the rank holds its weights too
        raise TraceTooBig(e.nbytes + params) from None
    return traces_cp


class _StageRanks:
    """The ranks of one pipeline stage: what each owns under ZeRO, its optimizer state and step, the schedule walk
    of its program on its CP rank's traces, and its peak (memoised over ranks that own and read the same)."""

    def __init__(self, cfg: Config, lay: _StepLayout, pp_rank: int, model: nn.Module, infos: list[Any],
                 groups: list, traces_cp: dict[int, dict[int, ChunkTrace]], params: int, fake: FakeTensorMode,
                 cache: EstimateCache | None) -> None:
        self.cfg, self.lay, self.pp_rank, self.infos, self.groups = cfg, lay, pp_rank, infos, groups
        self.traces_cp, self.params, self.fake = traces_cp, params, fake
        B, T, E = lay.B, lay.T, lay.E
        local_chunks = lay.part.local_chunks(pp_rank)
        traces = traces_cp[0]
        self.ep_persist, self.replica, self.n_moe = ep_buffers(cfg, model, E, B, T)
        if lay.pair_firsts[pp_rank]:  # side 1 of the pairs has token buffers and a replica pool of its own (EPSide)
            self.ep_persist *= 2
        moe_per_chunk = {c: sum(1 for i in range(*local_chunks[c]) if cfg.model.is_moe_layer(i))
                         for c in range(len(local_chunks))}
        # MoonEP's replica weights live in the shared pool (persistent, in ``ep_persist``), nothing per layer and
        # micro-batch; one layer's backward holds its replicas' gradients and at most two reduce-back rounds
        self.per_mb_extra = {c: 0 for c in traces}
        self.b_extra = {c: (3 * self.replica if moe_per_chunk[c] else 0) for c in traces}
        self.p2p_bufs = 0  # receive/send buffers are walked with the program (in activations)
        self.per_stage_bytes: dict[int, int] = {}  # payload bytes by boundary: one plan lookup per boundary
        self.tensor_bytes = B * T * cfg.model.hidden_size * dtype_bytes(cfg)
        plan = lay.plan
        self.cached_grad = {c: (plan.known_blocks(lay.part.stage(pp_rank, c)) * self.tensor_bytes
                                if plan is not None else 0) for c in traces}
        self.by_id = {id(inf.param): inf for inf in infos}
        self.owned_cache: dict[int, tuple] = {}
        self.walk_cache: dict[tuple, tuple] = {}  # the walk depends on the owned set only through ZeRO-2's grad shards
        self.grad_full = {ci: _nbytes(g) for ci, g in enumerate(groups)}
        self.view_cache: dict[Any, Any] = {}
        self.ns_cache: dict[tuple, int] = cache.ns if cache is not None else {}

    def msg_bytes(self, msg: Any) -> int:
        if msg.stage not in self.per_stage_bytes:
            self.per_stage_bytes[msg.stage] = payload_tensors(self.lay.plan, msg.stage) * self.tensor_bytes
        return self.per_stage_bytes[msg.stage]

    def rank(self, d: int, c: int, batches: _TracedBatches, media: MediaCase) -> RankMemory:
        """The memory of the rank at (this stage, dp ``d``, cp ``c``)."""
        cfg, lay, pc = self.cfg, self.lay, self.cfg.parallel
        rank = lay.dims0.rank_of(self.pp_rank, d, c)
        owned = (_owned_by(rank, self.infos, lay.groups, cfg.optim.ns_steps, self.view_cache) if pc.zero >= 1
                 else {inf.index for inf in self.infos})
        step_segs = batches.segs.get((d, c), batches.segs.get((0, c), [[None] * lay.M]))
        key = hash((frozenset(owned), str(step_segs), c))
        if key not in self.owned_cache:
            self.owned_cache[key] = self._owned_peaks(owned, step_segs, c)
        opt, peak_dyn, act, g_at, where, step_peak, g_end = self.owned_cache[key]
        media_px = batches.px.get((d, c), batches.px.get((0, c), media_pixel_bytes(cfg, None, media)))
        bufs = self.ep_persist + self.p2p_bufs + media_px
        params = self.params
        if step_peak > peak_dyn:
            peak, where, grads_at, act_at = params + opt + bufs + step_peak, "optimizer step", g_end, 0
        else:
            peak, grads_at, act_at = params + opt + bufs + peak_dyn, g_at, peak_dyn - g_at
        return RankMemory(rank=rank, pp_rank=self.pp_rank, dp_rank=d, cp_rank=c, ep_rank=(d * lay.C + c) % lay.E,
                          params=params, grads=grads_at, optimizer=opt, activations=act_at, buffers=bufs, peak=peak,
                          peak_at=where, detail={"ep_token_buffers": self.ep_persist,
                                                 "moonep_replicas_per_layer": self.replica, "p2p": self.p2p_bufs,
                                                 "moe_layers": self.n_moe, "media_pixels": media_px})

    def _owned_peaks(self, owned: set[int], step_segs: list[list[int | None]], c: int) -> tuple:
        """``(optimizer state, walk peak, activations, gradients at it, where, optimizer step's peak, gradients
        after the step)`` of a rank owning ``owned`` on CP rank ``c`` with ``step_segs`` micro-batches."""
        cfg, pc, infos, grad_full = self.cfg, self.cfg.parallel, self.infos, self.grad_full
        grad_owned = ({ci: _nbytes([p for p in g if self.by_id[id(p)].index in owned])
                       for ci, g in enumerate(self.groups)} if pc.zero == 2 else grad_full)
        opt = optimizer_state_bytes(infos, owned)
        ns_t = optimizer_transient(cfg, infos, owned, self.fake, self.ns_cache)
        wkey = (c, str(step_segs), tuple(grad_owned.values()) if pc.zero == 2 else None)
        if wkey not in self.walk_cache:
            self.walk_cache[wkey] = max(
                walk_schedule(self.lay.programs[self.pp_rank], self.traces_cp[c], grad_full, grad_owned, pc.zero,
                              self.per_mb_extra, self.b_extra, self.msg_bytes, self.cached_grad, segs,
                              pairs=self.lay.pair_firsts[self.pp_rank], pair_done=1 / 3 if pc.recompute else 1 / 2)
                for segs in step_segs)
        peak_dyn, act, g_at, where = self.walk_cache[wkey]
        g_end = sum(grad_owned.values()) if pc.zero == 2 else sum(grad_full.values())
        step_peak = g_end + ns_t + bucket_transient(infos, owned, pc.zero)
        return opt, peak_dyn, act, g_at, where, step_peak, g_end


def _owned_by(rank: int, infos: list[Any], all_groups: dict[str, list[list[int]]], ns_steps: int,
              cache: dict[Any, Any]) -> set[int]:
    """Indices of the parameters ``rank`` owns under ZeRO. ``infos`` carry ``assign_owners``' result over the
    groups of the stage's first rank; a rank owns what the rank at ITS position in its own group of that kind
    owns there (an expert's edp group differs between ranks of one dp group; the assignment is by position and
    load, the same in every rank's view of a symmetric layout)."""
    if "pos" not in cache:  # kind -> {rank: position in its group}
        cache["pos"] = {kind: {r: i for g in all_groups[kind] for i, r in enumerate(g)}
                        for kind in {inf.group for inf in infos}}
        cache["owner_pos"] = {inf.index: (inf.group, inf.group_ranks.index(inf.owner)) for inf in infos}
    pos, owner_pos = cache["pos"], cache["owner_pos"]
    view = tuple(sorted((kind, p[rank]) for kind, p in pos.items()))
    if view not in cache:
        cache[view] = {i for i, (kind, at) in owner_pos.items() if pos[kind][rank] == at}
    return cache[view]
