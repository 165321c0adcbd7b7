"""k3train/planning/step_time/'s exposed communication by kind: the kinds add up to the prediction's exposed
communication, each collective lands in its own kind (EP all-to-all only with ep > 1, KCP and MLA-CP only with
cp > 1, ZeRO's parameter gather only with ZeRO), and the pipeline's point-to-point share is what free messages
would take off the pipeline."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _predict(world: int, pins: list[str], **dev_fields):  # noqa: ANN003, ANN202
    from k3train.config import load_config
    from k3train.planning.calibration.devices import PUBLISHED
    from k3train.planning.search.layouts import Validator, canonical
    from k3train.planning.search.planner import Planner
    from k3train.planning.step_time.facts import ParamFacts
    from k3train.planning.step_time.predict import predict

    dev = dataclasses.replace(PUBLISHED["h100"], **dev_fields)
    cfg = load_config(TINY, pins + ["--train.global_batch_size=32"], world_size=world)
    lay = canonical(cfg)
    part = Validator(cfg, world).partition(cfg)
    planner = Planner(TINY, pins, world, dev, log=lambda *a: None)
    programs = planner.programs(lay, cfg.train.grad_accum_steps, cfg.ep_overlap()[0])
    return predict(cfg, lay, part, programs, dev, ParamFacts.build(cfg), None, 1.5, None, split_p2p=True)


@pytest.mark.parametrize("pins,present,absent", [
    (["--parallel.pp=2", "--parallel.dp=1", "--parallel.cp=2", "--parallel.ep=2", "--parallel.zero=1",
      "--parallel.moonep=false"],
     {"ep_all_to_all", "kcp", "mla_cp", "zero_param_gather"}, {"moonep_replicas"}),
    (["--parallel.pp=1", "--parallel.dp=4", "--parallel.cp=1", "--parallel.ep=4", "--parallel.zero=0",
      "--parallel.moonep=true"], {"ep_all_to_all", "moonep_replicas", "grad_reduce"},
     {"kcp", "mla_cp", "zero_param_gather"}),
    (["--parallel.pp=4", "--parallel.dp=1", "--parallel.cp=1", "--parallel.ep=1", "--parallel.zero=0"],
     set(), {"ep_all_to_all", "moonep_replicas", "kcp", "mla_cp", "zero_param_gather"}),
], ids=["pp2-cp2-ep2-z1", "dp4-ep4-moonep-z0", "pp4"])
def test_exposed_kinds_add_up_and_land_in_their_kind(pins, present, absent):
    # a slow link, so that every kind takes measurable time
    pred = _predict(4, pins, nvlink_bw=1e9, internode_bw=1e9)
    by = pred.detail["exposed_by_kind"]
    assert sum(by.values()) == pytest.approx(pred.exposed_comm, rel=1e-9, abs=1e-12)
    assert all(by[k] > 0 for k in present), by
    assert all(by[k] == 0 for k in absent), by
    p2p = pred.detail["p2p_in_bubble_s"]
    if "--parallel.pp=1" in pins:
        assert p2p == 0.0
    else:
        assert 0.0 < p2p <= pred.bubble + 1e-12


def test_side_timeline_overlaps_transfers_with_compute_and_shares_the_link():
    from k3train.planning.step_time.overlap import side_timeline

    # a transfer started before 1 s of compute has 2 of its 3 link-seconds left to wait for
    ph, by = side_timeline([("c", 1.0), ("start", "a", "x", 3.0), ("c", 1.0), ("wait", "a"), ("c", 0.5)])
    assert ph == [("c", 2.0), ("n", 2.0), ("c", 0.5)] and by == {"x": 2.0}
    # two transfers in flight share the link: each at half speed until the shorter is done
    ph, by = side_timeline([("start", "a", "x", 1.0), ("start", "b", "y", 2.0), ("wait", "a"), ("sync", "z", 1.0)])
    # a done at 2 s; b's last second shares with the sync, both done 2 s later: b is never waited for
    assert by == pytest.approx({"x": 2.0, "z": 2.0})
    assert ph == [("n", pytest.approx(4.0))]
    # waited at the end when the program never waits for it; compute hides a transfer whole
    assert side_timeline([("start", "a", "x", 1.0), ("c", 2.0)]) == ([("c", 2.0)], {})
    assert side_timeline([("start", "a", "x", 3.0), ("c", 2.0)])[1] == {"x": pytest.approx(1.0)}


@pytest.mark.parametrize("moonep", [False, True], ids=["ep", "moonep"])
def test_expert_backward_hides_what_the_dispatcher_overlaps(moonep):
    """The MoE layer's backward as the dispatcher issues it (``layer_ops``): the combine's all-to-all in line; with
    ``parallel.expert_wgrad_split`` the input gradients' all-to-all travels while the own experts' weight
    gradients are computed (half their backward), without it after all of it; MoonEP's reduce-back and the next
    backward's prefetch behind the compute that follows them."""
    from k3train.planning.step_time.overlap import layer_ops, side_timeline

    a2a, rp = 4.0, (3.0 if moonep else 0.0)
    sent = {"ep_all_to_all": (a2a, a2a), "moonep_replicas": (rp, rp), "kcp": (0.25, 0.5)}
    for experts in (1.0, 3.0, 10.0):
        own = 0.75 if moonep else 1.0
        off = side_timeline(layer_ops("b", sent, experts, 5.0, own, False, 2))[1]
        on = side_timeline(layer_ops("b", sent, experts, 5.0, own, True, 2))[1]
        assert off["kcp"] == on["kcp"] == 0.5  # in line either way
        if not moonep:
            assert off["ep_all_to_all"] == pytest.approx(a2a)  # both halves in line
            assert on["ep_all_to_all"] == pytest.approx(a2a / 2 + max(0.0, a2a / 2 - experts / 2))
        assert on["ep_all_to_all"] <= off["ep_all_to_all"] + 1e-12
        # the thread blocks only while the link is busy: never longer than the link-seconds sent
        assert sum(on.values()) <= sum(off.values()) + 1e-12 <= a2a + rp + 0.5 + 1e-12
    # the forward: the prefetch beside the token all-to-all, then behind the own experts
    fwd = side_timeline(layer_ops("f", sent, 8.0, 1.0, 0.75, True, 2))[1]
    if moonep:  # a2a/2 = 2 s with 3 s of prefetch: both at half speed for 4 s, 1 s of prefetch left, hidden
        assert fwd["ep_all_to_all"] == pytest.approx(4.0 + 2.0) and fwd.get("moonep_replicas", 0.0) == 0.0
    else:
        assert fwd["ep_all_to_all"] == pytest.approx(a2a)


