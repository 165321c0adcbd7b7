"""Start from a Hugging Face checkpoint: check it against the run (before anything is built), then fill each rank's
part of the model with the tensors it owns.

:func:`check_hf_checkpoint` is the preflight (``k3train/preflight.py`` runs it for ``checkpoint.load_hf``): the
checkpoint's ``config.json`` maps to the run's ``model`` / ``vision`` sections (k3train/hf/config_map.py), every
shard's header is read and checked (k3train/hf/safetensors_dir.py), and every tensor of the model has exactly one
way it is stored (k3train/hf/names.py) -- a missing tensor, a wrong shape or dtype, a tensor the model has no
place for, a truncated shard: one ConfigError line naming it, exit 2, nothing built.

:func:`load_hf_weights` runs on every rank after the model is built and sharded (pipeline stage, expert shard):
it reads only the tensors of the parameters this rank holds -- for routed experts only its own experts' rows
(per-expert tensors of those experts, or the rows of a fused stack through a safetensors slice) -- shard file
by shard file, and copies them in. Nothing is gathered; there is no communication.
"""
from __future__ import annotations

import logging
import resource
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from k3train.config import Config, ConfigError
from k3train.hf.config_map import check_run_matches, read_config_json, sections_from_config_json
from k3train.hf.names import Slot, Source, model_slots
from k3train.hf.safetensors_dir import BYTE_DTYPES, FLOAT_DTYPES, HFCheckpointDir, TensorInfo

log = logging.getLogger(__name__)
KEY = "checkpoint.load_hf"


def choose_source(slot: Slot, have: dict[str, TensorInfo], where: str = KEY) -> Source:
    """The one source of ``slot`` the checkpoint holds (all its tensors present, shapes and dtypes right); else a
    ConfigError naming the missing tensor or the wrong shape."""
    mismatch: tuple[str, str] | None = None
    partial: tuple[Source, int] | None = None
    for src in slot.sources:
        present = sum(1 for p in src.parts if p.key in have)
        if present == len(src.parts):
            for p in src.parts:
                info = have[p.key]
                if info.shape != p.shape:
                    mismatch = mismatch or (p.key, f"shape {list(info.shape)} in {info.file}, the model needs "
                                                   f"{list(p.shape)} ({slot.fqn})")
                    break
                ok = FLOAT_DTYPES if p.kind == "float" else BYTE_DTYPES
                if info.dtype not in ok:
                    mismatch = mismatch or (p.key, f"dtype {info.dtype} in {info.file}, expected one of "
                                                   f"{', '.join(ok)} ({slot.fqn})")
                    break
            else:
                return src
        elif present and (partial is None or present > partial[1]):
            partial = (src, present)
    if mismatch is not None:
        raise ConfigError(f"{where}: tensor {mismatch[0]}: {mismatch[1]}")
    src = partial[0] if partial is not None else slot.sources[0]
    missing = next(p.key for p in src.parts if p.key not in have)
    raise ConfigError(f"{where}: tensor {missing} is missing from the checkpoint (needed for {slot.fqn})")


def plan_sources(cfg: Config, ckpt: HFCheckpointDir, where: str = KEY) -> dict[str, Source]:
    """``fqn -> Source`` for every tensor of the model; ConfigError for a missing, misshapen or unexpected one."""
    have = ckpt.tensors
    plan = {s.fqn: choose_source(s, have, where) for s in model_slots(cfg)}
    claimed = {p.key for src in plan.values() for p in src.parts}
    extra = sorted(set(have) - claimed)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(f"{where}: tensor {extra[0]}{more} in the checkpoint is not part of the configured model")
    return plan


def check_hf_checkpoint(cfg: Config, hf_dir: str | Path | None = None) -> dict[str, Source]:
    """The preflight of ``checkpoint.load_hf`` (see the module docstring). Returns the source plan."""
    hf_dir = Path(hf_dir or cfg.checkpoint.load_hf)
    where = f"{KEY}: {hf_dir}"
    cj = read_config_json(hf_dir)
    _, model, vision = sections_from_config_json(cj, f"{where}/config.json")
    check_run_matches(cfg, model, vision, KEY)
    return plan_sources(cfg, HFCheckpointDir(hf_dir, where), where)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


@torch.no_grad()
def load_hf_weights(modules: Iterable[nn.Module], cfg: Config, hf_dir: str | Path | None = None) -> dict[str, Any]:
    """Copy the HF checkpoint's tensors into the parameters and persistent buffers of ``modules`` (this rank's
    model chunks; expert stacks may hold a shard: ``_k3_shard_offset``). No communication. Returns this rank's
    statistics: tensors, bytes read, seconds, peak RSS."""
    t0 = time.perf_counter()
    hf_dir = Path(hf_dir or cfg.checkpoint.load_hf)
    ckpt = HFCheckpointDir(hf_dir, f"{KEY}: {hf_dir}")
    slots = {s.fqn: s for s in model_slots(cfg)}
    jobs = []
    for mod in modules:
        for fqn, t in mod.state_dict(keep_vars=True).items():
            slot = slots.get(fqn)
            if slot is None:
                raise ConfigError(f"{KEY}: model tensor {fqn} has no place in the checkpoint layout")
            src = choose_source(slot, ckpt.tensors)
            rows = None
            if slot.expert:
                e0 = int(getattr(t, "_k3_shard_offset", 0))
                rows = range(e0, e0 + t.shape[0])
            jobs.append((ckpt.file_order(src.parts[0].key), fqn, t, slot, src, rows))
    jobs.sort(key=lambda j: j[0])  # shard by shard
    for _, fqn, t, slot, src, rows in jobs:
        value = src.load(ckpt.read, slot.shape, rows)
        if tuple(value.shape) != tuple(t.shape):
            raise ConfigError(f"{KEY}: {fqn}: read {tuple(value.shape)} from the checkpoint, this rank holds "
                              f"{tuple(t.shape)}")
        t.copy_(value.to(t.dtype))
    ckpt.close()
    stats = {"tensors": len(jobs), "bytes_read": ckpt.bytes_read, "seconds": time.perf_counter() - t0,
             "peak_rss_gib": _peak_rss_gib()}
    log.info("loaded %d tensors (%.1f MiB read) from %s in %.2f s", stats["tensors"], stats["bytes_read"] / 2 ** 20,
             hf_dir, stats["seconds"])
    return stats


def log_load_stats(stats: dict[str, Any], hf_dir: str | Path) -> None:
    """Rank 0 logs every rank's import time, bytes read and peak RSS (one all_gather_object over the world, which
    every rank joins once)."""
    every = [stats]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, stats)
    log.info("started from %s: per rank %s", hf_dir, ", ".join(
        f"r{r} {s['seconds']:.2f}s {s['bytes_read'] / 2 ** 20:.1f}MiB rss {s['peak_rss_gib']:.2f}GiB"
        for r, s in enumerate(every)))
