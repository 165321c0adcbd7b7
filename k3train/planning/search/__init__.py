"""The parallel-layout planner: enumerate valid layouts, bound, predict, estimate memory, rank (``tools/plan.py``).

Order of work (cheapest first, every skip exact), one module per phase:

1. Enumerate (:mod:`.layouts`, :func:`~.layouts.enumerate_layouts`) -- every layout the run validation accepts.
2. Bound (:mod:`.piece_bounds` over :mod:`.memory_bound`): the static memory bound (weights + gradients + optimizer
   state, or weights + optimizer state + the hidden-state partial sums of each forward the schedule runs before a
   rank's first backward; with sublayer or no recomputation, each FFN counts its traced piece's bytes (of one row)
   instead, :func:`~k3train.planning.memory.piece_bytes.ffn_saved_bytes`, traced once for every cp and ep (at the
   smallest and the largest ep, the smaller: :meth:`~.piece_bounds.PieceBounds.ffn_saved`); over several stages
   each forward's received AttnRes payload) above the device memory: infeasible, no trace (``fits: false,
   skipped: 'bound'``). Refined lazily, the same bound, under sublayer recomputation: when a layout first comes up
   (3.), each token mixer counts its piece's bytes, :func:`~k3train.planning.memory.piece_bytes.mixer_bytes`,
   traced per cp (a line in the cp above 16) only for the cps of layouts that come up, with the first backward's
   peak composed as the estimator composes it; when it comes up for a trace (4.), the embedding and head pieces,
   :func:`~k3train.planning.memory.piece_bytes.end_bytes`, too. Then the step-time lower bound
   (:mod:`.time_bound`) for the rest.
3. Rank (:mod:`.rank`): best first, a layout enters a queue at its lower bound, is simulated
   (:func:`k3train.planning.step_time.predict.predict`) when it reaches the front and re-enters at its prediction,
   so layouts are traced (4.) in predicted order, each only when no layout not yet traced can be predicted faster
   -- branch and bound: once ``top`` layouts that FIT are known, a layout whose lower bound (or prediction) is not
   below the ``top``-th of them cannot enter the ranking and is not simulated / traced (``skipped: 'slower'``). A
   recompute layout is dominated by its twin without recomputation when that one fits (same everything, strictly
   more compute): skipped (``skipped: 'dominated'``).
4. Memory and descent (:mod:`.descend`): :func:`k3train.planning.memory.estimate.estimate` (the real code on fake
   tensors) for each simulated layout that could enter the ranking, with an
   :class:`~k3train.planning.memory.cache.EstimateCache` shared by all (fake full model per ep, per-layer fits,
   optimizer transients) -- ``fits`` = worst rank's peak <= device memory. A layout traced too big sends its
   recompute twin to the front of the queue and marks too big without a trace every layout of its family that
   holds at least as much per rank (lower ZeRO, larger micro-batch, smaller cp or ep:
   ``skipped: 'needs more memory than a layout traced too big'``), and the search descends from it depth first
   (recompute twin, half the micro-batch, twice the ep, one ZeRO stage more, twice the cp) to the memory limit;
   a layout that fits sends its other vpp / schedule variants (same dims, same memory knobs) to the front.

:mod:`.planner` runs the phases (:class:`~.planner.Planner`); :mod:`.rows` holds a plan's rows and result,
:mod:`.notes` what it says about the layouts it skipped, :mod:`.report` its table and plot, :mod:`.select` the
layouts ``--measure`` runs. ``--exhaustive`` simulates and traces every layout (small spaces; the tests use it).
"""
