"""KCP under CP = 2 and 4 (gloo, CPU) against a single process on the full rows.

KDA: every rank computes the single-process chunked KDA itself (full rows, same seed) and compares its own segment
of the output, its end-of-segment state (the reference on the row prefix) and the gradients of q, k, v, g, beta.
The loss weights every output and the last rank's final state, so the backward exercises the whole fold adjoint.
ShortConv halo and MLA latent gather: forward values and input gradients against the same ops on the full rows.
The checks live in ``kcp_checks.py`` (shared with the cp = 3/4 hang-layout tests).
One process spawn per layout runs all the checks (spawns dominate the test time).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from kcp_cases import LAYOUTS
from kcp_checks import check_halo_and_mla, check_kda

from parallel.dims import ParallelDims


def _body_all_layouts(rank: int, world_size: int) -> None:
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    for i, case in enumerate(sorted(LAYOUTS)):
        check_kda(dims, LAYOUTS[case], torch.float32, seed=i, name=case)
    check_kda(dims, LAYOUTS["mixed"], torch.float64, seed=11, name="mixed")
    check_kda(dims, LAYOUTS["short_docs"], torch.float64, seed=12, naive_ops=True, name="short_docs")
    check_kda(dims, LAYOUTS["mixed"], torch.bfloat16, seed=13, name="mixed")
    for case in ("short_docs", "boundaries"):
        check_halo_and_mla(dims, LAYOUTS[case])


@pytest.mark.parametrize("cp", [2, 4])
def test_kcp_matches_single_process(cp: int) -> None:
    run_distributed(_body_all_layouts, cp)


def _body_dp_cp(rank: int, world_size: int) -> None:
    # dp=2 x cp=2: the CP groups are {0,1} and {2,3}; each replica runs a different layout (group-local ranks)
    dims = ParallelDims(dp=2, cp=2, world_size=world_size, rank=rank).build_groups()
    assert dims.ranks("cp") == ([0, 1] if rank < 2 else [2, 3])
    case = "one_doc" if dims.dp_rank == 0 else "short_docs"
    check_kda(dims, LAYOUTS[case], torch.float32, seed=3 + dims.dp_rank, name=case)
    for case in ("short_docs", "boundaries"):
        check_halo_and_mla(dims, LAYOUTS[case])
    dist.barrier()


def test_kcp_inside_dp_cp_layout() -> None:
    run_distributed(_body_dp_cp, 4)
