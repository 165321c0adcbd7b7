"""k3train/planning/step_time/'s model of F/B pairing (parallel.overlap_ep): a paired action's two phase sequences
on one compute unit and one link, and the prediction of a pp = 1 layout with and without pairing."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from k3train.planning.step_time.costs import ActionCosts
from k3train.planning.step_time.pairing import pair_seconds, pair_side_ends
from k3train.planning.step_time.simulate import simulate_programs

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_pair_of_phases():
    # compute only: the two sides share the compute unit
    assert pair_seconds([("c", 2.0)], [("c", 3.0)]) == pytest.approx(5.0)
    # one side's all-to-all runs while the other computes: hidden entirely
    f = [("c", 1.0), ("n", 2.0), ("c", 1.0)]
    b = [("c", 4.0)]
    assert pair_seconds(f, b) == pytest.approx(6.0)  # compute 6 = the lower bound; F's 2 s wait hidden
    # nothing to hide behind: the link is the bottleneck (both sides' collectives leave the same rank)
    assert pair_seconds([("n", 3.0)], [("n", 2.0)]) == pytest.approx(5.0)
    # never below either side's own chain, nor the total compute; never above running them one after the other
    f = [("c", 0.5), ("n", 1.5), ("c", 0.3), ("n", 1.0)]
    b = [("n", 1.0), ("c", 0.7), ("n", 0.4), ("c", 0.2)]
    t = pair_seconds(f, b)
    assert max(sum(x for _, x in f), sum(x for _, x in b), 1.7) <= t <= sum(x for _, x in f + b)
    # compute at half speed doubles compute phases only
    assert pair_seconds([("c", 1.0), ("n", 1.0)], [], rate=0.5) == pytest.approx(3.0)
    # each side's end: F's 1 s of compute shares the unit with B's (2 s), then B runs alone
    assert pair_side_ends([("c", 1.0)], [("c", 3.0)]) == pytest.approx((2.0, 4.0))


def test_pair_first_compute_sends_when_its_side_ends():
    """The interleaved pp = 2 x vpp = 2 programs, paired: a pair's first compute posts its trailing sends as soon
    as its side is done (the runner's run_pair), not after the whole pair -- the pipeline ends earlier than when
    they wait for the pair's end (the same programs with every first compute's trailing-post count set to 0:
    the posts then leave after the pair, as they are placed in the paired program), and never later."""
    from parallel.pipeline.p2p import build_programs
    from parallel.pipeline.p2p_programs import pair_programs
    from parallel.pipeline.schedules import build_schedule

    pp, vpp, m = 2, 2, 8
    programs, firsts = pair_programs(build_programs(build_schedule("interleaved", pp, vpp, m, paired=True), pp, vpp),
                                     pp, vpp)
    assert any(n > 0 for f in firsts for n in f.values())
    n_st = pp * vpp
    costs = ActionCosts(f=[1.0] * n_st, b=[2.0] * n_st, f_comm=[0.5] * n_st, b_comm=[1.0] * n_st,
                        msg_s={v: (0.01, 0.05) for v in range(n_st)})
    f_ph = [[("c", 0.5), ("n", 0.5), ("c", 0.5)]] * n_st
    b_ph = [[("c", 1.0), ("n", 1.0), ("c", 1.0)]] * n_st
    early = simulate_programs(programs, pp, vpp, costs, 1, None, (firsts, f_ph, b_ph))
    late = simulate_programs(programs, pp, vpp, costs, 1, None, ([dict.fromkeys(f, 0) for f in firsts], f_ph, b_ph))
    assert early.makespan < late.makespan - 0.1, (early.makespan, late.makespan)
    # the same work either way: each rank computes as long (a pair's two segments add up to the pair)
    for a, b in zip(early.busy_compute, late.busy_compute):
        assert a == pytest.approx(b)


@pytest.mark.parametrize("kind,pp,vpp,m", [("interleaved", 4, 2, 8), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 9)])
def test_paired_schedule_gives_each_pair_slack(kind, pp, vpp, m):
    """Expert all-to-all as long as the compute around it: paired programs built from F/B pairing's schedule
    (warm-ups two forwards apart, ``build_schedule(paired=True)``) end sooner than the same pairing of the plain
    schedule, where a pair's forward feeds the next stage's *current* pair and every hop waits a whole pair, and
    sooner than unpaired (the K3 4K recipe was predicted slower paired than not, 57.1 vs 48.6 s, before the
    interleaved schedule took one more warm-up forward; pp 32 1F1B 45.3 vs 29.9 s before 1F1B's warm-ups were
    two forwards apart)."""
    from parallel.pipeline.p2p import build_programs
    from parallel.pipeline.p2p_programs import pair_programs
    from parallel.pipeline.schedules import build_schedule

    n_st = pp * vpp
    costs = ActionCosts(f=[1.0] * n_st, b=[2.0] * n_st, f_comm=[1.0] * n_st, b_comm=[2.0] * n_st,
                        msg_s={v: (0.01, 0.05) for v in range(n_st)})
    f_ph = [[("c", 0.5), ("n", 1.0), ("c", 0.5)]] * n_st
    b_ph = [[("c", 1.0), ("n", 2.0), ("c", 1.0)]] * n_st
    spans = {}
    for paired in (False, True):
        programs, firsts = pair_programs(build_programs(build_schedule(kind, pp, vpp, m, paired), pp, vpp),
                                         pp, vpp)
        spans[paired] = simulate_programs(programs, pp, vpp, costs, 1, None, (firsts, f_ph, b_ph)).makespan
    unpaired = simulate_programs(build_programs(build_schedule(kind, pp, vpp, m), pp, vpp), pp, vpp, costs,
                                 1, None).makespan
    assert spans[True] < spans[False] - 1.0, spans
    assert spans[True] < unpaired, (spans, unpaired)


def _predict(pins: list[str]):  # noqa: ANN202
    from k3train.config import load_config
    from k3train.planning.calibration.devices import PUBLISHED
    from k3train.planning.search.layouts import Validator, canonical
    from k3train.planning.search.planner import Planner
    from k3train.planning.step_time.facts import ParamFacts
    from k3train.planning.step_time.predict import predict

    # compute and expert all-to-all of comparable length (a slow device, slow links)
    dev = dataclasses.replace(PUBLISHED["h100"], peak_flops=2e10, nvlink_bw=1e9, internode_bw=1e9)
    cfg = load_config(TINY, pins + ["--train.global_batch_size=32"], world_size=4)
    lay = canonical(cfg)
    part = Validator(cfg, 4).partition(cfg)
    programs = Planner(TINY, pins, 4, dev, log=lambda *a: None).programs(lay, cfg.train.grad_accum_steps,
                                                                          cfg.ep_overlap()[0])
    return predict(cfg, lay, part, programs, dev, ParamFacts.build(cfg), None, 1.5, None, split_p2p=True)


@pytest.mark.parametrize("pins", [
    ["--parallel.pp=1", "--parallel.dp=4", "--parallel.ep=4", "--parallel.moonep=true"],
    ["--parallel.pp=1", "--parallel.dp=4", "--parallel.ep=4", "--parallel.moonep=false"],
    ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.dp=2", "--parallel.ep=2", "--parallel.moonep=true"],
], ids=["dp4-ep4-moonep", "dp4-ep4", "pp2v2-dp2-ep2-moonep"])
def test_pairing_hides_expert_all_to_all_in_the_prediction(pins):
    pins = pins + ["--parallel.zero=1", "--train.micro_batch_size=2"]
    off = _predict(pins + ["--parallel.overlap_ep=false"])
    on = _predict(pins + ["--parallel.overlap_ep=true"])
    assert on.detail["paired_fb"] and not off.detail["paired_fb"]
    if "--parallel.pp=1" in pins:  # one rank: the same compute (at pp > 1 the critical rank may change)
        assert on.compute == pytest.approx(off.compute)
    ep_on, ep_off = on.detail["exposed_by_kind"]["ep_all_to_all"], off.detail["exposed_by_kind"]["ep_all_to_all"]
    assert 0 < ep_on < ep_off
    if "--parallel.pp=1" in pins:
        assert on.step_s < off.step_s
        # what is hidden is at most the in-action communication of the paired actions
        assert off.step_s - on.step_s <= off.detail["in_action_comm_s"] + 1e-12
    else:  # the second compute of a pair shares the rank: its output leaves later, the next stage waits more
        assert on.bubble > off.bubble
    for p in (on, off):
        assert sum(p.detail["exposed_by_kind"].values()) == pytest.approx(p.exposed_comm, rel=1e-9)


@pytest.mark.parametrize("slow", [False, True], ids=["h100", "slow-links"])
def test_step_time_lower_bound_is_below_every_prediction(slow):
    """The planner skips a layout whose step-time lower bound is not below the top-th fitting prediction, so the
    bound must never exceed the layout's own prediction: over a spread of world-4 layouts (pp 1-4, interleaved
    and 1F1B, cp, ep, MoonEP, recompute, paired and not), on a device where compute dominates and on one where
    the expert all-to-all is as long as compute (the paired bound's comm term binds)."""
    from k3train.planning.calibration.devices import PUBLISHED
    from k3train.planning.search.layouts import Validator
    from k3train.planning.search.space import enumerate_layouts
    from k3train.planning.search.planner import Planner
    from k3train.planning.programs import pairs_actions
    from k3train.planning.search.time_bound import compute_lower_bound
    from k3train.planning.step_time.facts import ParamFacts
    from k3train.planning.step_time.predict import predict

    dev = PUBLISHED["h100"]
    if slow:
        dev = dataclasses.replace(dev, peak_flops=2e10, nvlink_bw=1e9, internode_bw=1e9)
    pairs, _ = enumerate_layouts(TINY, ["--train.global_batch_size=16", "--parallel.zero=1"], 4)
    pairs = pairs[:: max(1, len(pairs) // 150)]
    base = pairs[0][1]
    facts, val = ParamFacts.build(base), Validator(base, 4)
    planner = Planner(TINY, [], 4, dev, log=lambda *a: None)
    tight = refined = 0
    kinds = set()
    for lay, cfg in pairs:
        part = val.partition(cfg)
        lb = compute_lower_bound(cfg, lay, part, dev, facts, None, 1.5, None)
        fine = compute_lower_bound(cfg, lay, part, dev, facts, None, 1.5, None, exact_pairs=True)
        programs = planner.programs(lay, cfg.train.grad_accum_steps, pairs_actions(cfg))
        pred = predict(cfg, lay, part, programs, dev, facts, None, 1.5, None)
        # the refined bound (the search's, with each pair of stages' simulated wall) between the two
        assert 0 < lb <= fine * (1 + 1e-12) <= pred.step_s * (1 + 1e-9), (lay.short(), lb, fine, pred.step_s)
        tight += lb >= 0.7 * pred.step_s
        refined += fine > lb * (1 + 1e-9)
        kinds.add((lay.pp > 1, lay.cp > 1, pairs_actions(cfg)))
    assert len(kinds) >= 6, kinds  # the sample spans pipelines, CP and pairing
    assert tight >= len(pairs) // 4, (tight, len(pairs))  # and the bound is not vacuous
    assert refined, "the simulated pairs never tighten the bound"
