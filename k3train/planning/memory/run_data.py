"""The run's own micro-batches (when its dataset can be read), and what of them a trace's memory depends on."""
from __future__ import annotations

from typing import Any

from k3train.config import Config
from k3train.data.loader import GlobalBatchLoader
from k3train.model.seq import cu_seqlens_from_doc_ids


def data_microbatches(cfg: Config, dp_rank: int = 0, cp_rank: int = 0,
                      steps: tuple[int, int] = (1, 3)) -> list[list[Any]] | None:
    """This run's real micro-batches of steps ``steps`` (0-based, end exclusive: the 2nd and 3rd -- the steps
    ``--measure`` takes its peak over; the first has no optimizer state yet) for one (dp, cp) rank, through the
    project's loader; None when the dataset cannot be read (or sequences are over 64K tokens)."""
    if cfg.train.seq_len > 65536:
        return None
    try:
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
    lens = cu_seqlens_from_doc_ids(batch.doc_ids).diff()
    return int(((lens + chunk - 1) // chunk).sum())
