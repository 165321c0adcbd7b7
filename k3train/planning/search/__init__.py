"""The parallel-layout planner: the fastest valid layout that fits, found best first and proven (``tools/plan.py``).

Order of work (cheapest first, every skip a bound), one module per phase:

1. Enumerate by structure (:mod:`.space`, :func:`~.space.enumerate_space`): every CORE (pp, vpp, dp, cp, ep,
   micro-batch size, schedule) the run validation accepts (:mod:`.layouts`: ``Config.validate_layout`` on a copy of
   the validated base), each with the memory knobs its layouts take (ZeRO stage, MoonEP, recomputation, F/B
   pairing): K3 at 4K has 2.1 million layouts in 98 thousand cores. Rows (:mod:`.rows`) are made per core when
   the search reaches it (every row up front in a space of at most ``planner.MATERIALIZED`` layouts).
2. Bound, by whole families first (:mod:`.time_bound`, :mod:`.memory_bound`, :mod:`.piece_bounds`): a family
   (pp, dp, cp, micro-batch, ep) whose average stage's weights, gradients and optimizer state are over the
   device is left out whole; its step-time bound is the busiest rank's share of every stage's work (compute
   alone first, with its communication when it comes up); a core is left out when its least memory-hungry layout
   is over the static bound; a layout's own bounds are the static memory bound (with the traced FFN pieces of one
   row, scaled to its rows) and :func:`~.time_bound.compute_lower_bound`.
3. Rank, best first (:mod:`.rank`): families, cores and rows in one queue by their step-time bounds; a row at
   its bound is refined with its token mixers' pieces (over: left out) or simulated
   (:func:`k3train.planning.step_time.predict.predict`) and re-enters at its prediction; a row at its prediction
   has its memory decided: over the bound with the end pieces, too big; within the upper bound
   (:mod:`.memory_upper`), it fits untraced; else :func:`k3train.planning.memory.estimate.estimate` (the real code
   on fake tensors), with an :class:`~k3train.planning.memory.cache.EstimateCache` shared by all. The ``top``-th
   fitting row ends the search: nothing left can beat it, the answer is PROVEN within the model. A budget may end
   it first: the result says so with the best so far (past half the budget with nothing fitting, the fastest
   simulated rows are decided ahead of their turn, to have one) and what was left.
4. Heuristics outside ``complete`` mode, counted against the proof (:mod:`.descend`): a layout traced too big marks
   too big the layouts of its family that hold at least as much per rank (its lighter neighbours simulated next);
   a recompute layout whose twin without recomputation fits is dominated.
5. The chosen layout's exact peak is traced when an upper bound ranked it (``exact_memory``: every ranked one's).

The memory pieces, estimates and predictions (published devices) are kept across plans in the k3train cache
directory (:mod:`k3train.planning.memory.store`). :mod:`.planner` runs the phases (:class:`~.planner.Planner`);
:mod:`.notes` says what the plan skipped, :mod:`.report` its table and plot, :mod:`.select` the layouts
``--measure`` runs. ``--exhaustive`` simulates and traces every layout (small spaces; the tests use it);
``--complete`` searches without a budget or heuristic (the reference the default is compared with).
"""
