"""One traced forward + backward of a range of layers (or one sublayer) on fake tensors: the bytes it keeps and
its transient peaks, booked by :class:`~k3train.planning.fakerun.live_bytes.LiveBytes`."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import Config
from k3train.model.attnres import AttnResState, canonical_layout
from k3train.model.seq import SeqInfo
from k3train.planning.dtypes import train_dtype
from k3train.planning.fakerun.known_data import KnownData
from k3train.planning.fakerun.live_bytes import LiveBytes
from k3train.planning.fakerun.sim_collectives import simulated_collectives
from k3train.planning.fakerun.synthetic import cp_rank_seq, trace_batch
from k3train.planning.memory.media import MediaCase, media_batch
from parallel.pipeline.stage import recompute_chunk, recompute_unit, run_maybe_recomputed


def track_existing(lb: LiveBytes, model: nn.Module | None, *objs: Any) -> None:
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
    n_in, has_partial = canonical_layout(s, cfg.model.attn_res_block_size, cfg.model.residual)  # the input
    # state's blocks / partial sum
    if part == "ffn":
        has_partial = True  # the FFN continues the mixer's partial sum
    model.set_recompute(recompute_unit(cfg, recompute))
    B, T = batch.tokens.shape
    sim: Any = contextlib.nullcontext
    if cp_rank is None or cfg.parallel.cp == 1:
        seq = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    else:  # the real KCP context of CP rank ``cp_rank`` (``cp_row``: every CP rank's segment of these rows),
        # built by all CP ranks as threads; the step's collectives simulated (k3train.planning.fakerun)
        sim = simulated_collectives
        row = cp_row if cp_row is not None else [trace_batch(cfg, B, T, r)[0] for r in range(cfg.parallel.cp)]
        seq = cp_rank_seq(cfg, row, cp_rank)
    if first and getattr(model, "vision", None) is not None:
        batch = media_batch(cfg, batch, (media or MediaCase()).resolved(cfg), cp_rank if cfg.parallel.cp > 1 else None, fake)
        model.vision.encoder.recompute_blocks = cfg.parallel.recompute  # as the runner sets it
    lb = LiveBytes()
    with fake:
        leaves = [] if first else _input_leaves(cfg, B, T, n_in, has_partial)
    with sim(), fake, KnownData(), lb:
        # everything that exists before the step (weights, their .grad, buffers such as the router's counters,
        # the batch, the sequence layout, the received inputs) is booked first, so that a view or an in-place op
        # on it is not mistaken for a new storage (the real run books them at creation)
        track_existing(lb, model, batch, batch.media, seq, leaves)
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
        b_peak = _backward(cfg, lb, out, last, n_in) - base
        del out
    return saved, f_peak, b_peak


def _input_leaves(cfg: Config, B: int, T: int, n_in: int, has_partial: bool) -> list[torch.Tensor]:
    """The received input state of a chunk that does not start the model: ``n_in`` blocks and the partial sum."""
    d, dtype = cfg.model.hidden_size, train_dtype(cfg)
    blocks = [torch.empty(B, T, d, dtype=dtype).requires_grad_() for _ in range(n_in)]
    partial = torch.empty(B, T, d, dtype=dtype).requires_grad_() if has_partial else None
    return blocks + ([partial] if partial is not None else [])


def _backward(cfg: Config, lb: LiveBytes, out: Any, last: bool, n_in: int) -> int:
    """The traced forward's backward (from the loss, or from the received gradient payload of its outputs); the live
    bytes' peak during it."""
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
    return lb.phase_peak.get("backward", mark)
