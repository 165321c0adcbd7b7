"""Pipeline parallelism over real gloo processes: loss and EVERY parameter gradient (after the data-parallel sum)
equal the single-process K3Model on the same global batch; cached and full AttnRes communication give the same
gradients and cached moves fewer bytes; pp = 2 (both neighbours the same rank) with many micro-batches."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from k3train.config.presets import tiny_pipeline_config as tiny_cfg
from parallel.comm_stats import sum_over_ranks
from parallel.dims import ParallelDims
from parallel.pipeline import LossNorm, build_step_runner
from pipeline_harness import assert_grads_match, full_model, make_batches, reference


Layout = tuple  # (pp, vpp, dp, M, pp_layers, comms, schedule)


def _run_layout(rank: int, world: int, layout: Layout, refs: dict) -> None:
    pp, vpp, dp, M, pp_layers, comms, schedule = layout
    results = {}
    for comm in comms:
        cfg = tiny_cfg(pp, vpp, dp, comm=comm, micro_batches=M, pp_layers=pp_layers, schedule=schedule)
        dims = ParallelDims.from_config(cfg.parallel, world, rank).build_groups()
        batches = make_batches(cfg, M * dp)
        mine = batches[dims.dp_rank * M:(dims.dp_rank + 1) * M]
        norm = LossNorm.from_batches(mine, cfg.model.mtp_loss_weight, group=dims.group("dp_cp"))
        hooked: list[int] = []
        # a CPU-built, initialised instance (pruned in place): skips the meta-device path's one-off ~3 s import
        # of torch._refs per process; the meta path is covered by test_pipeline_inprocess.py
        runner = build_step_runner(full_model(cfg), cfg, dims, num_microbatches=M,
                                   on_chunk_backward_done=lambda ps: hooked.extend(id(p) for p in ps))
        stats = runner.forward_backward(mine, norm)
        assert sorted(hooked) == sorted(id(p) for p in runner.model.parameters())
        for p in runner.model.parameters():  # the optimizer's data-parallel reduction, done by hand here
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dims.group("dp") is not None:
                dist.all_reduce(p.grad, group=dims.group("dp"))
        ref, rstats = refs[M * dp]
        assert_grads_match(runner.model, ref)
        tot = sum_over_ranks(stats, keys=["loss", "lm_loss_sum", "p2p_bytes", "p2p_recv_bytes",
                                          "p2p_bytes_block_cache", "p2p_bytes_hidden", "p2p_bytes_grad"])
        assert tot["loss"] == pytest.approx(rstats["loss"], rel=1e-6)
        assert tot["lm_loss_sum"] == pytest.approx(rstats["lm_loss_sum"], rel=1e-6)
        assert tot["p2p_bytes"] == tot["p2p_recv_bytes"] > 0
        tokens = cfg.train.micro_batch_size * cfg.train.seq_len
        plan = runner.plan.step_bytes(M, tokens, cfg.model.hidden_size, 4)
        assert tot["p2p_bytes"] == dp * plan["total"]
        results[comm] = tot
        if runner.shared_params:  # the MTP's embedding replica is re-synchronised from the first stage
            if runner.replica_params:
                with torch.no_grad():
                    runner.replica_params[0].zero_()
            runner.sync_replica_weights()
            torch.testing.assert_close(runner.shared_params[0], full_model(cfg).embed_tokens.weight)
    if len(comms) == 2:
        c, f = results["cached"], results["full"]
        assert c["p2p_bytes_hidden"] == f["p2p_bytes_hidden"]
        if vpp > 1:
            assert c["p2p_bytes"] < f["p2p_bytes"]


def _body(rank: int, world: int, layouts: list[Layout], refs: dict) -> None:
    """Several layouts in one set of processes (process start-up dominates on a small shared machine); each
    builds its own process groups."""
    torch.set_num_threads(1)
    for layout in layouts:
        try:
            _run_layout(rank, world, layout, refs)
        except Exception as e:
            raise AssertionError(f"layout (pp, vpp, dp, M, pp_layers, comms, schedule) = {layout}: {e}") from e


@pytest.fixture(scope="module")
def refs() -> dict:
    """Single-process references for the global batch sizes used below (computed once, sent to the ranks)."""
    cfg = tiny_cfg(1, 1)
    return {n: reference(cfg, make_batches(cfg, n)) for n in (4, 6, 8)}


def test_pp2_vpp2_many_microbatches_cached_vs_full(refs: dict) -> None:
    """pp = 2: previous and next neighbour are the same rank; 8 micro-batches of interleaved 1F1B."""
    run_distributed(_body, 2, [(2, 2, 1, 8, None, ("cached", "full"), "auto")], refs)


def test_four_ranks(refs: dict) -> None:
    """pp = 4 (vpp 2: cached vs full; vpp 1: uneven, AFAB), pp = 2 x dp = 2 (vpp 1; vpp 2 uneven)."""
    run_distributed(_body, 4, [
        (4, 2, 1, 4, None, ("cached", "full"), "auto"),
        (4, 1, 1, 4, [1, 3, 2, 2], ("cached",), "afab"),
        (2, 1, 2, 3, None, ("cached",), "auto"),
        (2, 2, 2, 4, [3, 1, 2, 2], ("cached",), "auto"),
    ], refs)


def test_pp4_vpp2_dp2_eight_ranks(refs: dict) -> None:
    """The largest layout (8 ranks)."""
    run_distributed(_body, 8, [(4, 2, 2, 4, None, ("cached",), "auto")], refs)
