"""The frozen target of EAGLE-3 draft training: ``checkpoint.target=PATH``, a checkpoint of a trained k3train run.

:func:`check_target` (called by ``k3train.preflight.preflight``: before any process group or model exists) refuses,
in one line each, a path that is not a complete checkpoint, a damaged one, a target without an MTP layer (the
draft is fine-tuned from it), a target of another model (its recorded model section, or the shapes of its tensors
against this run's model), and a target trained with another tokenizer. It reads only the ``COMPLETE`` marker
and DCP's metadata (through the restricted unpickler of k3train/checkpoint/safe_load.py).

:func:`load_target` (the trainer, collective) verifies the checksums (every rank a share of the files) and loads
the target's weights -- every tensor of the model except the draft's ``W_E3`` -- through the same safe loading a
resume uses (``CheckpointManager.load``); the replica embedding of the last pipeline stage is refreshed after.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from k3train.checkpoint.fingerprint import fingerprint_diff, run_fingerprint
from k3train.checkpoint.manager import COMPLETE, read_info, verify
from k3train.checkpoint.safe_load import SafeFileSystemReader
from k3train.config import Config, ConfigError
from k3train.model.model import K3Model

# model fields that do not change the function a trained target computes (initialisation, the MTP loss weight of
# its training, the router-balancing rule that moved its biases, kernel tiling): they may differ in the draft run
TARGET_EXEMPT = ("init_std", "mtp_loss_weight", "router_balance", "qb_estimator", "qb_bins", "qb_ema",
                 "sign_update_rate", "mla_block_size", "kda_chunk_size", "attn_res_recompute")
DRAFT_ONLY_PREFIX = "eagle3."  # what the target checkpoint does not hold


def _fail(cfg: Config, msg: str) -> None:
    raise ConfigError(f"checkpoint.target: {msg} ({cfg.origin('checkpoint.target')})")


def check_target(cfg: Config) -> None:
    """Preflight of ``checkpoint.target`` for ``train.objective=eagle3`` (module docstring)."""
    path = Path(cfg.checkpoint.target)
    if not path.is_dir():
        _fail(cfg, f"{path} does not exist")
    if not (path / COMPLETE).is_file():
        _fail(cfg, f"{path} is not a complete checkpoint (no {COMPLETE} marker): name a step directory, e.g. "
                   f"RUN/checkpoints/step_00000200")
    why = verify(path, checksum=False)
    if why:
        _fail(cfg, f"{path} is damaged: {why}")
    old = read_info(path).get("fingerprint") or {}
    if old.get("model.num_nextn_predict_layers", 1) == 0:
        _fail(cfg, f"{path} has no MTP layer (its run had model.num_nextn_predict_layers=0); the EAGLE-3 draft is "
                   f"fine-tuned from the target's MTP layer")
    new = run_fingerprint(cfg)
    keys = [k for k in old if k.startswith("model.") and k.split(".", 1)[1] not in TARGET_EXEMPT]
    diff = fingerprint_diff({k: old[k] for k in keys}, {k: new.get(k) for k in keys})
    if diff:
        _fail(cfg, f"{path} is a checkpoint of another model: {'; '.join(diff[:4])} (the draft run's model "
                   f"section must be the target's)")
    if old.get("data.tokenizer_sha256") and old["data.tokenizer_sha256"] != new["data.tokenizer_sha256"]:
        _fail(cfg, f"{path} was trained with another tokenizer than data.tokenizer={cfg.data.tokenizer} (sha256 "
                   f"{old['data.tokenizer_sha256'][:12]}... vs {new['data.tokenizer_sha256'][:12]}...)")
    _check_shapes(cfg, path)


def _check_shapes(cfg: Config, path: Path) -> None:
    """Every tensor of this run's model (except W_E3) is in the target's DCP metadata with the same shape."""

    try:
        stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable metadata file is bad input here
        _fail(cfg, f"{path}: cannot read its metadata ({type(e).__name__}: {e})")
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in K3Model(cfg.model, cfg.vision).state_dict().items()}
    have = {k[len("model."):]: tuple(getattr(v, "size", ())) for k, v in stored.items() if k.startswith("model.")}
    if any(k.startswith("mtp.") for k in want) and not any(k.startswith("mtp.") for k in have):
        _fail(cfg, f"{path} has no MTP layer (no mtp.* tensors); the EAGLE-3 draft is fine-tuned from the target's "
                   f"MTP layer")
    missing = [k for k in want if k not in have]
    wrong = [f"{k} {list(have[k])} in the checkpoint, {list(v)} here" for k, v in want.items()
             if k in have and have[k] != v]
    if missing or wrong:
        what = wrong[:2] + [f"{k} missing" for k in missing[:2]]
        _fail(cfg, f"{path} is a checkpoint of another model shape: {'; '.join(what)}")


def load_target(ckpt: Any, pm: Any, cfg: Config) -> None:
    """Load the target's weights into this rank's model (collective; module docstring). ``ckpt``: the run's
    CheckpointManager; ``pm``: the ParallelModel."""
    path = Path(cfg.checkpoint.target)
    found, damaged = ckpt.select([path])
    if found is None:
        raise ConfigError(f"checkpoint.target: {path} is damaged ({damaged[0][1]})")
    state = {"model": {k: v for k, v in pm.state_dict().items() if not k.startswith(DRAFT_ONLY_PREFIX)}}
    ckpt.load(path, state, key="checkpoint.target", rank_state=False)
    pm.load_state_dict(state["model"])
