"""Checks that run before any process group, model or training step exists, so bad input fails in one line.

Covers what ``Config.validate`` cannot see from the config alone: the dataset files (missing, truncated, index
not matching the data, token ids beyond the vocabulary), the tokenizer against the model's vocabulary, the
pipeline partition and whether the schedule can run with this many micro-batches.
"""
from __future__ import annotations

from pathlib import Path

from k3train.config import Config, ConfigError


def preflight(cfg: Config) -> None:
    from k3train.data import DataError, load_tokenizer, validate_indexed_dataset

    tok_path = Path(cfg.data.tokenizer)
    if not tok_path.is_file():
        raise DataError(f"data.tokenizer: tokenizer file not found: {tok_path}")
    tok = load_tokenizer(tok_path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                          f"{tok.vocab_size} ids ({tok_path})")
    validate_indexed_dataset(cfg.data.path, vocab_size=cfg.model.vocab_size)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not (Path(resume) / "COMPLETE").is_file():
        raise ConfigError(f"checkpoint.resume: {resume} is not a complete checkpoint directory (no COMPLETE marker)")

    from parallel.pipeline.partition import build_partition
    from parallel.pipeline.schedules import build_schedule, resolve_schedule

    p = cfg.parallel
    build_partition(cfg.model, p, cfg.train.seq_len)
    if p.pp > 1 and cfg.train.grad_accum_steps:
        build_schedule(resolve_schedule(p.schedule, p.pp, p.vpp), p.pp, p.vpp, cfg.train.grad_accum_steps)
