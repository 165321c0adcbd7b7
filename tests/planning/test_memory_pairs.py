"""k3train/planning/memory/ under F/B pairing (``parallel.overlap_ep``): the schedule walk follows the program the
runner executes (pp = 1: F(0), F(m+1) with B(m), B(M-1); pp > 1: ``pair_programs``), a pair holding the F's peak
while the B has freed its share of the micro-batch (``walk_schedule``'s docstring), plus the F's trailing receives
posted at its end; without pairing the walk is the unpaired one."""
from __future__ import annotations

from pathlib import Path

import pytest

from k3train.planning.memory.results import ChunkTrace
from k3train.planning.memory.walk import walk_schedule
from k3train.planning.programs import paired_programs

ROOT = Path(__file__).resolve().parents[2]


def _walk(program, pairs, saved=100, f_peak=130, b_peak=150, pair_done=0.5, grad_msg=0):  # noqa: ANN001, ANN202
    tr = {0: ChunkTrace(chunk=0, stage=0, layers=(0, 1), saved=saved, f_peak=f_peak, b_peak=b_peak,
                        grad_msg=grad_msg)}
    segs = [None] * 8
    tl: list = []
    out = walk_schedule(program, tr, {0: 7}, {0: 7}, 0, {0: 0}, {0: 0}, lambda m: 0, {}, segs, tl, pairs=pairs,
                        pair_done=pair_done)
    return out, tl


def test_local_pairs_walk():
    from k3train.config import load_config

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["--parallel.dp=2", "--parallel.ep=2",
                                                           "--train.global_batch_size=12"], world_size=2)
    assert cfg.ep_overlap()[0] and cfg.train.grad_accum_steps == 3
    from parallel.pipeline.p2p import Instr
    from parallel.pipeline.schedules import Action

    plain = [[Instr("compute", action=Action(k, 0, m)) for m in range(3) for k in "FB"]]
    progs, firsts = paired_programs(cfg, plain, 1, 1)
    assert [repr(i.action) for i in progs[0]] == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2"]
    assert firsts == [{Action("F", 0, 1): 0, Action("F", 0, 2): 0}]
    # F(1) ends at its own peak (130) while B(0) still holds half of its 100 saved bytes; gradients (7) from B(0) on
    (peak, act, g, at), tl = _walk(progs[0], firsts[0])
    assert [w for w, _, _ in tl] == ["F0.0", "F0.1+B0.0", "F0.2+B0.1", "B0.2"]
    assert (peak, act, g, at) == (100 - 50 + 130 + 7, 180, 7, "F0.2+B0.1")
    # a B consuming a received gradient may not have started when the F ends: it has freed nothing
    # (the walk books 1 byte of gradient payload it never received: held drops by 1 per B)
    (peak, _, _, _), _ = _walk(progs[0], firsts[0], grad_msg=1)
    assert peak == (100 - 1) + 130 + 7
    # at least the B's own peak (a B freeing nothing until the F ended)
    (peak, _, _, _), _ = _walk(progs[0], firsts[0], pair_done=0.0, b_peak=400)
    assert peak == 100 + 400 - 100 + 7
    # unpaired: the plain walk (the largest of F's peak over the held micro-batches, B's peak)
    off, _ = paired_programs(load_config(str(ROOT / "configs" / "tiny.yaml"), [
        "--parallel.dp=2", "--parallel.ep=2", "--train.global_batch_size=12", "--parallel.overlap_ep=false"],
        world_size=2), plain, 1, 1)
    assert off is plain
    (peak, act, _, at), _ = _walk(plain[0], {})
    assert (peak, at) == (150 + 7, "B0.1")


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (2, 1, 4)])
def test_pipeline_pairs_are_the_runners(pp: int, vpp: int, m: int) -> None:
    from k3train.config import load_config
    from parallel.pipeline.p2p import build_programs
    from parallel.pipeline.p2p_programs import pair_programs
    from parallel.pipeline.schedules import build_schedule

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), [f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
                                                           "--parallel.ep=2", "--train.global_batch_size=8"],
                      world_size=2 * pp)
    programs = build_programs(build_schedule("interleaved" if vpp > 1 else "1f1b", pp, vpp, m, paired=True), pp, vpp)
    assert paired_programs(cfg, programs, pp, vpp) == pair_programs(programs, pp, vpp)
