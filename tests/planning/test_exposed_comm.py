"""k3train/planning/step_time.py's exposed communication by kind: the kinds add up to the prediction's exposed
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
    from k3train.planning.devices import PUBLISHED
    from k3train.planning.layouts import Validator, canonical
    from k3train.planning.plan import Planner
    from k3train.planning.step_time import ParamFacts, predict

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