def test_expert_wgrad_split_shortens_the_predicted_step():
    """Unpaired at pp 1 (plain EP, no replica traffic), the EP kind of the prediction falls with the split by the
    micro-batches x the per-layer backward waits it removes, and the step with it."""
    from k3train.config import load_config
    from k3train.planning.calibration.devices import PUBLISHED
    from k3train.planning.search.layouts import canonical
    from k3train.planning.step_time.costs import layer_terms

    pins = ["--parallel.pp=1", "--parallel.dp=4", "--parallel.cp=1", "--parallel.ep=4", "--parallel.zero=0",
            "--parallel.moonep=false", "--parallel.overlap_ep=false"]
    fields = dict(peak_flops=1e9, lat_intra=0.0, lat_inter=0.0)
    preds, terms = {}, {}
    for split in (False, True):
        p = pins + [f"--parallel.expert_wgrad_split={str(split).lower()}"]
        preds[split] = _predict(4, p, **fields)
        cfg = load_config(TINY, p + ["--train.global_batch_size=32"], world_size=4)
        terms[split] = layer_terms(cfg, dataclasses.replace(PUBLISHED["h100"], **fields), canonical(cfg), None, 1.5)
        M = cfg.train.grad_accum_steps
    off, on = ([k.get("ep_all_to_all", (0.0, 0.0))[1] for k in terms[s][2]] for s in (False, True))
    sent = [k.get("ep_all_to_all", (0.0, 0.0))[1] for k in terms[True][3]]
    assert off == pytest.approx(sent)  # nothing overlaps the backward's all-to-alls without the split
    assert any(a > b for a, b in zip(off, on)) and all(b <= a for a, b in zip(off, on))
    ep = {s: preds[s].detail["exposed_by_kind"]["ep_all_to_all"] for s in (False, True)}
    assert ep[False] - ep[True] == pytest.approx(M * sum(a - b for a, b in zip(off, on)), rel=1e-9)
    assert preds[True].step_s < preds[False].step_s


def test_in_line_timeline_charges_every_transfer():
    """On a host whose ranks share its cores (``Device.shares_cores``) the planner overlaps nothing: every
    transfer is waited for where it starts, so a layer's blocked seconds are all it sends."""
    from k3train.planning.step_time.overlap import layer_ops, side_timeline

    sent = {"ep_all_to_all": (4.0, 4.0), "moonep_replicas": (3.0, 3.5), "kcp": (0.25, 0.5)}
    for d, i in (("f", 0), ("b", 1)):
        for split in (False, True):
            ph, by = side_timeline(layer_ops(d, sent, 8.0, 2.0, 0.75, split, 2), in_line=True)
            assert sum(by.values()) == pytest.approx(sum(v[i] for v in sent.values()))
            assert sum(t for k, t in ph if k == "c") == pytest.approx(10.0)
