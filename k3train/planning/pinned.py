"""The predicted step of one layout, pinned: the config's own layout through the step-time model, no search and no
memory trace (``benchmarks/bench_published.py``; the planner predicts each layout it ranks the same way)."""
from __future__ import annotations

from typing import Any

from k3train.planning.programs import pairs_actions, rank_programs, single_program
from k3train.planning.search.layouts import Validator, canonical
from k3train.planning.step_time.device import Device
from k3train.planning.step_time.facts import ParamFacts
from k3train.planning.step_time.predict import Prediction, predict


def predict_pinned(cfg: Any, world: int, dev: Device, skew: float = 1.5,
                   split_p2p: bool = True) -> tuple[Any, Prediction]:
    """``(layout, prediction)`` of a config validated for ``world`` ranks (``load_config(..., world_size=world)``),
    at its own layout on ``dev``; ``skew``: the plain-EP routing skew (``tools/plan.py --ep-skew``). ``split_p2p``:
    the pipeline's point-to-point share of the bubble in ``detail['p2p_in_bubble_s']`` (a second simulation)."""
    lay = canonical(cfg)
    part = Validator(cfg, world).partition(cfg)
    M = cfg.train.grad_accum_steps
    programs = [single_program(M)] if lay.pp == 1 else rank_programs(lay.schedule, lay.pp, lay.vpp, M,
                                                                     pairs_actions(cfg))
    return lay, predict(cfg, lay, part, programs, dev, ParamFacts.build(cfg), None, skew, None,
                        split_p2p=split_p2p)
