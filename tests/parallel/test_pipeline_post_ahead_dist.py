"""Receives posted one compute ahead over real gloo processes: an odd pipeline (pp = 3, interleaved) and fewer
micro-batches than stages (1F1B, M = 2 < pp), both post orders, loss and EVERY parameter gradient equal to the
single-process K3Model (the other gloo layouts, pp 2 and 4, run the default posted-ahead order in
test_pipeline_dist.py)."""
from __future__ import annotations

import pytest
import torch

from dist_helpers import run_distributed
from k3train.config.presets import tiny_pipeline_config as tiny_cfg
from parallel.comm_stats import sum_over_ranks
from parallel.dims import ParallelDims
from parallel.pipeline import LossNorm, build_step_runner
from pipeline_harness import assert_grads_match, full_model, make_batches, reference

LAYOUTS = [(2, 3, (True,)), (1, 2, (True, False))]  # (vpp, M, post_ahead modes), pp = 3


def _body(rank: int, world: int, refs: dict) -> None:
    torch.set_num_threads(1)
    for vpp, M, modes in LAYOUTS:
        cfg = tiny_cfg(world, vpp, micro_batches=M, layers=6)
        dims = ParallelDims.from_config(cfg.parallel, world, rank).build_groups()
        batches = make_batches(cfg, M)
        norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
        ref, rstats = refs[M]
        for ahead in modes:
            runner = build_step_runner(full_model(cfg), cfg, dims, num_microbatches=M, post_ahead=ahead)
            assert runner.post_ahead is ahead
            stats = runner.forward_backward(batches, norm)
            where = f"pp={world} vpp={vpp} M={M} post_ahead={ahead}"
            assert stats["recv_wait_s"] >= 0.0, where
            assert_grads_match(runner.model, ref)
            tot = sum_over_ranks(stats, keys=["loss", "p2p_bytes", "p2p_recv_bytes"])
            assert tot["loss"] == pytest.approx(rstats["loss"], rel=1e-6), where
            assert tot["p2p_bytes"] == tot["p2p_recv_bytes"] > 0, where


def test_pp3_posted_ahead_matches_single_process() -> None:
    refs = {}
    for vpp, M, _ in LAYOUTS:
        cfg = tiny_cfg(3, vpp, micro_batches=M, layers=6)
        refs[M] = reference(cfg, make_batches(cfg, M))
    run_distributed(_body, 3, refs)
