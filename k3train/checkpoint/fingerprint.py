"""What makes a checkpoint belong to a run: its fingerprint, and its LR schedule.

Why: resuming must continue the SAME run. The fingerprint holds what defines the run's trajectory -- the model
section (shapes and numerics), the data (path, split, tokenizer file hash), the seed, the sequence length and the
global batch size -- and is stored in every checkpoint; a start whose fingerprint differs is refused, naming the
keys. What may change between invocations (the parallel layout, the step count, logging, checkpoint.*) is not in
it. The LR schedule (optim.* and train.steps) may change, but a resume under a different schedule is warned about,
with the LR at the resume step under the old and the new schedule.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from k3train.config import Config, ModelConfig
from k3train.data.tokenizer import tokenizer_sha256
from k3train.optim.schedule import lr_at

# model fields with no effect on the maths of a run (activation recomputation and chunking only trade memory; the
# chunk sizes change at most the order of fp32 sums), so a resume may change them to fit another device
_MODEL_EXEMPT = ("attn_res_recompute", "mla_block_size", "mixer_head_chunk", "moe_token_chunk")


def _settable(section: Any) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(section, f.name), list) else v)
            for f in dataclasses.fields(section) if not f.metadata.get("derived")}


def run_fingerprint(cfg: Config) -> dict[str, Any]:
    """Flat ``{"section.key": value}`` of what defines the run (see the module docstring)."""
    out = {f"model.{k}": v for k, v in _settable(cfg.model).items() if k not in _MODEL_EXEMPT}
    out["data.path"] = str(Path(cfg.data.path).resolve())
    out["data.split"] = cfg.data.split
    tok = Path(cfg.data.tokenizer)
    out["data.tokenizer_sha256"] = tokenizer_sha256(tok)
    if cfg.data.format == "chat":  # which conversations rows hold (absent otherwise: older checkpoints compare)
        out["data.chat_overlong"] = cfg.data.chat_overlong
    out["train.seed"] = cfg.train.seed
    out["train.seq_len"] = cfg.train.seq_len
    out["train.global_batch_size"] = cfg.train.global_batch_size
    if cfg.train.objective != "lm":  # an EAGLE-3 draft run (absent for "lm": older checkpoints stay comparable)
        out["train.objective"] = cfg.train.objective
        out["train.draft_loss"] = cfg.train.draft_loss
        out["train.draft_steps"] = cfg.train.draft_steps
        out["train.draft_feature_blocks"] = list(cfg.train.draft_feature_blocks)
        out["checkpoint.target"] = str(Path(cfg.checkpoint.target).resolve())
    return out


def _field_default(key: str) -> Any:
    """The declared default of a ``model.*`` field, or a sentinel when it has none."""
    name = key.split(".", 1)[1] if key.startswith("model.") else None
    for f in dataclasses.fields(ModelConfig):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return object()


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["key old -> new", ...]`` for every key whose value differs (or exists on one side only). A model field
    missing from an older checkpoint (added to k3train since) counts as its declared default: the old run
    used the behaviour that default keeps."""
    out = []
    for k in sorted(set(old) | set(new)):
        if k not in old and k in new and new[k] == _field_default(k):
            continue
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if a != b:
            out.append(f"{k} {a} -> {b}")
    return out


# the optim fields lr_at reads
_SCHEDULE_KEYS = ("lr", "min_lr_ratio", "schedule", "warmup_steps", "wsd_decay_fraction")


def schedule_record(cfg: Config) -> dict[str, Any]:
    """What the LR schedule depends on: its optim fields and the run length."""
    return {"optim": {k: getattr(cfg.optim, k) for k in _SCHEDULE_KEYS}, "train.steps": cfg.train.steps}


def schedule_change(old: dict[str, Any], cfg: Config, step: int) -> str | None:
    """A one-line warning when the schedule of the checkpoint's run differs from ``cfg``'s, else None."""
    new = schedule_record(cfg)
    if old == new:
        return None

    changed = [f"train.steps {old['train.steps']} -> {new['train.steps']}"] if old["train.steps"] != new[
        "train.steps"] else []
    changed += [f"optim.{k} {old['optim'].get(k)} -> {v}" for k, v in new["optim"].items()
                if old["optim"].get(k) != v]
    try:
        old_lr = lr_at(step, SimpleNamespace(**old["optim"]), old["train.steps"])
        lr_note = f"{old_lr:.3e} under the old schedule"
    except (TypeError, ValueError, AttributeError) as e:
        lr_note = f"unknown under the old schedule ({e})"
    new_lr = lr_at(step, cfg.optim, cfg.train.steps)
    return (f"resuming at step {step} with a changed LR schedule ({', '.join(changed)}): the LR at step {step} "
            f"is {new_lr:.3e} now, it was {lr_note}")
