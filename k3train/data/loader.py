"""Global-batch loader: layout-independent batches for every (dp, cp) rank.

Step ``s`` of training consumes samples ``[c, c + GBS)`` of the seeded, shuffled train ``GPTDataset``, where
``c = consumed_samples`` before the step (``s * GBS`` from a fresh start). The global batch -- which samples,
in which order -- therefore depends only on the data, ``train.seed``, ``train.seq_len``, ``data.split`` and
``train.global_batch_size``, never on the parallel layout:

* data-parallel rank ``r`` of ``dp`` takes the contiguous block of rows ``[r * GBS/dp, (r+1) * GBS/dp)``;
* that block is cut into ``GBS / (dp * micro_batch_size)`` micro-batches of ``micro_batch_size`` rows;
* each micro-batch is context-parallel sliced (:meth:`Batch.slice_cp`) for ``cp_rank`` of ``cp``.

Concatenating the dp ranks' micro-batches in (dp rank, micro-batch) order, and the CP slices along the
sequence, gives back the global batch exactly. Masks, labels and ``doc_ids`` are computed on full rows before
any slicing (see :mod:`k3train.data.batch`).

:meth:`GlobalBatchLoader.global_token_counts` returns the loss-token counts of the WHOLE global batch of the
step last returned; every rank reads all GBS samples to compute them, so no communication is needed.

Construction calls :func:`k3train.data.dataset.build_gpt_datasets`, which is collective over the default
process group when ``torch.distributed`` is initialised: construct the loader on EVERY rank (pipeline stages
that never read data included), in the same order.

The number of train samples requested from Megatron is ``train.steps * GBS``; the order of the first epoch is
independent of ``train.steps`` (Megatron's shuffles only depend on the seed and on the number of epochs), so
resuming with a larger ``train.steps`` continues the same order as long as the run stays within one epoch.

``data.format: chat`` reads :class:`k3train.data.chat.dataset.ChatDataset` (whole conversations, the loss on the
assistant's tokens); ``data.format: multimodal`` reads :class:`k3train.data.multimodal.dataset.MultimodalDataset` instead (rows of
whole documents whose media spans are never cut; every micro-batch carries ``Batch.media``); indices, dp/cp
split and resume state are the same.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from k3train.data.batch import Batch
from k3train.data.chat.dataset import build_chat_dataset
from k3train.data.corpus import DataError
from k3train.data.dataset import build_gpt_datasets, sample_tokens
from k3train.data.multimodal.dataset import build_multimodal_dataset
from k3train.data.tokenizer import TextTokenizer, load_config_tokenizer

logger = logging.getLogger(__name__)


class GlobalBatchLoader:
    """Per-rank view of the global batches of one split.

    Args:
        cfg: the run :class:`k3train.config.Config` (uses ``data.path``, ``data.tokenizer``, ``data.split``,
            ``train.seq_len``, ``train.seed``, ``train.global_batch_size``, ``train.micro_batch_size``,
            ``train.steps`` and ``model.vocab_size``).
        dp_rank, dp, cp_rank, cp: this rank's data-/context-parallel coordinates.
        consumed_samples: samples already consumed (resume); must be reached with the same GBS history.
        split: ``"train"`` (``train.steps * GBS`` samples) or ``"valid"``/``"test"`` (one epoch, read
            cyclically so any number of evaluation steps works).
        tokenizer: an already loaded tokenizer (default: load ``cfg.data.tokenizer``).
        device: where ``next_step()`` puts the micro-batches (the device of the rank's model; default CPU).

    ``next_step()`` returns this rank's micro-batches for the next step, each ``[micro_batch_size,
    seq_len / cp]`` on ``device``.
    """

    def __init__(self, cfg: Any, dp_rank: int = 0, dp: int = 1, cp_rank: int = 0, cp: int = 1,
                 consumed_samples: int = 0, split: str = "train", tokenizer: TextTokenizer | None = None,
                 device: torch.device | str = "cpu") -> None:
        t = cfg.train
        self.device = torch.device(device)
        self.gbs, self.mbs, self.seq_len = int(t.global_batch_size), int(t.micro_batch_size), int(t.seq_len)
        self.dp_rank, self.dp, self.cp_rank, self.cp = dp_rank, dp, cp_rank, cp
        self.split = split
        self.seed = int(t.seed)
        if not (dp >= 1 and 0 <= dp_rank < dp and cp >= 1 and 0 <= cp_rank < cp):
            raise DataError(f"bad data/context-parallel coordinates dp_rank={dp_rank}/{dp}, cp_rank={cp_rank}/{cp}")
        if self.gbs < 1 or self.mbs < 1 or self.gbs % (self.mbs * dp):
            raise DataError(f"train.global_batch_size={self.gbs} must be a positive multiple of "
                            f"micro_batch_size*dp = {self.mbs}*{dp}")
        if self.seq_len % cp:
            raise DataError(f"train.seq_len={self.seq_len} is not divisible by cp={cp}")
        if split not in ("train", "valid", "test"):
            raise DataError(f"unknown split {split!r} (train, valid or test)")
        if consumed_samples < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.tokenizer = tokenizer if tokenizer is not None else load_config_tokenizer(cfg)
        model_vocab = getattr(getattr(cfg, "model", None), "vocab_size", None)
        if model_vocab is not None and model_vocab < self.tokenizer.vocab_size:
            raise DataError(f"model.vocab_size={model_vocab} is smaller than the tokenizer's {self.tokenizer.vocab_size} "
                            f"ids ({self.tokenizer.path})")
        self.data_path = str(cfg.data.path)
        num_samples = {"train": max(1, int(t.steps)) * self.gbs, "valid": None, "test": None}
        # data.format=multimodal: whole-document rows with their media (k3train/data/multimodal/dataset.py; built
        # the same way on every rank, no collective)
        fmt = getattr(cfg.data, "format", "text")
        self.multimodal = fmt == "multimodal"
        self.packed = fmt in ("multimodal", "chat")  # a dataset of whole-document rows with its own .batch()
        if self.multimodal:
            self.dataset = build_multimodal_dataset(cfg, self.tokenizer, split, num_samples[split])
        elif fmt == "chat":  # whole conversations, the loss on the assistant's tokens (k3train/data/chat/dataset.py)
            self.dataset = build_chat_dataset(cfg, self.tokenizer, split, num_samples[split])
        else:
            # build only the split this loader reads: an unread split, however small, must not fail the run
            datasets = build_gpt_datasets(self.data_path, self.tokenizer, self.seq_len, self.seed, cfg.data.split,
                                          {split: num_samples[split]})
            if split not in datasets:
                raise DataError(f"data.split={cfg.data.split!r} gives the {split} split weight 0")
            self.dataset = datasets[split]
        self.num_samples = len(self.dataset)
        self.cyclic = split != "train"
        self.consumed_samples = int(consumed_samples)
        self._last: int | None = None  # consumed_samples at the start of the last step (for token counts)

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dims(cls, cfg: Any, dims: Any, consumed_samples: int = 0, split: str = "train",
                  tokenizer: TextTokenizer | None = None, device: torch.device | str = "cpu") -> "GlobalBatchLoader":
        """Build from a :class:`parallel.dims.ParallelDims` (uses ``dp_rank, dp, cp_rank, cp``)."""
        return cls(cfg, dims.dp_rank, dims.dp, dims.cp_rank, dims.cp, consumed_samples, split, tokenizer, device)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per step on each rank."""
        return self.gbs // (self.mbs * self.dp)

    def global_sample_indices(self, consumed: int | None = None) -> np.ndarray:
        """Dataset indices of the global batch that starts at ``consumed`` (default: the next step's)."""
        c = self.consumed_samples if consumed is None else consumed
        idx = np.arange(c, c + self.gbs, dtype=np.int64)
        if self.cyclic:
            return idx % self.num_samples
        if idx[-1] >= self.num_samples:
            raise DataError(f"{self.split} data exhausted: step needs samples up to {int(idx[-1])} but the dataset "
                            f"was built with {self.num_samples} (train.steps * global_batch_size)")
        return idx

    def _rows(self, indices: np.ndarray) -> Batch:
        if self.packed:
            return self.dataset.batch(indices)
        samples = torch.from_numpy(np.stack([sample_tokens(self.dataset, i) for i in indices]))
        return Batch.from_samples(samples, self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)

    def global_batch(self, consumed: int | None = None) -> Batch:
        """The whole global batch ``[GBS, seq_len]`` starting at ``consumed`` (no dp/cp split)."""
        return self._rows(self.global_sample_indices(consumed))

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next step (``grad_accum_steps`` of ``[mbs, seq_len/cp]``), and
        advance ``consumed_samples`` by GBS. Reads only this data-parallel rank's ``GBS/dp`` rows (a contiguous
        block of the global batch; rows are independent, so the split cannot change their contents)."""
        per_dp = self.gbs // self.dp
        idx = self.global_sample_indices()[self.dp_rank * per_dp:(self.dp_rank + 1) * per_dp]
        mine = self._rows(idx)
        out = [mb.slice_cp(self.cp_rank, self.cp) if self.cp > 1 else mb for mb in mine.micro_batches(self.mbs)]
        if self.device.type != "cpu":  # the rows are read on the host; the model's device takes them from here
            out = [mb.to(self.device, non_blocking=True) for mb in out]
        self._last = self.consumed_samples
        self.consumed_samples += self.gbs
        return out

    def global_token_counts(self) -> tuple[int, int]:
        """``(lm_tokens, mtp_tokens)`` of the whole global batch of the step last returned by
        :meth:`next_step` (identical on every rank). Reads the whole global batch: the trainer instead sums
        its own micro-batches' counts over the data x context parallel group (``LossNorm.from_batches``)."""
        if self._last is None:
            raise RuntimeError("global_token_counts() called before next_step()")
        full = self.global_batch(self._last)
        return full.num_lm_tokens(), full.num_mtp_tokens()

    # ------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Resume state: consumed samples plus what the sample order depends on (checked on load)."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len,
                "split": self.split, "data_path": self.data_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "consumed_samples" not in state:
            raise DataError("data loader state has no 'consumed_samples'")
        for key, ours in (("seed", self.seed), ("seq_len", self.seq_len), ("split", self.split)):
            if key in state and state[key] != ours:
                logger.warning("data loader resumed with %s=%r but the checkpoint used %r: the sample order "
                               "differs from the original run", key, ours, state[key])
        self.consumed_samples = int(state["consumed_samples"])
        self._last = None
