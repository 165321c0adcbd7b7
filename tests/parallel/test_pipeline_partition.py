"""Partition (layers per virtual stage, cost model) and the AttnRes communication plan: pure logic."""
from __future__ import annotations

import itertools

import pytest

from k3train.config import ConfigError, load_config
from parallel.pipeline.attnres_comm import AttnResCommPlan
from parallel.pipeline.partition import (auto_layers_per_stage, build_partition, describe_partition, head_cost,
                                         layer_cost)


def _k3(*ov: str):
    return load_config(None, ["--model.num_nextn_predict_layers=1", *ov])


def test_interleaved_placement() -> None:
    cfg = _k3("--parallel.pp=4", "--parallel.vpp=2")
    part = build_partition(cfg.model, cfg.parallel, 8192)
    assert part.num_stages == 8 and part.num_layers == 93
    assert [part.rank_of(v) for v in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [part.chunk_of(v) for v in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert part.local_stages(1) == [1, 5]
    assert part.local_chunks(1) == [part.bounds[1], part.bounds[5]]
    assert all(s == e_prev for (s, _), (_, e_prev) in zip(part.bounds[1:], part.bounds[:-1]))
    assert part.bounds[0][0] == 0 and part.bounds[-1][1] == 93
    assert part.stage_of_layer(92) == 7


def test_auto_is_optimal_against_brute_force() -> None:
    """The DP's bottleneck equals the exhaustive minimum on small random instances."""
    import random

    rng = random.Random(0)
    for _ in range(30):
        L, n = rng.randint(3, 9), rng.randint(1, 4)
        if n > L:
            continue
        costs = [rng.uniform(0.5, 3.0) for _ in range(L)]
        first, last = rng.uniform(0, 2), rng.uniform(0, 4)

        def worst(sizes):
            out, s = [], 0
            for v, k in enumerate(sizes):
                out.append(sum(costs[s:s + k]) + (first if v == 0 else 0) + (last if v == n - 1 else 0))
                s += k
            return max(out)

        best = min(worst(c) for c in itertools.product(range(1, L + 1), repeat=n) if sum(c) == L)
        sizes = auto_layers_per_stage(costs, n, first, last)
        assert sum(sizes) == L and min(sizes) >= 1
        assert worst(sizes) == pytest.approx(best)


def test_k3_auto_partition_accounts_for_head_and_mtp() -> None:
    cfg = _k3("--parallel.pp=8", "--parallel.vpp=2")
    part = build_partition(cfg.model, cfg.parallel, 8192)
    sizes = part.layers_per_stage()
    assert sum(sizes) == 93 and part.source == "auto"
    # LM head + MTP cost about three layers: the last stage gets about three layers fewer than the others
    assert head_cost(cfg.model, 8192) / layer_cost(cfg.model, 50, 8192) == pytest.approx(3, abs=0.6)
    assert sizes[-1] <= min(sizes[:-1]) - 2
    assert max(part.stage_costs) / (sum(part.stage_costs) / len(sizes)) < 1.05
    table = describe_partition(part)
    assert "head+mtp" in table and "embed" in table and "[90,93)" in table
    assert len(table.splitlines()) == 2 + 16 + 1


def test_layer_costs_by_kind() -> None:
    m = _k3().model
    kda, mla = layer_cost(m, 1, 8192), layer_cost(m, 3, 8192)  # layer 4 (1-based) is MLA
    dense = layer_cost(m, 0, 8192)
    assert m.layer_kind(3) == "mla" and m.layer_kind(1) == "kda" and not m.is_moe_layer(0)
    assert kda != mla and dense != kda
    # MLA's quadratic core grows with the context; KDA's does not
    assert layer_cost(m, 3, 65536) > mla and layer_cost(m, 1, 65536) == kda


def test_explicit_pp_layers_uneven() -> None:
    cfg = load_config(None, ["--model.num_hidden_layers=8", "--parallel.pp=2", "--parallel.vpp=2",
                             "--parallel.pp_layers=[3,1,2,2]"])
    part = build_partition(cfg.model, cfg.parallel, 128)
    assert part.source == "explicit"
    assert part.bounds == [(0, 3), (3, 4), (4, 6), (6, 8)]
    assert part.local_chunks(0) == [(0, 3), (4, 6)] and part.local_chunks(1) == [(3, 4), (6, 8)]


@pytest.mark.parametrize("layers,msg", [([3, 1, 2], "has 3 entries"), ([3, 0, 3, 2], ">= 1 layer"),
                                        ([3, 1, 2, 3], "sums to 9")])
def test_bad_pp_layers(layers: list[int], msg: str) -> None:
    cfg = load_config(None, ["--model.num_hidden_layers=8", "--parallel.pp=2", "--parallel.vpp=2"])
    cfg.parallel.pp_layers = layers  # bypass Config.validate: the partition checks on its own too
    with pytest.raises(ConfigError, match=f"parallel.pp_layers.*{msg}"):
        build_partition(cfg.model, cfg.parallel, 128)


def test_too_few_layers() -> None:
    cfg = load_config(None, ["--model.num_hidden_layers=8", "--parallel.pp=2", "--parallel.vpp=2"])
    cfg.parallel.vpp = 5
    with pytest.raises(ConfigError, match="parallel.vpp.*cannot fill"):
        build_partition(cfg.model, cfg.parallel, 128)


def test_pp1_is_single_chunk() -> None:
    cfg = load_config(None, ["--model.num_hidden_layers=8"])
    part = build_partition(cfg.model, cfg.parallel, 128)
    assert part.bounds == [(0, 8)] and part.local_chunks(0) == [(0, 8)]


# ----------------------------------------------------------------------------------------------------------
# AttnRes communication plan
# ----------------------------------------------------------------------------------------------------------
def _plan(pp: int, vpp: int, sizes: list[int], bs: int, mode: str) -> AttnResCommPlan:
    L = sum(sizes)
    cfg = load_config(None, [f"--model.num_hidden_layers={L}", f"--model.attn_res_block_size={bs}",
                             f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
                             f"--parallel.pp_layers=[{','.join(map(str, sizes))}]"])
    return AttnResCommPlan(build_partition(cfg.model, cfg.parallel, 128), mode)


def test_plan_payloads_hand_checked() -> None:
    """8 layers, blocks of 3, stages [3,1,2,2] on pp=2 (rank 0: [0,3),[4,6); rank 1: [3,4),[6,8))."""
    full, cached = _plan(2, 2, [3, 1, 2, 2], 3, "full"), _plan(2, 2, [3, 1, 2, 2], 3, "cached")
    # boundary 0 (after layer 3 = block end): blocks b0, b1, no partial
    assert full.payload(0).items() == [0, 1] == cached.payload(0).items()
    # boundary 1 (after layer 4): partial + b0, b1; rank 0 already holds b0, b1 from stage 0
    assert full.payload(1).items() == ["partial", 0, 1]
    assert cached.payload(1).items() == ["partial"]
    # boundary 2 (after layer 6 = block end): b0..b2; rank 1 holds b0, b1 (+ nothing newer) from stage 1
    assert full.payload(2).items() == [0, 1, 2]
    assert cached.payload(2).items() == [2]
    assert [cached.known_blocks(v) for v in range(4)] == [0, 0, 2, 2]


@pytest.mark.parametrize("pp,vpp,bs", [(2, 2, 3), (4, 2, 3), (2, 3, 2), (3, 2, 4), (4, 1, 3)])
def test_cached_sends_exactly_the_missing_blocks(pp: int, vpp: int, bs: int) -> None:
    """Simulate what each rank holds per micro-batch: the receiver gets every block it needs exactly once."""
    n = pp * vpp
    sizes = [1 + (v % 3 == 1) for v in range(n)]
    cached, full = _plan(pp, vpp, sizes, bs, "cached"), _plan(pp, vpp, sizes, bs, "full")
    part = cached.part
    held: dict[int, set[int]] = {r: set() for r in range(pp)}
    held[0] = set(range(cached.blocks_at(part.bounds[0][1])))  # stage 0 produced these on rank 0
    for v in range(1, n):
        r = part.rank_of(v)
        start = part.bounds[v][0]
        got = set(cached.payload(v - 1).blocks)
        assert not got & held[r], "a block the receiver already holds was resent"
        assert got | held[r] >= set(range(cached.blocks_at(start))), "a needed block is missing"
        held[r] = set(range(cached.blocks_at(part.bounds[v][1])))
        assert cached.payload(v - 1).partial == full.payload(v - 1).partial == (start % bs != 0)
    c = cached.step_bytes(4, 100, 8, 4)
    f = full.step_bytes(4, 100, 8, 4)
    assert c["hidden"] == f["hidden"] and c["grad"] == c["hidden"] + c["block_cache"]
    assert (c["total"] < f["total"]) == (vpp > 1)  # only interleaving revisits a rank


def test_dims_embd_group() -> None:
    """The ``embd`` group (added to ParallelDims): first + last pipeline rank with the same (dp, cp)."""
    from parallel.dims import ParallelDims

    d = ParallelDims(pp=4, dp=2, cp=1, world_size=8, rank=0)
    assert d._enumerate_groups()["embd"] == [[0, 6], [1, 7]]
    d1 = ParallelDims(pp=1, dp=2, world_size=2, rank=0)
    assert all(len(g) == 1 for g in d1._enumerate_groups()["embd"])  # no pipeline: size-1 groups -> None
