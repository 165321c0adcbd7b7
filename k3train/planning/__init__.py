"""Planning before renting the cluster, by what each part models:

* :mod:`~k3train.planning.search` -- the planner: enumerate the valid layouts, bound them, rank them by predicted
  step time, descend from the too big ones (``tools/plan.py``);
* :mod:`~k3train.planning.memory` -- the memory estimator: memory per pipeline stage and rank, by running the
  real stage code on fake tensors (``tools/memory.py``);
* :mod:`~k3train.planning.step_time` -- the step-time model: per-action costs, the real per-rank programs
  simulated, the reductions and the optimizer;
* :mod:`~k3train.planning.calibration` -- the devices, and this host measured: microbenchmarks, per-layer timings,
  the trainer anchor, the busy-host check, real steps' time and memory;
* :mod:`~k3train.planning.fakerun` -- running the real code without the run: fake tensors with the integer data
  kept real, live tensor bytes, collectives without peers.

Shared by them: :mod:`~k3train.planning.programs` (each pipeline rank's program as the runtime runs it),
:mod:`~k3train.planning.dtypes`, and :mod:`~k3train.planning.scope` (what is modelled, checked before any work).
"""
