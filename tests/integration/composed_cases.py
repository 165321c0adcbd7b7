"""Shared pieces of the composed-parallelism integration test: the tiny config per layout, a global batch of real
KJV tokens, and the single-process reference (loss, every gradient, router biases after one QB step).

The reference is the plain ``K3Model(cfg.model)`` built on CPU and initialised with ``init_weights(train.seed)``
(what the contract says any meta-built / pruned / sharded model must reproduce), run over the global batch's
micro-batches with the same :class:`LossNorm` the trainer uses.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import cycle

import torch

from k3train.config import Config
from k3train.config.presets import tiny_config
from model_variants import VARIANTS
from shipped_data import shipped_view
from k3train.data.batch import Batch
from k3train.data.corpus import DEFAULT_CORPUS, read_documents
from k3train.data.tokenizer import load_tokenizer
from k3train.model.model import K3Model
from parallel.pipeline.loss_norm import LossNorm
from reference_step import single_process_step

WORLD = 4
SEQ_LEN = 32
GBS = 4
MBS = 1
# documents are KJV chapters cut to these token lengths (then EOS): several documents per 33-token sample, some
# crossing the CP boundary at T/2 = 16 and some the sample boundaries
DOC_LENGTHS = (9, 21, 13, 30, 6, 17, 25, 11)


@dataclass(frozen=True)
class Layout:
    """One composed layout on ``WORLD`` ranks (dp derived: WORLD / (pp * cp))."""

    name: str
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    moonep: bool = True
    variant: str = "k3"  # a key of VARIANTS (the reference is built with the same)
    seq_len: int = SEQ_LEN
    gbs: int = GBS
    extra: tuple[str, ...] = ()  # further overrides (recompute, chunk sizes); the reference runs without them

    def overrides(self) -> list[str]:
        return [*VARIANTS[self.variant],
                f"--parallel.pp={self.pp}", f"--parallel.vpp={self.vpp}", f"--parallel.cp={self.cp}",
                f"--parallel.ep={self.ep}", f"--parallel.moonep={str(self.moonep).lower()}",
                f"--train.seq_len={self.seq_len}", f"--train.global_batch_size={self.gbs}",
                f"--train.micro_batch_size={MBS}", "--train.device=cpu", "--train.dtype=float32",
                f"--model.max_position_embeddings={max(4096, self.seq_len)}",
                f"--data.path={shipped_view('corpus_text_document')}", *self.extra]


def make_cfg(layout: Layout | None = None, variant: str = "k3", seq_len: int = SEQ_LEN,
             gbs: int = GBS, extra: tuple[str, ...] = ()) -> Config:
    """configs/tiny.yaml (8 layers: KDA x3, MLA, KDA x3, MLA; dense first layer, 7 LatentMoE; MTP) for ``layout``
    (``None``: the single-process reference of model variant ``variant`` on ``gbs`` rows of ``seq_len``, ``extra``
    overrides)."""
    over = (layout.overrides() if layout is not None
            else Layout("ref", variant=variant, seq_len=seq_len, gbs=gbs, extra=extra).overrides())
    return tiny_config(*over, world_size=WORLD if layout is not None else 1)


def kjv_global_batch(seq_len: int = SEQ_LEN, rows: int = GBS) -> Batch:
    """``rows`` packed samples of ``seq_len + 1`` real tokens: KJV chapters (encoded with the shipped tokenizer),
    each cut to a length from ``DOC_LENGTHS`` and terminated by EOS, packed back to back (as Megatron packs)."""
    tok = load_tokenizer()
    need = rows * (seq_len + 1)
    stream: list[int] = []
    docs = read_documents(DEFAULT_CORPUS)
    for n in cycle(DOC_LENGTHS):
        if len(stream) >= need:
            break
        ids = tok.encode(next(docs).text)[:n]
        stream.extend(ids + [tok.eos_id])
    samples = torch.tensor(stream[:need], dtype=torch.long).view(rows, seq_len + 1)
    return Batch.from_samples(samples, eos_id=tok.eos_id)


def kjv_single_document(seq_len: int) -> Batch:
    """One row of ``seq_len + 1`` real tokens forming ONE document (KJV chapters run together, no EOS): a
    document that spans every CP segment of the row."""
    tok = load_tokenizer()
    stream: list[int] = []
    docs = read_documents(DEFAULT_CORPUS)
    while len(stream) < seq_len + 1:
        stream.extend(tok.encode(next(docs).text))
    samples = torch.tensor(stream[:seq_len + 1], dtype=torch.long).view(1, seq_len + 1)
    assert not bool((samples == tok.eos_id).any())
    return Batch.from_samples(samples, eos_id=tok.eos_id)


def rank_micro_batches(full: Batch, dp: int, dp_rank: int, cp: int, cp_rank: int, mbs: int = MBS) -> list[Batch]:
    """This rank's micro-batches exactly as ``GlobalBatchLoader.next_step`` cuts them: the dp_rank-th block of
    rows, split into micro-batches of ``mbs`` rows, each sliced to the cp_rank-th contiguous segment."""
    mine = full.micro_batches(full.tokens.shape[0] // dp)[dp_rank]
    return [mb.slice_cp(cp_rank, cp) if cp > 1 else mb for mb in mine.micro_batches(mbs)]


def loss_norm(cfg: Config, full: Batch) -> LossNorm:
    """The trainer's LossNorm: global-batch token counts (``Trainer.train_step``)."""
    w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0
    return LossNorm(lm_tokens=full.num_lm_tokens(), mtp_tokens=full.num_mtp_tokens(), mtp_weight=w)


def crosses_cp_boundary(full: Batch, cp: int) -> bool:
    """Whether some document runs across a CP segment boundary (so KCP has a chain/halo to carry)."""
    T = full.tokens.shape[1]
    cuts = [T // cp * i for i in range(1, cp)]
    return any(bool((full.doc_ids[:, c - 1] == full.doc_ids[:, c]).any()) for c in cuts)


@dataclass
class Reference:
    grads: dict[str, torch.Tensor]        # every parameter's gradient, by FQN
    params: dict[str, torch.Tensor]       # initial values, by FQN
    stats: dict[str, float]               # loss, lm_loss_sum, mtp_loss_sum of the global batch
    loads: dict[str, torch.Tensor]        # router FQN -> expert_loads[E] of the step (top-k choices)
    hist: dict[str, torch.Tensor]         # router FQN -> QB histogram [E, bins] of the step
    bias: dict[str, torch.Tensor]         # router FQN -> bias after balance_step()
    bin_width: dict[str, float]           # router FQN -> QB histogram bin width of that step


def reference(cfg: Config, full: Batch) -> Reference:
    """Single process, whole global batch (micro-batches of ``MBS`` rows), the trainer's LossNorm."""
    torch.manual_seed(0)
    model = K3Model(cfg.model)
    model.init_weights(cfg.train.seed)
    model.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    norm = loss_norm(cfg, full)
    grads, stats = single_process_step(model, full.micro_batches(MBS), norm)
    loads, hist, bias, width = {}, {}, {}, {}
    for name, r in model.routers():
        loads[name], hist[name] = r.expert_loads.clone(), r.qb_hist.clone()
        width[name] = float(r.bias.max() - r.bias.min() + 2.0) / r.bins  # qb_histogram_range: [min-1, max+1]
        r.balance_step()
        bias[name] = r.bias.clone()
    return Reference(grads=grads, params=params, stats=stats, loads=loads, hist=hist, bias=bias, bin_width=width)
