"""Memory per pipeline stage and rank, estimated by running the project's own code on fake tensors.

What is TRACED (the real code, under ``FakeTensorMode`` + :class:`~k3train.planning.known_data.KnownData`, bytes
booked by :class:`~k3train.planning.live_bytes.LiveBytes`; nothing the size of the model is allocated):

* each pipeline rank's real stage model: ``K3Model(cfg.model)`` built on fake tensors, pruned by
  ``parallel.pipeline.stage.prune_to_stage``, routed experts sharded by ``moonep.shard.shard_experts``, cast by
  ``k3train.parallelize.cast_params_to_bf16`` -> parameter bytes;
* per local chunk, one micro-batch (``micro_batch_size x seq_len / cp`` tokens) through the runner's own
  forward (``embed`` / ``forward_layers`` / ``loss_sums`` under ``run_maybe_recomputed``, so ``parallel.recompute``
  and ``model.attn_res_recompute`` act as in training) and its backward: bytes saved for backward per chunk and
  micro-batch, and the transient peak inside the forward and the backward. When the run's dataset can be read,
  on its real micro-batches (the ones with the fewest and the most padded KDA chunks of steps 2-3; every other
  micro-batch interpolated by its chunk count), else on one document per row. Under CP, per CP rank, with the
  real KCP context (halo, pair gather and fold, MLA latent prefix) whose collectives are simulated locally
  (:mod:`k3train.planning.sim_collectives`: same shapes and in-place writes, no peers). Long sequences (the CP group's
  tokens x layers over ``TRACE_BUDGET``, :func:`whole_traces`: K3) trace each distinct layer alone at 1K/2K/4K tokens, fit a + bT + cT^2
  exactly and compose the chunk (:func:`trace_chunk`; under CP at ranks 0 and 1, extended affinely in the rank);
* a vision model's first stage: ``embed_batch`` -- the MoonViT-V2 encoder + projector on the micro-batch's media
  and the placeholder scatter, inside the chunk's forward and backward as the runner runs it -- on the media
  :class:`MediaCase` names: on multimodal data by default the WORST CASE (every position of every row a
  placeholder of the largest images ``data.max_media_pixels`` allows that fit a row; ``frames`` per media), or
  the data's own media, or none (the default on text data); the step's pixels are in ``buffers``. The tower's parameters, gradients and optimizer state are the first
  chunk's like any other (the stage model holds them);
* the optimizer update: ``muon_step_`` / ``adamw_step_`` on the largest owned parameters (Newton-Schulz
  temporaries);
* ownership: ``k3train.optim.param_groups.build_param_infos`` + ``k3train.optim.zero.assign_owners`` over the
  layout's real group ranks (``parallel.dims.ParallelDims``, no process group) -> ZeRO-1/2 shares per rank.

What is COMPUTED (distributed pieces cannot run without process groups; sizes from the code's own formulas):

* the schedule walk: each pipeline rank's real program (``build_schedule`` + ``p2p.build_programs``: the order
  of computes and receive posts); a micro-batch's saved bytes are held from its F to its B; gradients appear at
  a chunk's first B and (ZeRO-2) shrink to the owned share after its last B; the optimizer step's peak
  (gradients + the largest update's temporaries + the reduction bucket) is compared with the schedule's;
* p2p: the AttnRes plan's payload per boundary (``AttnResCommPlan.payload``): received inputs kept until B,
  incoming gradients during B;
* EP (ep > 1): the expert layer runs locally on the rank's shard with ``N*k`` rows (what MoonEP computes; plain
  EP's expectation under balanced routing); the persistent send/recv buffers from ``moonep.comm.token_buffer_rows``;
  MoonEP's replica pool (two banks of ``[E/ep, l, f] x 3`` shared by all MoE layers, persistent), and during a
  MoE layer's B its replicas' gradients plus at most two reduce-back receive rounds (3 x one layer's replicas);

Assumptions: balanced routing (``KnownData``: what Quantile Balancing converges to); a scalar read from fake
data is 0 (statistics only). Not modelled: allocator
rounding/fragmentation (add ~5-10% on GPU), NCCL workspaces, the data loader's few KiB.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.planning.known_data import KnownData
from k3train.planning.live_bytes import LiveBytes

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass
class ChunkTrace:
    """One local chunk, one micro-batch: bytes alive after F (``saved``), transient above the live base
    during F (``f_peak``) and during B (``b_peak``, on top of ``saved``)."""
    chunk: int
    stage: int
    layers: tuple[int, int]
    saved: int
    f_peak: int
    b_peak: int
    recv: int = 0      # received activation payload (held until B)
    grad_msg: int = 0  # incoming gradient payload (during B)
    # traced on two real micro-batches: (saved, f_peak, b_peak) above are at seg_lo padded KDA chunks, ``hi`` at
    # seg_hi; a micro-batch with n chunks is costed by linear interpolation (chunked KDA pads per document)
    seg_lo: int = 0
    seg_hi: int = 0
    hi: tuple[int, int, int] | None = None

    def at(self, segs: int | None) -> tuple[int, int, int]:
        lo = (self.saved, self.f_peak, self.b_peak)
        if self.hi is None or segs is None or self.seg_hi == self.seg_lo:
            return lo
        w = (segs - self.seg_lo) / (self.seg_hi - self.seg_lo)
        return tuple(int(round(a + w * (b - a))) for a, b in zip(lo, self.hi))


@dataclass
class RankMemory:
    rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    peak: int
    peak_at: str = ""
    measured_peak: int | None = None
    detail: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.measured_peak is None:
            d.pop("measured_peak")
        return d


@dataclass
class Estimate:
    layout: str
    ranks: list[RankMemory]
    stages: list[dict[str, Any]]
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "seconds": round(self.seconds, 2), "stages": self.stages,
                "ranks": [r.as_json() for r in self.ranks]}


# --------------------------------------------------------------------------------------------------------------
# tracing helpers
# --------------------------------------------------------------------------------------------------------------
def _nbytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def trace_batch(cfg: Config, B: int, T: int, cp_rank: int = 0, doc_len: int = 0) -> tuple[Any, str]:
    """A synthetic micro-batch ``[B, T]``, one document per row (the least chunked-KDA padding), for runs
    whose data cannot be read yet (planning) and the per-layer traces of long sequences; under CP the
    ``cp_rank``-th segment of each row (positions ``cp_rank*T ...``, the row's one document crossing it).

    ``doc_len > 0`` (dividing T): documents of ``doc_len`` tokens instead, numbered on from the earlier CP
    segments'. What the per-layer traces of the MLA attention use: the blockwise op's bytes do not depend on which
    blocks the mask empties (every computed block allocates the same transients, the key-side tensors are sized by
    the keys), only its time does, and with one document per block it computes one block per query block instead
    of the causal triangle of a 1M-token row (hours of fake ops)."""
    import dataclasses

    from k3train.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    samples = torch.randint(3, max(4, cfg.model.vocab_size), (B, T + 1), generator=g)
    samples[samples == cfg.model.eos_token_id] = 3
    if doc_len > 0:
        samples[:, doc_len - 1:T:doc_len] = cfg.model.eos_token_id
    batch = Batch.from_samples(samples, eos_id=cfg.model.eos_token_id, pad_id=cfg.model.pad_token_id)
    if cp_rank:
        batch = dataclasses.replace(batch, positions=batch.positions + cp_rank * T)
        if doc_len > 0:
            batch = dataclasses.replace(batch, doc_ids=batch.doc_ids + cp_rank * (T // doc_len))
    return batch, "a synthetic (one document per row)"


@dataclass(frozen=True)
class MediaCase:
    """The media the first stage's traced step encodes (models with ``vision.enabled`` only).

    * ``source="worst"`` (default): synthetic media of the worst case for the micro-batch (:func:`worst_case_grids`):
      EVERY position of every row is a media placeholder, filled by the largest square images
      ``data.max_media_pixels`` allows that fit a row (a row shorter than one such image: the largest that fits),
      the rest of the row by one strip image one merged token high; ``frames`` per media (1: images; up to
      ``vision.pos_emb_time``: clips, ``frames`` x the patches per LM token). The encoder's work and memory
      are linear in the patches (the attention kernels are flash-style), so this is the most a row can cost;
    * ``source="data"``: the run's own micro-batches' media when the dataset can be read (real multimodal
      micro-batches only; synthetic rows get the worst case) -- what ``--measure`` runs;
    * ``source="none"``: no media (the encoder runs on zero patches: a vision model on text data).
    * ``source="auto"`` (default): ``worst`` when the run's data can hold media (``data.format: multimodal``),
      else ``none`` (``configs/k3.yaml`` trains its vision model on a text corpus: no media can occur).
    """
    source: str = "auto"
    frames: int = 1

    def resolved(self, cfg: Config) -> "MediaCase":
        """``auto`` decided for ``cfg`` (module docstring); any other source unchanged."""
        if self.source != "auto":
            return self
        return MediaCase("worst" if cfg.data.format == "multimodal" else "none", self.frames)

    def check(self, cfg: Config) -> None:
        if self.source not in ("auto", "worst", "data", "none"):
            raise ValueError(f"media case: source must be 'auto', 'worst', 'data' or 'none', got {self.source!r}")
        if cfg.vision.enabled and not 1 <= self.frames <= cfg.vision.pos_emb_time:
            raise ValueError(f"media case: frames must be in [1, vision.pos_emb_time={cfg.vision.pos_emb_time}] "
                             f"(the most frames a clip may have), got {self.frames}")

    def note(self, cfg: Config) -> str:
        """How the estimate's first stage traced the encoder (for the layout line)."""
        if not cfg.vision.enabled:
            return ""
        if self.source == "none":
            return "; vision encoder on no media"
        side = worst_case_side(cfg, cfg.train.seq_len) * cfg.vision.patch_size * cfg.vision.merge_size
        what = "images" if self.frames == 1 else f"{self.frames}-frame clips"
        worst = (f"every position of each {cfg.train.seq_len}-token row a placeholder of {side}x{side} px {what} "
                 f"(worst case, data.max_media_pixels={cfg.data.max_media_pixels}; any remainder one strip image)")
        return "; vision encoder on " + (worst if self.source == "worst" else
                                          f"the data's own media (synthetic rows: {worst})")


def worst_case_side(cfg: Config, row_len: int) -> int:
    """Side, in merged tokens, of the largest square media of the worst case: ``s x s`` tokens
    (``s * patch_size * merge`` px) with ``(s * patch_size * merge)^2 <= data.max_media_pixels`` and
    ``s^2 <= row_len``."""
    import math

    unit = cfg.vision.patch_size * cfg.vision.merge_size
    return max(1, min(math.isqrt(cfg.data.max_media_pixels) // unit, math.isqrt(row_len)))


def worst_case_grids(cfg: Config, row_len: int, frames: int = 1) -> list[tuple[int, int, int]]:
    """Patch grids ``(t, h, w)`` of one row of :class:`MediaCase`'s worst case: ``row_len // s^2`` square media
    of ``s x s`` merged tokens (:func:`worst_case_side`) and, for the ``r`` positions left, one strip of ``1 x r``
    merged tokens (``r * unit^2 < s^2 * unit^2`` px: within the pixel limit). Exactly ``row_len`` tokens."""
    m = cfg.vision.merge_size
    s = worst_case_side(cfg, row_len)
    k, r = divmod(row_len, s * s)
    return [(frames, s * m, s * m)] * k + ([(frames, m, r * m)] if r else [])


def media_batch(cfg: Config, batch: Any, case: MediaCase, cp_rank: int | None, fake: FakeTensorMode) -> Any:
    """``batch`` with the media :class:`MediaCase` asks for: the pixels fake (made in ``fake``), the tokens,
    grids and offsets real (the model plans the encoder's loop on them, as on real data). Under CP (``cp_rank``
    set) ``batch`` is one CP segment of rows ``cp * T`` long: the media cover the FULL rows and
    ``media_offsets`` place this segment's placeholders (as ``Batch.slice_cp``; every CP rank encodes them all,
    ``vision_cp`` unset: an upper bound where the encoder's patch split would apply)."""
    import dataclasses

    from k3train.model.media import MediaInputs

    ph = cfg.model.media_placeholder_token_id
    real_mm = batch.media_token_id is not None  # a multimodal micro-batch from the run's loader
    if case.source == "data" and real_mm:
        return batch
    if case.source == "none":
        tokens = batch.tokens.masked_fill(batch.tokens == ph, 3) if real_mm else batch.tokens
        return dataclasses.replace(batch, tokens=tokens, media=None, media_rows=None, media_token_id=None,
                                   media_offsets=None)
    B, T = batch.tokens.shape
    C = cfg.parallel.cp if cp_rank is not None else 1
    grids = worst_case_grids(cfg, T * C, case.frames)
    p = cfg.vision.patch_size
    n = B * sum(t * h * w for t, h, w in grids)
    with fake:
        pixels = torch.empty(n, 3, p, p)
    media = MediaInputs(pixels, torch.tensor(grids * B, dtype=torch.long).reshape(-1, 3))
    offsets = torch.arange(B, dtype=torch.long) * (T * C) + (cp_rank or 0) * T if C > 1 else None
    return dataclasses.replace(batch, tokens=torch.full_like(batch.tokens, ph), media=media,
                               media_rows=torch.arange(B).repeat_interleave(len(grids)), media_token_id=ph,
                               media_offsets=offsets, vision_cp=None)


def media_pixel_bytes(cfg: Config, step: list[Any] | None, case: MediaCase) -> int:
    """Bytes of one step's media pixels on a rank (the loader hands over all ``grad_accum_steps`` micro-batches
    of a step at once, each with the media of its full rows, float32): the real ones of ``step`` with
    ``source="data"`` and real data, else the worst case's (``micro_batch_size`` rows of ``seq_len``)."""
    if not cfg.vision.enabled or case.source == "none":
        return 0
    if case.source == "data" and step and all(mb.media_token_id is not None for mb in step):
        return sum(mb.media.pixel_values.nbytes for mb in step if mb.media is not None)
    p = cfg.vision.patch_size
    patches = sum(t * h * w for t, h, w in worst_case_grids(cfg, cfg.train.seq_len, case.frames))
    return cfg.train.grad_accum_steps * cfg.train.micro_batch_size * patches * 3 * p * p * 4


def data_microbatches(cfg: Config, dp_rank: int = 0, cp_rank: int = 0,
                      steps: tuple[int, int] = (1, 3)) -> list[list[Any]] | None:
    """This run's real micro-batches of steps ``steps`` (0-based, end exclusive: the 2nd and 3rd -- the steps
    ``--measure`` takes its peak over; the first has no optimizer state yet) for one (dp, cp) rank, through the
    project's loader; None when the dataset cannot be read (or sequences are over 64K tokens)."""
    if cfg.train.seq_len > 65536:
        return None
    try:
        from k3train.data.loader import GlobalBatchLoader

        dp = max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.train.grad_accum_steps))
        loader = GlobalBatchLoader(cfg, dp_rank, dp, cp_rank, cfg.parallel.cp)
        out = []
        for step in range(steps[1]):
            mbs = loader.next_step()
            if step >= steps[0]:
                out.append(mbs)
        return out
    except Exception:  # noqa: BLE001 - no dataset yet: the caller uses a synthetic batch
        return None


def segments(batch: Any, chunk: int = 64) -> int:
    """KDA chunks of a micro-batch: every document segment padded to whole ``chunk``-token chunks -- what the
    chunked KDA's buffers scale with (the only data-dependent sizes of a step)."""
    from k3train.model.seq import cu_seqlens_from_doc_ids

    lens = cu_seqlens_from_doc_ids(batch.doc_ids).diff()
    return int(((lens + chunk - 1) // chunk).sum())


class _ShardDispatcher:
    """Stand-in for ``EPDispatcher`` at ep > 1 (no process group): the rank's expert shard computes the N*k
    route rows locally, the routes folded onto the shard (``idx mod E/ep``), through the real LocalDispatcher."""

    def __init__(self) -> None:
        from k3train.model.moe import LocalDispatcher

        self.local = LocalDispatcher()

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: Any) -> Any:
        return self.local(x, topk_idx % experts.num_experts, topk_weight, experts)


def build_full(cfg: Config, ep: int, ep_rank: int, fake: FakeTensorMode) -> nn.Module:
    """The whole model on fake tensors, experts sharded for ``ep_rank``, dtype cast, ``.grad`` pre-set (so a
    trace books only the step's new tensors; the gradient bytes are counted from the parameters)."""
    from k3train.model.model import K3Model
    from k3train.parallelize import cast_params_to_bf16

    with fake:
        m = K3Model(cfg.model, cfg.vision)
        if ep > 1:
            from moonep.shard import _latent_moes, shard_experts

            for _, moe in _latent_moes(m):
                shard_experts(moe.experts, ep, ep_rank)
                moe.dispatcher = _ShardDispatcher()
        if cfg.train.dtype == "bfloat16":
            cast_params_to_bf16([m])
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    m.train()
    return m


def build_stage(full: nn.Module, part: Any, pp_rank: int) -> nn.Module:
    """This rank's real stage (``prune_to_stage``) as a shallow copy of ``full`` sharing its layer modules."""
    import copy

    from parallel.pipeline.stage import prune_to_stage

    m = copy.copy(full)
    m._modules = dict(full._modules)
    m.layers = nn.ModuleDict(dict(full.layers.items()))
    return prune_to_stage(m, part, pp_rank)


def _single_rank_cp(ctx: Any, rank: int, size: int) -> Any:
    """The KCP context of one thread-rank, re-pointed at a board-less group: the traced step runs that rank
    alone (its float collectives simulated by replication)."""
    from k3train.planning.sim_collectives import SimGroup

    ctx.group = SimGroup(size, rank, "cp")
    return ctx


def _track_existing(lb: LiveBytes, model: nn.Module | None, *objs: Any) -> None:
    """Book the tensors that exist before a traced piece of code (see :func:`trace_range`)."""
    ts: list[torch.Tensor] = []
    if model is not None:
        for p in model.parameters():
            ts.append(p)
            if p.grad is not None:
                ts.append(p.grad)
        ts.extend(model.buffers())
    for o in objs:
        if isinstance(o, torch.Tensor):
            ts.append(o)
        elif isinstance(o, (list, tuple)):
            ts.extend(t for t in o if isinstance(t, torch.Tensor))
        elif hasattr(o, "__dataclass_fields__"):
            ts.extend(v for v in vars(o).values() if isinstance(v, torch.Tensor))
    lb.track(ts)


def trace_range(cfg: Config, model: nn.Module, s: int, e: int, first: bool, last: bool, batch: Any,
                fake: FakeTensorMode, recompute: bool, cp_rank: int | None = None,
                cp_row: list[Any] | None = None, media: MediaCase | None = None,
                part: str | None = None) -> tuple[int, int, int]:
    """Forward + backward of layers ``[s, e)`` (with ``embed_batch`` when ``first``: the embedding and, for a
    vision model, the encoder on the media ``media`` asks for -- :class:`MediaCase`; the head + MTP when
    ``last``) on one micro-batch, as ``PipelineRunner._forward/_backward`` (or ``LocalRunner._run``) run it, from
    the canonical AttnRes input state of layer ``s``; ``part`` ``"mixer"`` / ``"ffn"``: only that sublayer of
    layer ``s`` (``K3Layer.run_mixer`` / ``run_ffn``, from the state it starts from). ``recompute``: parallel.recompute,
    applied as the runner applies it (a whole-chunk checkpoint, or ``K3Model.set_recompute`` of the layer /
    sublayer granularity). Returns ``(saved, f_peak, b_peak)``: bytes alive after the forward, and the peaks above
    the pre-forward live bytes during the forward and the backward."""
    from k3train.model.attnres import AttnResState, canonical_layout
    from k3train.model.seq import SeqInfo
    from parallel.pipeline.stage import recompute_chunk, recompute_unit, run_maybe_recomputed

    d, bs = cfg.model.hidden_size, cfg.model.attn_res_block_size
    n_in, has_partial = canonical_layout(s, bs, cfg.model.residual)  # the input state's blocks / partial sum
    if part == "ffn":
        has_partial = True  # the FFN continues the mixer's partial sum
    model.set_recompute(recompute_unit(cfg, recompute))
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    B, T = batch.tokens.shape
    sim: Any = contextlib.nullcontext
    if cp_rank is None or cfg.parallel.cp == 1:
        seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    else:  # the real KCP context of CP rank ``cp_rank`` (``cp_row``: every CP rank's segment of these rows),
        # built by all CP ranks as threads; the step's collectives simulated (k3train.planning.sim_collectives)
        from k3train.parallelize import seq_builder
        from k3train.planning.sim_collectives import run_ranks, simulated_collectives

        sim, C = simulated_collectives, cfg.parallel.cp
        row = cp_row if cp_row is not None else [trace_batch(cfg, B, T, r)[0] for r in range(C)]
        with sim():
            ctx_seq = run_ranks(C, lambda g: seq_builder(cfg, C, g)(row[g.rank]), "cp")[cp_rank]
        seq = SeqInfo(ctx_seq.doc_ids, ctx_seq.positions, ctx_seq.cu_seqlens,
                      _single_rank_cp(ctx_seq.cp, cp_rank, C))
    if first and getattr(model, "vision", None) is not None:
        batch = media_batch(cfg, batch, (media or MediaCase()).resolved(cfg), cp_rank if cfg.parallel.cp > 1 else None, fake)
        model.vision.encoder.recompute_blocks = cfg.parallel.recompute  # as the runner sets it
    lb = LiveBytes()
    with fake:
        leaves: list[torch.Tensor] = []
        if not first:
            blocks = [torch.empty(B, T, d, dtype=dtype).requires_grad_() for _ in range(n_in)]
            partial = torch.empty(B, T, d, dtype=dtype).requires_grad_() if has_partial else None
            leaves = blocks + ([partial] if partial is not None else [])
    with sim(), fake, KnownData(), lb:
        # everything that exists before the step (weights, their .grad, buffers such as the router's counters,
        # the batch, the sequence layout, the received inputs) is booked first, so that a view or an in-place op
        # on it is not mistaken for a new storage (the real run books them at creation)
        _track_existing(lb, model, batch, batch.media, seq, leaves)
        base = lb.live

        def run() -> Any:
            state = (model.embed_batch(batch) if first
                     else AttnResState(blocks=list(leaves[:n_in]), partial=leaves[-1] if has_partial else None))
            if part == "mixer":
                return model.layers[str(s)].run_mixer(state, seq)
            if part == "ffn":
                return model.layers[str(s)].run_ffn(state)
            state = model.forward_layers(state, s, e, seq)
            return model.loss_sums(state, batch, seq) if last else state

        lb.set_phase("forward")
        out = run_maybe_recomputed(run, recompute_chunk(cfg, recompute))
        lb.set_phase("saved")
        saved = lb.live - base
        f_peak = lb.phase_peak.get("forward", lb.live) - base
        if last:
            mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0
            roots, grads = [out["lm_loss_sum"] + mtp_w * out["mtp_loss_sum"]], [None]
        else:
            new_blocks = out.blocks[n_in:]
            roots = [t for t in new_blocks] + ([out.partial] if out.partial is not None else [])
            roots = [t for t in roots if t.requires_grad]
            grads = [torch.empty_like(t) for t in roots]  # the received gradient payload
        lb.set_phase("backward")
        mark = lb.live
        if roots:
            torch.autograd.backward(roots, grads)
        b_peak = lb.phase_peak.get("backward", mark) - base
        del out, roots, grads
    return saved, f_peak, b_peak


class TraceDeadline(Exception):
    """Raised between traces once ``EstimateCache.deadline`` (a ``time.perf_counter()`` value) has passed: the
    planner's memory-trace budget is spent (the pieces traced so far stay cached, and are exact)."""


class TraceTooBig(Exception):
    """Raised by a composed trace once one chunk alone -- one micro-batch's peak, or the saved bytes of its
    micro-batches in flight at the rank's first backward -- holds more than ``EstimateCache.limit`` bytes (the
    planner's device memory): the layout cannot fit whatever the rest adds, and the pieces not traced yet (minutes
    at long context without recomputation) are not needed. ``nbytes``: that lower bound."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"one chunk's micro-batches hold at least {nbytes} bytes")
        self.nbytes = nbytes


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise TraceDeadline


# Above this many (tokens per micro-batch and rank) x (model layers) chunks are not traced whole: the cost of a
# fake trace grows with both (chunked KDA's recurrence is one Python step per 64 tokens: a 64K-token K3 segment
# would take hours of fake ops; 93 K3 layers at 4K tokens ~10 minutes on 2 cores). Instead each distinct piece --
# the embedding, each layer signature (or, under parallel.recompute_granularity = sublayer, each of its token mixer
# and FFN sublayers: the units recomputed on their own), the head + MTP -- is traced alone at a few token counts,
# every byte count is fitted EXACTLY by a + b T + c T^2 (memory is at most quadratic in T), evaluated at the real T,
# and the pieces of a chunk are composed in order (forward peak: earlier pieces' saved bytes + this piece's
# transient; backward in reverse). The three token counts are COMPOSE_TOKENS = 1K, 2K, 4K (a KDA layer's or
# mixer's: 256 and 512, a line -- its bytes are a constant plus a term per 64-token chunk, and its fake trace is the
# slowest, one Python step per chunk and head chunk; an MLA's: 1, 2, 4 attention blocks, so that a trace holds the
# real per-block transients), except for a piece holding a module that computes in token chunks (a LatentMoE:
# model.moe_token_chunk; the LM head + MTP cross-entropy: CE_CHUNK_TOKENS) when the real micro-batch has more
# tokens than the chunk: then 2 and 3 times the chunk (the least common multiple of the chunks in play), the line
# fitted where the real run is -- a fixed per-chunk transient plus bytes linear in the tokens (:func:`piece_tokens`).
# An MLA's pieces are also traced at CP rank 1 (at their first token count: what a key segment more holds is
# proportional to the tokens) and extended to every rank in its key segments (:func:`mla_key_segments`).
TRACE_BUDGET = 8192 * 16  # tokens x layers traced whole (tiny and small: whole chunks)


def whole_traces(cfg: Config, B: int, T: int) -> bool:
    """Trace whole chunks (every CP rank's) rather than compose per-layer fits: while the CP group's tokens of a
    micro-batch (``B x T x cp``) times the depth stay within ``TRACE_BUDGET`` -- a whole trace is taken once per
    CP rank, so at K3 width a large cp with short rows per rank would cost minutes per layout."""
    return B * T * cfg.parallel.cp * cfg.model.num_hidden_layers <= TRACE_BUDGET
COMPOSE_TOKENS = (1024, 2048, 4096)
KDA_COMPOSE_TOKENS = (256, 512)  # linear: a constant plus a term per 64-token chunk (the fits' c was 0 at 3)


def piece_tokens(n_real: int, chunks: list[int], base: tuple[int, ...] = COMPOSE_TOKENS) -> tuple[int, ...]:
    """Token counts a composed piece is traced at for a micro-batch of ``n_real`` tokens, given the token chunks
    of the modules it holds: ``base`` when ``n_real`` exceeds none of them (one chunk: the module runs whole, as
    at the trace's sizes); else ``2m, 3m`` with ``m`` the least common multiple of the chunks ``n_real`` exceeds
    (the chunked regime, every chunk full: a fixed per-chunk transient plus bytes linear in the tokens, so two
    points fit it), provided no other chunk is then exceeded; a micro-batch between two chunk sizes with no such
    ``m`` is traced at ``n_real`` itself."""
    import math

    over = sorted({c for c in chunks if 0 < c < n_real})
    if not over:
        return base
    m = math.lcm(*over)
    pts = (2 * m, 3 * m)
    if any(c > 0 and c not in over and c < pts[-1] for c in chunks):
        return (n_real,)
    return pts


def _quadratic_fit(ts: tuple[int, ...], ys: list[int]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the quadratic through three points (exact: memory is at most quadratic in T); of the line
    through two; one point: the constant."""
    if len(ts) == 1:
        return float(ys[0]), 0.0, 0.0
    if len(ts) == 2:
        b = (ys[1] - ys[0]) / (ts[1] - ts[0])
        return ys[0] - b * ts[0], b, 0.0
    (t1, t2, t3), (y1, y2, y3) = ts, ys
    c = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)
    b = (y2 - y1) / (t2 - t1) - c * (t1 + t2)
    return y1 - b * t1 - c * t1 * t1, b, c


def _poly(abc: tuple[float, float, float], t: int) -> float:
    return abc[0] + abc[1] * t + abc[2] * t * t


def _compose(pieces: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    saved, f_peak, b_peak, prefix = 0, 0, 0, 0
    for sv, f, b in pieces:
        f_peak, b_peak = max(f_peak, prefix + f), max(b_peak, prefix + b)
        prefix += sv
        saved += sv
    return saved, f_peak, b_peak


def layer_signature(cfg: Config, i: int) -> tuple:
    """Layers with equal signatures hold equal bytes (up to the AttnRes source count: the one with the most
    sources is traced for all, an upper bound)."""
    m, bs = cfg.model, cfg.model.attn_res_block_size
    return (m.layer_kind(i), _layer_is_moe(cfg, i), i % bs == 0, (i + 1) % bs == 0)


def mla_key_segments(cfg: Config, cp_rank: int) -> int:
    """CP segments of keys an MLA layer of ``cp_rank`` attends over (kcp/mla_cp.py): its causal prefix ``r + 1``,
    or under ``parallel.mla_cp_balance`` ``max(r, cp - 1 - r) + 1`` (its own and its partner's queries' prefix)."""
    C = cfg.parallel.cp
    if C > 1 and cfg.parallel.mla_cp_balance:
        return max(cp_rank, C - 1 - cp_rank) + 1
    return cp_rank + 1


def piece_layers(cfg: Config) -> dict[tuple, int]:
    """The layer traced for each composed piece: the deepest layer of each signature (:func:`layer_signature`)
    and, under sublayer recomputation, of each token-mixer kind ``("mixer", kind)`` and FFN kind ``("ffn",
    is_moe)`` (the most AttnRes sources: the most bytes)."""
    reps: dict[tuple, int] = {}
    for i in range(cfg.model.num_hidden_layers):
        sig = layer_signature(cfg, i)
        reps[sig] = reps[("mixer", sig[0])] = reps[("ffn", sig[1])] = i
    return reps


def ffn_saved_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
                    deadline: float | None = None) -> dict[bool, int]:
    """``{is_moe: bytes}``: what one micro-batch's FFN sublayer keeps from its forward to its backward, dense and
    MoE, under ``cfg``'s recompute setting -- under sublayer recomputation the very pieces (same fits, same
    ``cache`` entries) that :func:`trace_chunk` composes for every layer of a chunk at ``B x T`` tokens when it
    does not trace it whole; without recomputation the FFN ops of each layer piece, traced alone. They do not
    depend on cp (:func:`piece_depends_on_cp`), which makes them a lower-bound term the planner computes once for
    every layout (``step_time.static_memory_lower_bound``)."""
    reps = piece_layers(cfg)
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    out = {}
    for moe in sorted({k[1] for k in reps if k[0] == "ffn"}):
        i = reps[("ffn", moe)]
        out[moe] = trace_piece(cfg, model, fake, cache, ("ffn", moe), i, i + 1, False, False, "ffn",
                               (moe_chunk,) if moe else (), B=B, T=T, deadline=deadline)[0]
    return out


def most_keys_rank(cfg: Config) -> int:
    """The CP rank whose MLA attends over the most key segments (:func:`mla_key_segments`): rank 0 under the
    query balance, else the last."""
    C = cfg.parallel.cp
    return 0 if C == 1 or cfg.parallel.mla_cp_balance else C - 1


def mixer_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
                deadline: float | None = None) -> dict[str, tuple[int, int]]:
    """``{layer kind: (saved, b_peak)}`` of each token-mixer sublayer under sublayer recomputation, on the CP rank
    whose MLA attends over the most key segments (under balance rank 0, else the last): the very pieces
    :func:`trace_chunk` composes for that rank at ``B x T`` tokens (same fits, same ``cache`` entries; above
    CP_TRACED_MAX from the cp line). With :func:`ffn_saved_bytes` what the planner's static bound composes a
    chunk's sublayers from: the MLA keys of all the cp segments and the KDA pairs of the group are in them."""
    reps = piece_layers(cfg)
    rank = most_keys_rank(cfg)
    out = {}
    for kind in sorted({k[1] for k in reps if k[0] == "mixer"}):
        i = reps[("mixer", kind)]
        saved, _, b_peak = trace_piece(cfg, model, fake, cache, ("mixer", kind), i, i + 1, False, False, "mixer", (),
                                       kind, B=B, T=T, cp_rank=rank, deadline=deadline)
        out[kind] = (saved, b_peak)
    return out


def end_bytes(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, B: int, T: int,
              deadline: float | None = None) -> dict[str, tuple[int, int]]:
    """``{"embed": (saved, b_peak), "head": (saved, b_peak)}``: the first stage's embedding piece and the last
    stage's head piece (the LM head + MTP cross-entropy in token chunks, the MTP layer) as :func:`trace_chunk`
    composes them at ``B x T`` tokens, the head on the CP rank :func:`mixer_bytes` reads (same fits, same ``cache``
    entries). The head's MTP layer keeps a mixer's and an FFN's worth for every micro-batch in flight on the last
    stage: the bound's term for it (``step_time.static_memory_lower_bound``)."""
    from k3train.model.model import CE_CHUNK_TOKENS

    L = cfg.model.num_hidden_layers
    rank = most_keys_rank(cfg)
    moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
    e = trace_piece(cfg, model, fake, cache, ("embed",), 0, 0, True, False, B=B, T=T, deadline=deadline)
    h = trace_piece(cfg, model, fake, cache, ("head",), L, L, False, True, None, (CE_CHUNK_TOKENS, moe_chunk), "mla",
                    B=B, T=T, cp_rank=rank, deadline=deadline)
    return {"embed": (e[0], e[2]), "head": (h[0], h[2])}


def piece_depends_on_cp(cfg: Config, key: tuple, media: MediaCase | None) -> bool:
    """Whether a composed piece's bytes depend on the CP size (and so are traced, and cached, per cp): a token
    mixer (KDA: the KCP pairs of the whole group are gathered and folded; MLA: its keys are the CP rank's key
    segments) and the head (the MTP layer's MLA) do; an FFN does not -- ``K3Layer.run_ffn`` takes no sequence
    layout, so under CP it runs the same ops on the same ``[B, T, d]`` state -- nor does the embedding, unless a
    vision model's first stage encodes media (their placement is per row of ``cp x T`` tokens)."""
    if key[0] == "ffn":
        return False
    if key == ("embed",):
        return bool(cfg.vision.enabled) and (media or MediaCase()).resolved(cfg).source != "none"
    return True


def piece_local_experts(model: nn.Module, a: int, b: int, last: bool, sub: str | None) -> int:
    """The local experts of the LatentMoEs a piece runs (layers ``[a, b)``, or sublayer ``sub`` of layer ``a``;
    the MTP layer with the head): what its traced bytes depend on besides the tokens (:func:`trace_piece`); 0 for
    a piece without routed experts."""
    from k3train.model.moe import LatentMoE

    mods = [] if sub == "mixer" else [model.layers[str(i)] for i in range(a, b)]
    if last and getattr(model, "mtp", None) is not None:
        mods.append(model.mtp)
    return max((m.experts.num_experts for mod in mods for m in mod.modules() if isinstance(m, LatentMoE)),
               default=0)


def trace_piece(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, key: tuple, a: int, b: int,
                fst: bool, lst: bool, sub: str | None = None, chunks: tuple[int, ...] = (), kind: str = "", *,
                B: int, T: int, cp_rank: int = 0, media: MediaCase | None = None,
                deadline: float | None = None) -> tuple[int, int, int]:
    """``(saved, f_peak, b_peak)`` of one composed piece (layers ``[a, b)``, or sublayer ``sub`` of layer ``a``;
    see :func:`trace_range`) for a micro-batch of ``B`` rows of ``T`` tokens on CP rank ``cp_rank``: each byte count
    fitted exactly through traces at :func:`piece_tokens`' token counts and evaluated at ``B x T``; ``cache``
    holds the fits by what the traces depend on (:func:`trace_chunk`'s module comment above)."""
    from parallel.pipeline.stage import recompute_unit

    recompute = cfg.parallel.recompute
    unit = recompute_unit(cfg, recompute)
    chunk_rc = recompute and unit is None  # the whole chunk one region: pieces traced without recomputation
    C = cfg.parallel.cp if piece_depends_on_cp(cfg, key, media) else 1
    # the fits depend on the rows, the CP size and balance (pieces that read the sequence layout), the dtype, the
    # recompute unit, the token counts traced; the encoder's on the media and block recompute; a piece that runs a
    # LatentMoE on its local expert count (:func:`piece_local_experts`: the backward computes one expert weight's
    # gradient for all local experts before it accumulates into ``.grad``, at K3 width 22 MB an expert -- 2.3 GiB at
    # ep 8, 18 GiB at ep 1), so per ep; the route rows are not (every N*k row is computed on the rank's shard,
    # ``_ShardDispatcher``)
    mla = kind == "mla"  # its traces on short documents, at CP ranks 0 and 1 (its keys depend on the rank)
    bk = cfg.model.mla_block_size
    base = (KDA_COMPOSE_TOKENS if kind == "kda" else (bk * B, 2 * bk * B, 4 * bk * B) if mla
            else COMPOSE_TOKENS)
    pts = piece_tokens(B * T, list(chunks), base)
    if C > CP_TRACED_MAX and key != ("embed",):
        line = _on_cp_line(cfg, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                           cp_rank=cp_rank, media=media, deadline=deadline)
        if line is not None:
            return line
    ck = key + (B, C, cfg.train.dtype, cfg.parallel.mla_cp_balance if C > 1 else None,
                None if chunk_rc else unit, pts, piece_local_experts(model, a, b, lst, sub)) + (
                    (media, cfg.parallel.recompute) if key == ("embed",) else ())
    if ck not in cache:
        fits = []

        def traced(r: int, t: int) -> tuple[int, int, int]:
            _check_deadline(deadline)
            dl = bk if mla and (t // B) % bk == 0 else 0
            row = [trace_batch(cfg, B, t // B, rr, dl)[0] for rr in range(C)]  # synthetic CP rows
            return trace_range(cfg, model, a, b, fst, lst, row[r], fake, recompute and not chunk_rc,
                               r if C > 1 else None, row, media, sub)

        ys = [traced(0, t) for t in pts]
        fits.append([_quadratic_fit(pts, [y[k] for y in ys]) for k in range(3)])
        # only the MLA's keys depend on the CP rank (the KCP pairs are the whole group's on every rank); what a key
        # segment more holds (the latents, their ids, the latent gradient) is proportional to the tokens: the
        # rank-1 difference is taken at the smallest token count and scaled
        if C > 1 and mla:
            y1 = traced(1, pts[0])
            fits.append([(f[0], f[1] + (y1[k] - ys[0][k]) / pts[0], f[2]) for k, f in enumerate(fits[0])])
        cache[ck] = fits
    fits = cache[ck]
    vals = [_poly(f, B * T) for f in fits[0]]
    if len(fits) > 1:
        nk = [mla_key_segments(cfg, r) for r in range(min(C, 2))]
        if nk[1] != nk[0]:
            w = (mla_key_segments(cfg, cp_rank) - nk[0]) / (nk[1] - nk[0])
            vals = [y0 + w * (_poly(f1, B * T) - y0) for y0, f1 in zip(vals, fits[1])]
        else:  # cp = 2 balanced: both ranks attend over both segments
            vals = [max(y0, _poly(f1, B * T)) for y0, f1 in zip(vals, fits[1])]
    return tuple(max(0, int(round(y))) for y in vals)


# Above this CP size a cp-dependent piece (a token mixer, a layer, the head) is not traced at its cp: what it holds is
# affine in the CP size at a fixed segment length -- the KDA pairs of the whole group are gathered and kept ([cp, B,
# H, dk, dk+dv]), an MLA rank's keys are its key segments (``mla_key_segments``: cp - r under balance) -- so it is
# traced at CP_LINE (CP ranks 0 and 1), the three points checked to lie on one line, and extended on it. The traces
# at a large cp cost what the cp costs (the KDA fold's backward walks the cp ranks one by one on fake tensors, an
# MLA rank's blockwise attention its key segments: 21 s a trace at cp 64); these cost what cp 4 + 6 + 8 do, once for
# every cp (K3's MLA mixer at 1M: 86 s at (4, 8, 16)).
CP_TRACED_MAX = 16
CP_LINE = (4, 6, 8)


def _on_cp_line(cfg: Config, model: nn.Module, fake: FakeTensorMode, cache: dict, key: tuple, a: int, b: int,
                fst: bool, lst: bool, sub: str | None, chunks: tuple[int, ...], kind: str, *, B: int, T: int,
                cp_rank: int, media: MediaCase | None, deadline: float | None) -> tuple[int, int, int] | None:
    """:func:`trace_piece` at ``cfg.parallel.cp`` from its values at CP_LINE (see above): each byte count of CP
    ranks 0 and 1 extended on its line in the cp, rank ``cp_rank`` placed between them by its MLA key segments as
    :func:`trace_piece` does; None when the points are not on one line (then the piece is traced at its cp)."""
    import dataclasses

    C = cfg.parallel.cp
    ranks = (0, 1) if kind == "mla" else (0,)
    vals: dict[int, list[float]] = {}
    for r in ranks:
        pts = []
        for c in CP_LINE:
            cc = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=c))
            pts.append(trace_piece(cc, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                                   cp_rank=r, media=media, deadline=deadline))
        (c0, c1, c2), line = CP_LINE, []
        for y0, y1, y2 in zip(*pts):
            slope = (y2 - y1) / (c2 - c1)
            if abs((y1 - y0) - slope * (c1 - c0)) > max(64, 1e-6 * abs(y2)):  # rounding of the fits: bytes
                return None
            line.append(y2 + slope * (C - c2))
        vals[r] = line
    out = vals[0]
    if kind == "mla":
        nk = [mla_key_segments(cfg, r) for r in (0, 1)]
        w = (mla_key_segments(cfg, cp_rank) - nk[0]) / (nk[1] - nk[0]) if nk[1] != nk[0] else 0.0
        out = [y0 + w * (y1 - y0) for y0, y1 in zip(vals[0], vals[1])]
    return tuple(max(0, int(round(y))) for y in out)


def trace_chunk(cfg: Config, model: nn.Module, part: Any, plan: Any, v: int, chunk: int, batch: Any,
                fake: FakeTensorMode, cache: dict | None = None, batch_hi: Any = None,
                cp_rank: int = 0, rows: tuple[Any, Any] = (None, None),
                media: MediaCase | None = None, deadline: float | None = None,
                limit: float | None = None, in_flight: int = 1) -> ChunkTrace:
    """Virtual stage ``v`` on one micro-batch of CP rank ``cp_rank`` (see :func:`trace_range`; composed per layer
    above ``TRACE_BUDGET``, ``cache`` holding the per-signature fits).

    Under CP the real KCP context runs with simulated collectives. Composed traces are taken at CP ranks 0 and 1
    and extended to rank r affinely in the MLA key segments of the rank (:func:`mla_key_segments`: every key-side
    byte -- the latent keys, their doc ids, the latent gradient -- grows linearly with them; the KCP pairs are the
    whole group's on every rank). ``deadline``: :class:`TraceDeadline` before any trace that starts after it;
    ``limit``: :class:`TraceTooBig` as soon as the pieces composed so far exceed it, or their saved bytes times
    ``in_flight`` (the forwards of this chunk the schedule runs before the rank's first backward, each holding
    as much) do (composed traces only)."""
    from k3train.model.model import CE_CHUNK_TOKENS
    from parallel.pipeline.stage import recompute_unit

    s, e = part.bounds[v]
    first, last = v == 0, v == part.num_stages - 1
    d = cfg.model.hidden_size
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    B, T = batch.tokens.shape
    recompute = cfg.parallel.recompute
    hi = None
    if whole_traces(cfg, B, T):
        _check_deadline(deadline)
        saved, f_peak, b_peak = trace_range(cfg, model, s, e, first, last, batch, fake, recompute, cp_rank, rows[0],
                                            media)
        if batch_hi is not None:
            hi = trace_range(cfg, model, s, e, first, last, batch_hi, fake, recompute, cp_rank, rows[1], media)
    else:
        cache = {} if cache is None else cache
        L = cfg.model.num_hidden_layers
        unit = recompute_unit(cfg, recompute)
        chunk_rc = recompute and unit is None  # the whole chunk one region: pieces traced without recomputation
        moe_chunk = cfg.model.moe_token_chunk if cfg.model.num_experts > 0 else 0
        reps = piece_layers(cfg)

        def piece(key: tuple, a: int, b: int, fst: bool, lst: bool, sub: str | None = None,
                  chunks: tuple[int, ...] = (), kind: str = "") -> tuple[int, int, int]:
            return trace_piece(cfg, model, fake, cache, key, a, b, fst, lst, sub, chunks, kind, B=B, T=T,
                               cp_rank=cp_rank, media=media, deadline=deadline)

        pieces: list[tuple[int, int, int]] = []

        def add(p: tuple[int, int, int]) -> None:
            pieces.append(p)
            if limit is not None:
                saved_so_far, f_so_far, b_so_far = _compose(pieces)
                held = max(f_so_far, b_so_far, in_flight * saved_so_far)
                if held > limit:
                    raise TraceTooBig(held)

        if first:
            add(piece(("embed",), 0, 0, True, False))
        for i in range(s, e):
            sig = layer_signature(cfg, i)
            kind = cfg.model.layer_kind(i)
            moe = (moe_chunk,) if _layer_is_moe(cfg, i) else ()
            if unit == "sublayer":  # a mixer's bytes depend on its kind and sources, an FFN's on dense / MoE and
                # sources: the deepest layer of each (the most AttnRes sources) is traced for all (an FFN that
                # completes a block holds no more: its partial sum becomes the block)
                mkey, fkey = ("mixer", kind), ("ffn", sig[1])
                add(piece(mkey, reps[mkey], reps[mkey] + 1, False, False, "mixer", (), kind))
                add(piece(fkey, reps[fkey], reps[fkey] + 1, False, False, "ffn", moe))
            else:  # the MoE's token chunks run without recomputation inside a layer / chunk: traced whole
                r = reps[sig]
                add(piece(("layer",) + sig, r, r + 1, False, False, None, (), kind))
        if last:
            # the LM head + MTP cross-entropy in token chunks, the MTP layer's MoE; the MTP's MLA on short documents
            add(piece(("head",), L, L, False, True, None, (CE_CHUNK_TOKENS,) + (moe_chunk,), "mla"))
        saved, f_peak, b_peak = _compose(pieces)
        if chunk_rc:  # the chunk keeps only its inputs; its backward re-runs the forward (already in b_peak)
            saved, f_peak = 0, max(f for _, f, _ in pieces)
    recv = plan_bytes(plan, v - 1, B, T, d, dtype) if not first else 0
    grad_msg = plan_bytes(plan, v, B, T, d, dtype) if not last else 0
    return ChunkTrace(chunk=chunk, stage=v, layers=(s, e), saved=saved, f_peak=f_peak, b_peak=b_peak,
                      recv=recv, grad_msg=grad_msg, seg_lo=segments(batch, cfg.model.kda_chunk_size),
                      seg_hi=segments(batch_hi if batch_hi is not None else batch, cfg.model.kda_chunk_size),
                      hi=hi)


def plan_bytes(plan: Any, boundary: int, B: int, T: int, d: int, dtype: torch.dtype) -> int:
    """Bytes of the p2p payload across ``boundary`` for one micro-batch (AttnRes cached plan)."""
    if plan is None or boundary < 0:
        return 0
    n = len(plan.payload(boundary).items())
    return n * B * T * d * torch.empty((), dtype=dtype).element_size()


def optimizer_transient(cfg: Config, infos: list[Any], owned: set[int], fake: FakeTensorMode,
                        cache: dict[tuple, int]) -> int:
    """Peak temporaries of one parameter update (the real ``muon_step_``/``adamw_step_`` on fake tensors) --
    the update runs one parameter at a time, so the largest over the owned parameters (``cache``: per kind,
    layout and shape)."""
    from k3train.optim.muon import HParams, adamw_step_, muon_step_

    hp = HParams.from_config(cfg.optim, 1e-3)
    best = 0
    for inf in infos:
        if inf.index not in owned:
            continue
        key = (inf.kind, inf.layout, tuple(inf.param.shape), inf.heads, inf.segments, inf.param.dtype)
        if key not in cache:
            lb = LiveBytes()
            with fake:
                w = torch.empty(inf.param.shape, dtype=torch.float32)
                st = [torch.zeros_like(w) for _ in range(2)]
            step = torch.zeros(())  # real, as the optimizer keeps it (read on the host every step)
            with fake, KnownData(), lb:
                _track_existing(lb, None, [w, step, *st], inf.param, inf.param.grad)
                base = lb.live
                g = inf.param.grad.float() if inf.param.grad is not None else torch.zeros_like(w)
                if inf.kind == "muon":
                    muon_step_(w, g, st[0], hp, inf)
                else:
                    adamw_step_(w, g, st[0], st[1], step, hp, inf.decay)
                cache[key] = lb.peak - base
        best = max(best, cache[key])
    return best


# --------------------------------------------------------------------------------------------------------------
# analytic communication buffers
# --------------------------------------------------------------------------------------------------------------
def ep_buffers(cfg: Config, model: nn.Module, ep: int, B: int, T: int) -> tuple[int, int, int]:
    """``(persistent buffers, bytes of one MoE layer's replicas, MoE layers held)``: the EP token send/receive
    buffers and MoonEP's replica pool (``moonep.replica_pool``: NUM_BANKS banks of ``[E/ep, l, f] x 3`` shared by
    every MoE layer, allocated at the first dispatch)."""
    from k3train.model.moe import LatentMoE
    from moonep.comm import token_buffer_rows

    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if ep == 1 or not moes:
        return 0, 0, len(moes)
    m = cfg.model
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    n = m.num_experts // ep
    # one dispatch per token chunk of a LatentMoE (model.moe_token_chunk): the buffers hold one chunk's rows
    n_tok = min(B * T, m.moe_token_chunk) if m.moe_token_chunk > 0 else B * T
    send, recv = token_buffer_rows(n_tok, m.num_experts_per_token, ep, n, cfg.parallel.moonep)
    persistent = (send + recv) * m.expert_hidden_size * es
    replica = 3 * n * m.expert_hidden_size * m.moe_intermediate_size * es if cfg.parallel.moonep else 0
    if replica:
        from moonep.replica_pool import NUM_BANKS

        persistent += NUM_BANKS * replica
    return persistent, replica, len(moes)


# --------------------------------------------------------------------------------------------------------------
# the schedule walk
# --------------------------------------------------------------------------------------------------------------
def walk_schedule(program: list[Any], traces: dict[int, ChunkTrace], grad_full: dict[int, int],
                  grad_owned: dict[int, int], zero: int, per_mb_extra: dict[int, int],
                  b_extra: dict[int, int], msg_bytes: Any, cached_grad: dict[int, int],
                  mb_segs: list[int | None], timeline: list | None = None,
                  pairs: Any = None, pair_done: float = 0.5) -> tuple[int, int, int, str]:
    """Walk this rank's real program (``parallel.pipeline.p2p.build_programs``: receives posted ahead, computes,
    sends) holding what the runner holds: a received payload from its post to the B that consumes it, a
    micro-batch's saved bytes from its F to its B, the gradients sent back until the next compute, the block-cache
    gradients of earlier local chunks until their B. Returns ``(peak above params+optimizer+persistent buffers,
    activations at the peak, gradients at the peak, action at the peak)``.

    ``pairs`` (F/B pairing, ``parallel.overlap_ep``; ``program`` is then the paired one, :func:`paired_programs`):
    the first compute of every pair -> its trailing-post count (``pair_programs``' firsts); it and the next
    compute run at the same time on two threads. The F's saved
    bytes grow while the B frees its micro-batch's, so the pair's peak is where the F ends (its own peak: the
    head and loss come last) with the B ``pair_done`` of the way through, having freed that share of its saved
    bytes (the two threads share the cores: with a backward k times the forward, the F ends when the B has done
    1/k of its work) -- unless the B consumes a received gradient (not the last stage): the next stage sends it
    from a pair of its own, so when the F ends the B may still wait for it, having freed nothing (measured so at
    pp 2 x vpp 2); at least the B's own peak. What actually meets depends on the threads' timing: measured
    peaks vary run to run by a few percent (tools/memory.py --measure)."""
    computes = [ins.action for ins in program if ins.op == "compute"]
    last_b = {a.chunk: i for i, a in enumerate(computes) if a.kind == "B"}
    grads = {c: 0 for c in traces}
    held, pending_send, cache_g = 0, 0, {}
    best = (-1, 0, 0, "")
    i = -1
    with_next: Any = None  # the first compute of the running pair (its effects apply with the second's)
    # a pair's first compute posts its trailing receives (the instructions after the second) as soon as it ends
    # (PipelineRunner.run_pair): a paired F's are held at the F's end already
    x_recv = {ins.action: sum(msg_bytes(p.msg) for p in program[k + 2:k + 2 + pairs[ins.action]] if p.op == "recv")
              for k, ins in enumerate(program) if ins.op == "compute" and pairs and ins.action in pairs}
    for ins in program:
        if ins.op == "recv":
            held += msg_bytes(ins.msg)
            continue
        if ins.op == "send":
            continue
        i += 1
        a = ins.action
        if pairs and a in pairs and with_next is None:
            with_next = a
            continue
        acts = [(with_next, i - 1), (a, i)] if with_next is not None else [(a, i)]
        with_next = None
        # gradients of the chunk's first B are created inside it (autograd keeps the fresh tensor as .grad): the
        # trace's b_peak (run with .grad pre-set) already holds their size, so they count from the next action on
        g = sum(grads.values())
        live = held + pending_send + sum(cache_g.values())
        peaks = {}
        for x, _ in acts:
            saved, f_peak, b_peak = traces[x.chunk].at(mb_segs[x.mb])
            if x.kind == "B" and grads[x.chunk] == 0:
                grads[x.chunk] = grad_full[x.chunk]
            if x.kind == "F":
                peaks["F"] = f_peak + per_mb_extra[x.chunk]
            else:
                # b_peak is measured from before this micro-batch's forward: it includes its own saved bytes
                peaks["B"] = b_peak - saved + b_extra[x.chunk]
                # a B that consumes a received gradient may still wait for it when the F ends: nothing freed
                done = 0.0 if traces[x.chunk].grad_msg else pair_done
                peaks["B freed"] = int(done * (saved + per_mb_extra[x.chunk]))
        if len(acts) == 1:
            cand = live + peaks.get("F", peaks.get("B"))
        else:  # a pair: the F's peak at its end, the B partly through (docstring); at least the B's own peak
            cand = live + max(peaks["F"] - peaks["B freed"] + x_recv.get(acts[0][0], 0), peaks["B"])
        what = "+".join(repr(x) for x, _ in acts)
        if cand + g > best[0]:
            best = (cand + g, cand, g, what)
        if timeline is not None:
            timeline.append((what, live + g, cand + g))
        pending_send = 0  # sends get one compute of slack (PipelineRunner.run_instr)
        for x, k in acts:
            tr = traces[x.chunk]
            saved = tr.at(mb_segs[x.mb])[0]
            if x.kind == "F":
                held += saved + per_mb_extra[x.chunk]
            else:
                held -= saved + per_mb_extra[x.chunk] + tr.recv + tr.grad_msg
                pending_send = tr.recv
                cache_g.pop((x.chunk, x.mb), None)
                if cached_grad.get(x.chunk):
                    cache_g[(x.chunk - 1, x.mb)] = cached_grad[x.chunk]
                if zero == 2 and last_b[x.chunk] == k:
                    grads[x.chunk] = grad_owned[x.chunk]
    return best[0], best[1], best[2], best[3]


def paired_programs(cfg: Any, programs: list[list[Any]], pp: int, vpp: int
                    ) -> tuple[list[list[Any]], list[Any]]:
    """``(programs, firsts)`` the runner executes: under F/B pairing (``cfg.ep_overlap()``) the paired programs
    (pp > 1: ``p2p_programs.pair_programs``; pp = 1: LocalRunner's F(0), then F(m+1) with B(m), then B(M-1))
    and per rank ``{first compute of each pair: its trailing-post count}``; else ``programs`` and no pairs."""
    if not cfg.ep_overlap()[0]:
        return programs, [{} for _ in programs]
    if pp > 1:
        from parallel.pipeline.p2p_programs import pair_programs

        return pair_programs(programs, pp, vpp)
    from parallel.pipeline.p2p import Instr
    from parallel.pipeline.schedules import Action

    M = sum(1 for ins in programs[0] if ins.op == "compute") // 2
    order = [Action("F", 0, 0)] + [x for m in range(M - 1) for x in (Action("F", 0, m + 1), Action("B", 0, m))]
    order.append(Action("B", 0, M - 1))
    return [[Instr("compute", action=a) for a in order]], [{Action("F", 0, m + 1): 0 for m in range(M - 1)}]


# --------------------------------------------------------------------------------------------------------------
def check_modelled(cfg: Any) -> None:
    """Refuse (one ConfigError line) what this estimate does not model: ``train.objective=eagle3`` runs the frozen
    target forward-only with the draft's forward and backward on the last stage (k3train/draft/objective.py), not
    the LM training step traced here. Called by tools/memory.py and tools/plan.py before any work."""
    from k3train.config import ConfigError

    if cfg.train.objective != "lm":
        raise ConfigError(f"train.objective: the memory estimate and the planner model LM training (train.objective="
                          f"lm), not the {cfg.train.objective} draft step ({cfg.origin('train.objective')})")


def estimate(cfg: Config, world_size: int, cache: Any = None, media: MediaCase | None = None) -> Estimate:
    """Per-rank memory of one training step of ``cfg`` on ``world_size`` ranks (see the module docstring).

    ``media`` (a vision model): what the first stage's encoder is traced on (:class:`MediaCase`; default
    ``auto``: on multimodal data the worst case -- every position of the micro-batch a placeholder of the largest
    images the config allows --, on text data no media). The
    step's media pixels (float32, every micro-batch of the step, on every rank: the loader holds them) are in
    ``buffers`` (``detail["media_pixels"]``).

    ``cache`` (optional, e.g. ``k3train.planning.plan.EstimateCache``; one per model config): shares the fake
    mode, the fake full model per ep (``cache.full_model(cfg, ep, fake)``), the composed per-layer fits
    (``cache.pieces``) and the optimizer-transient traces (``cache.ns``) across calls -- the planner's speed-up."""
    from k3train.optim.param_groups import build_param_infos
    from k3train.parallelize import ParallelModel
    from k3train.optim.zero import assign_owners
    from moonep.shard import mark_expert_params
    from parallel.dims import ParallelDims
    from parallel.pipeline.attnres_comm import AttnResCommPlan
    from parallel.pipeline.partition import build_partition
    from parallel.pipeline.schedules import build_schedule, resolve_schedule

    t0 = time.perf_counter()
    media = (media or MediaCase()).resolved(cfg)
    media.check(cfg)
    pc = cfg.parallel
    dims0 = ParallelDims.from_config(pc, world_size, 0)
    P, D, C, E = dims0.pp, dims0.dp, dims0.cp, dims0.ep
    part = build_partition(cfg.model, pc, cfg.train.seq_len)
    M = cfg.train.grad_accum_steps
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len // C
    plan = AttnResCommPlan(part, pc.attnres_comm) if P > 1 else None
    from k3train.planning.step_time import forwards_before_first_backward

    paired = cfg.ep_overlap()[0]  # F/B pairing: its schedule (one more warm-up forward) and paired programs
    in_flight = forwards_before_first_backward(resolve_schedule(pc.schedule, P, part.vpp) if P > 1 else "none", P,
                                               part.vpp, M, paired)
    if P > 1:
        from parallel.pipeline.p2p import build_programs

        programs = build_programs(build_schedule(resolve_schedule(pc.schedule, P, part.vpp), P, part.vpp, M,
                                                 paired), P, part.vpp)
    else:
        from parallel.pipeline.p2p import Instr
        from parallel.pipeline.schedules import Action

        programs = [[Instr("compute", action=Action(k, 0, m)) for m in range(M) for k in "FB"]]
    # F/B pairing (parallel.overlap_ep): the program the runner executes, two computes at once in every pair
    programs, pair_firsts = paired_programs(cfg, programs, P, part.vpp)
    es = 2 if cfg.train.dtype == "bfloat16" else 4
    all_groups = dims0._enumerate_groups()
    fake = cache.fake if cache is not None else FakeTensorMode(allow_non_fake_inputs=True)
    ranks: list[RankMemory] = []
    cp_batches: dict[int, tuple[Any, Any]] = {}
    batch_src = ""
    # document segments of every micro-batch of the costed steps, per (dp, cp) rank (rank (0, 0)'s for all when
    # there are more than 16 data ranks)
    rank_segs: dict[tuple[int, int], list[list[int | None]]] = {}
    px_bytes: dict[tuple[int, int], int] = {}  # per (dp, cp) rank: one step's media pixels (real data)
    piece_cache: dict = cache.pieces if cache is not None else {}
    stages: list[dict[str, Any]] = []
    if cache is not None:
        full = cache.full_model(cfg, E, fake)
    else:
        full = build_full(cfg, E, 0, fake)
        mark_expert_params(full)
    for pp_rank in range(P):
        _check_deadline(getattr(cache, "deadline", None))
        model = build_stage(full, part, pp_rank)
        # ownership over the real group ranks (identical for every pipeline of this stage)
        infos = build_param_infos([model], cfg.optim,
                                  functools.partial(ParallelModel.grad_group_fn, None))  # the trainer's groups
        rank0 = dims0.rank_of(pp_rank, 0, 0)
        for inf in infos:
            inf.group_ranks = next(g for g in all_groups[inf.group] if rank0 in g)
        if pc.zero >= 1:
            assign_owners(infos, cfg.optim.ns_steps)
        local_chunks = part.local_chunks(pp_rank)
        from parallel.pipeline.stage import chunk_param_groups, shares_embedding

        groups, shared = chunk_param_groups(model, part, pp_rank, shares_embedding(model, part))
        if shared:
            groups[0 if pp_rank == 0 else len(groups) - 1] += shared
        if not cp_batches:  # the traced micro-batches of each CP rank (lowest / highest KDA padding)
            coords = ([(d, c) for d in range(D) for c in range(C)] if D * C <= 16
                      else [(0, c) for c in range(C)] if C <= 16 else [])
            data = {dc: data_microbatches(cfg, *dc) for dc in coords}
            if data and all(data.values()) and tuple(data[(0, 0)][0][0].tokens.shape) == (B, T):
                nch = functools.partial(segments, chunk=cfg.model.kda_chunk_size)
                for cr in range(C):  # (micro-batch, its row of CP segments) by padded chunks of rank cr
                    flat = sorted(((st[i][j], [data[(d, c)][i][j] for c in range(C)])
                                   for (d, c0), st in data.items() if c0 == cr
                                   for i in range(len(st)) for j in range(len(st[i]))), key=lambda x: nch(x[0]))
                    hi = flat[-1] if nch(flat[-1][0]) > nch(flat[0][0]) else (None, None)
                    cp_batches[cr] = (flat[0][0], hi[0], flat[0][1], hi[1])
                rank_segs = {dc: [[nch(mb) for mb in step] for step in st] for dc, st in data.items()}
                px_bytes = {dc: max(media_pixel_bytes(cfg, step, media) for step in st) for dc, st in data.items()}
                batch_src = ("the run's data (steps 2-3; the least and most padded micro-batch of each CP rank, "
                             "others interpolated by their padded KDA chunks)")
            else:
                cp_batches = {cr: (trace_batch(cfg, B, T, cr)[0], None, None, None) for cr in range(C)}
                batch_src = trace_batch(cfg, 1, 1)[1]
            if not whole_traces(cfg, B, T):
                unit = "sublayer" if cfg.parallel.recompute_granularity == "sublayer" and pc.recompute else "layer"
                batch_src = (f"per-{unit} traces (trace_chunk: 3 token counts each, in the token-chunked regime "
                             f"of the MoE and the LM-head cross-entropy), fitted and composed for {B * T} tokens "
                             "(one document per row; MLA on short documents)")
        params = _nbytes(list(model.parameters())) + _nbytes(list(model.buffers()))
        traces_cp: dict[int, dict[int, ChunkTrace]] = {}
        *fwd, _ = in_flight[pp_rank]
        limit = getattr(cache, "limit", None)  # the device's bytes: what the stage's weights leave to one chunk
        try:
            for cr in range(C):
                batch, batch_hi, row, row_hi = cp_batches[cr]
                traces_cp[cr] = {c: trace_chunk(cfg, full, part, plan, part.stage(pp_rank, c) if P > 1 else 0, c,
                                                batch, fake, piece_cache, batch_hi, cr, (row, row_hi), media,
                                                getattr(cache, "deadline", None),
                                                None if limit is None else limit - params, max(1, fwd.count(c)))
                                 for c in range(len(local_chunks))}
        except TraceTooBig as e:  # the rank holds its weights too
            raise TraceTooBig(e.nbytes + params) from None
        traces = traces_cp[0]
        ep_persist, replica, n_moe = ep_buffers(cfg, model, E, B, T)
        if pair_firsts[pp_rank]:  # side 1 of the pairs has token buffers and a replica pool of its own (EPSide)
            ep_persist *= 2
        moe_per_chunk = {c: sum(1 for i in range(*local_chunks[c]) if _layer_is_moe(cfg, i))
                         for c in range(len(local_chunks))}
        # MoonEP's replica weights live in the shared pool (persistent, in ``ep_persist``), nothing per layer and
        # micro-batch; one layer's backward holds its replicas' gradients and at most two reduce-back rounds
        per_mb_extra = {c: 0 for c in traces}
        b_extra = {c: (3 * replica if moe_per_chunk[c] else 0) for c in traces}
        p2p_bufs = 0  # receive/send buffers are walked with the program (in activations)
        program = programs[pp_rank]
        per_stage_bytes: dict[int, int] = {}  # payload bytes by boundary: one plan lookup per boundary

        def msg_bytes(msg: Any, _tb: int = B * T * cfg.model.hidden_size * es) -> int:
            if msg.stage not in per_stage_bytes:
                per_stage_bytes[msg.stage] = _msg_bytes(plan, _tb, msg)
            return per_stage_bytes[msg.stage]

        cached_grad = {c: (plan.known_blocks(part.stage(pp_rank, c)) * B * T * cfg.model.hidden_size * es
                           if plan is not None else 0) for c in traces}
        by_id = {id(inf.param): inf for inf in infos}
        owned_cache: dict[int, tuple] = {}
        walk_cache: dict[tuple, tuple] = {}  # the walk depends on the owned set only through ZeRO-2's grad shards
        grad_full = {ci: _nbytes(g) for ci, g in enumerate(groups)}
        view_cache: dict[Any, Any] = {}
        ns_cache: dict[tuple, int] = cache.ns if cache is not None else {}
        for d in range(D):
            for c in range(C):
                rank = dims0.rank_of(pp_rank, d, c)
                ep_rank = (d * C + c) % E
                owned = (_owned_by(rank, infos, all_groups, cfg.optim.ns_steps, view_cache) if pc.zero >= 1
                         else {inf.index for inf in infos})
                step_segs = rank_segs.get((d, c), rank_segs.get((0, c), [[None] * M]))
                traces = traces_cp[c]
                key = hash((frozenset(owned), str(step_segs), c))
                if key not in owned_cache:
                    grad_owned = ({ci: _nbytes([p for p in g if by_id[id(p)].index in owned])
                                   for ci, g in enumerate(groups)} if pc.zero == 2 else grad_full)
                    opt = 0
                    for inf in infos:
                        if inf.index in owned:
                            n = inf.numel
                            opt += n * 4 * (1 if inf.kind == "muon" else 2) + (4 if inf.kind != "muon" else 0)
                            if inf.param.dtype != torch.float32:
                                opt += n * 4
                    ns_t = optimizer_transient(cfg, infos, owned, fake, ns_cache)
                    wkey = (c, str(step_segs), tuple(grad_owned.values()) if pc.zero == 2 else None)
                    if wkey not in walk_cache:
                        walk_cache[wkey] = max(
                            walk_schedule(program, traces, grad_full, grad_owned, pc.zero, per_mb_extra, b_extra,
                                          msg_bytes, cached_grad, segs, pairs=pair_firsts[pp_rank],
                                          pair_done=1 / 3 if pc.recompute else 1 / 2)
                            for segs in step_segs)
                    peak_dyn, act, g_at, where = walk_cache[wkey]
                    g_end = sum(grad_owned.values()) if pc.zero == 2 else sum(grad_full.values())
                    step_peak = g_end + ns_t + _bucket_transient(infos, owned, pc.zero)
                    owned_cache[key] = (opt, peak_dyn, act, g_at, where, step_peak, g_end)
                opt, peak_dyn, act, g_at, where, step_peak, g_end = owned_cache[key]
                media_px = px_bytes.get((d, c), px_bytes.get((0, c), media_pixel_bytes(cfg, None, media)))
                bufs = ep_persist + p2p_bufs + media_px
                if step_peak > peak_dyn:
                    peak, where, grads_at, act_at = params + opt + bufs + step_peak, "optimizer step", g_end, 0
                else:
                    peak, grads_at, act_at = params + opt + bufs + peak_dyn, g_at, peak_dyn - g_at
                ranks.append(RankMemory(rank=rank, pp_rank=pp_rank, dp_rank=d, cp_rank=c, ep_rank=ep_rank,
                                        params=params, grads=grads_at, optimizer=opt, activations=act_at,
                                        buffers=bufs, peak=peak, peak_at=where,
                                        detail={"ep_token_buffers": ep_persist, "moonep_replicas_per_layer": replica,
                                                "p2p": p2p_bufs, "moe_layers": n_moe, "media_pixels": media_px}))
        stages.append({"pp_rank": pp_rank, "chunks": [asdict(t) for t in traces.values()],
                       "layers": [list(x) for x in local_chunks]})
        del model
    ranks.sort(key=lambda r: r.rank)
    if piece_cache:  # per-signature bytes (saved, f_peak, b_peak) of the composed traces, for the report
        stages.append({"pieces": {"/".join(str(x) for x in k): v for k, v in piece_cache.items()}})
    layout = (f"world={world_size} pp={P} vpp={part.vpp} dp={D} cp={C} ep={E} zero={pc.zero} moonep={pc.moonep} "
              f"recompute={pc.recompute} dtype={cfg.train.dtype} mbs={B} seq={cfg.train.seq_len} M={M}; "
              f"traced on {batch_src} micro-batch{media.note(cfg)}")
    return Estimate(layout=layout, ranks=ranks, stages=stages, seconds=time.perf_counter() - t0)


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


def _msg_bytes(plan: Any, tensor_bytes: int, msg: Any) -> int:
    return len(plan.payload(msg.stage).items()) * tensor_bytes


def _layer_is_moe(cfg: Config, layer: int) -> bool:
    m = cfg.model
    return m.num_experts > 0 and layer >= m.first_k_dense_replace


def _bucket_transient(infos: list[Any], owned: set[int], zero: int) -> int:
    """The reduction's flat bucket copy (``DistributedOptimizer._launch``: up to 64 MiB, torch.cat)."""
    cap = 64 * 2**20
    biggest = max((inf.numel * inf.param.element_size() for inf in infos), default=0)
    return min(cap, biggest) if zero < 2 else 0


def format_table(est: Estimate, all_ranks: bool = False) -> str:
    """Per pipeline stage: every rank (the worst one when a stage has more than 8, or all with ``all_ranks``),
    per category in GiB (MiB when every peak is under 4 GiB)."""
    big = max((r.peak for r in est.ranks), default=0) >= 4 * 2**30
    unit, div = ("GiB", 2**30) if big else ("MiB", 2**20)
    head = f"{'rank':>6} {'pp':>3} {'dp':>5} {'cp':>3} {'ep':>4} " + " ".join(f"{c:>11}" for c in CATEGORIES)
    head += f" {'peak ' + unit:>9} {'measured':>9} {'err':>6}  at"
    lines = [est.layout, head]
    by_pp: dict[int, list[RankMemory]] = {}
    for r in est.ranks:
        by_pp.setdefault(r.pp_rank, []).append(r)
    for pp, rs in sorted(by_pp.items()):
        show = rs if all_ranks or len(rs) <= 8 else [max(rs, key=lambda r: r.peak)]
        for r in show:
            meas = f"{r.measured_peak / div:9.3f}" if r.measured_peak else f"{'':>9}"
            err = f"{100 * (r.peak - r.measured_peak) / r.measured_peak:+5.1f}%" if r.measured_peak else ""
            lines.append(f"{r.rank:>6} {r.pp_rank:>3} {r.dp_rank:>5} {r.cp_rank:>3} {r.ep_rank:>4} "
                         + " ".join(f"{getattr(r, c) / div:11.3f}" for c in CATEGORIES)
                         + f" {r.peak / div:9.3f} {meas} {err:>6}  {r.peak_at}")
    return "\n".join(lines)



def compose_check(cfg: Config) -> list[dict[str, Any]]:
    """The per-layer composition (what K3-length sequences use) against a whole-chunk trace, for a config short
    enough to trace whole: per pipeline stage and CP rank, ``(saved, f_peak, b_peak)`` both ways, on synthetic
    rows (one document per row). ``tools/memory.py --check-compose``."""
    from parallel.pipeline.partition import build_partition

    global TRACE_BUDGET
    part = build_partition(cfg.model, cfg.parallel, cfg.train.seq_len)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    full = build_full(cfg, cfg.parallel.ep, 0, fake)
    C, B = cfg.parallel.cp, cfg.train.micro_batch_size
    T = cfg.train.seq_len // C
    row = [trace_batch(cfg, B, T, r)[0] for r in range(C)]
    cache: dict = {}
    out = []
    for cr in range(C):
        for v in range(part.num_stages):
            whole = trace_chunk(cfg, full, part, None, v, 0, row[cr], fake, None, None, cr, (row, None))
            budget, TRACE_BUDGET = TRACE_BUDGET, 0
            try:
                comp = trace_chunk(cfg, full, part, None, v, 0, row[cr], fake, cache, None, cr)
            finally:
                TRACE_BUDGET = budget
            out.append({"stage": v, "cp_rank": cr, "whole": [whole.saved, whole.f_peak, whole.b_peak],
                        "composed": [comp.saved, comp.f_peak, comp.b_peak]})
    return out
