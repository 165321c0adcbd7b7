"""The devices the step-time model reads (:class:`~k3train.planning.step_time.device.Device`) and this host measured.

:mod:`.devices` (the device table) and, for ``--device cpu``, :mod:`.cpu_device`
(microbenchmarks of :mod:`.cpu_bench`, cached by :mod:`.host`); a config's layers and optimizer updates timed
(:mod:`.layer_bench`, cached by :mod:`.layer_times`) and anchored on one real trainer run (:mod:`.anchor`, which runs
:mod:`.anchor_run`); whether other work disturbed a measurement (:mod:`.host_busy`); real steps' time
(:mod:`.measure_step`, ``tools/plan.py --measure``) and memory (:mod:`.measure_memory`, ``tools/memory.py
--measure``).
"""
