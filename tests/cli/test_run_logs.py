"""Logs that say true things: a stable MFU denominator (configured, or measured once per host and cached), one
wandb run id per training run across resumes, warnings once (rank 0), per-rank MoE layer counts, and no torch
"torch.distributed is disabled" warning on single-process checkpoint save/load."""
from __future__ import annotations

import logging
import warnings

import torch

from k3train.checkpoint import CheckpointManager
from k3train.config import load_config
from k3train.reporting.metrics import peak_flops_cache_path, resolve_peak_flops, wandb_run_id
from k3train.parallelize import moe_layers_held
from k3train.trainer import _RankZeroWarnings


def test_peak_flops_is_configured_or_the_best_measurement_per_host(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("K3TRAIN_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert resolve_peak_flops(5e9, cpu) == (5e9, "logging.peak_flops")
    path = peak_flops_cache_path(cpu)
    assert not path.exists()  # a configured peak measures nothing
    first, src = resolve_peak_flops(0.0, cpu)
    assert first > 0 and "measured now" in src and path.is_file()
    key = next(iter(json.loads(path.read_text())))
    # a reading taken under load (lower) never replaces a better one: the cached best is the denominator
    path.write_text(json.dumps({key: {"flops": 1e18, "when": "x"}}))
    again, src = resolve_peak_flops(0.0, cpu)
    assert again == 1e18 and "cached in" in src and json.loads(path.read_text())[key]["flops"] == 1e18
    # a cached figure below what this machine reaches now (it was measured under load) is raised
    path.write_text(json.dumps({key: {"flops": 1.0, "when": "x"}}))
    raised, src = resolve_peak_flops(0.0, cpu)
    assert raised > 1.0 and "measured now" in src and json.loads(path.read_text())[key]["flops"] == raised


def test_wandb_run_id_survives_resume(tmp_path):
    rid = wandb_run_id(tmp_path, resumed=False)
    assert wandb_run_id(tmp_path, resumed=True) == rid
    assert wandb_run_id(tmp_path, resumed=False) != rid  # a new run (resume=none) is a new wandb run


def test_rank_independent_warnings_once():
    f = _RankZeroWarnings()

    def rec(level: int, **extra) -> logging.LogRecord:
        r = logging.LogRecord("x", level, __file__, 1, "m", None, None)
        r.__dict__.update(extra)
        return r

    assert not f.filter(rec(logging.WARNING))  # rank 0 logs the same warning
    assert f.filter(rec(logging.WARNING, rank_specific=True)) and f.filter(rec(logging.ERROR))


def test_moe_layers_held_counts_backbone_and_mtp():
    from k3train.model.model import K3Model

    cfg = load_config("configs/tiny.yaml")
    with torch.device("meta"):
        model = K3Model(cfg.model)
    assert moe_layers_held([model]) == (7, 1)  # layers 1..7 (layer 0 dense) + the MTP layer's


def test_single_process_checkpoint_is_quiet(tmp_path):
    m = CheckpointManager(tmp_path, keep=1)
    state = {"w": torch.arange(4.0)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        path = m.save(1, state, {"step": 1})
        m.load(path, {"w": torch.zeros(4)})
    assert not [w for w in seen if "torch.distributed is disabled" in str(w.message)], [str(w.message) for w in seen]
