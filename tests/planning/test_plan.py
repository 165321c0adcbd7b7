"""tools/plan.py and k3train/planning/{search,step_time}/: the enumeration against a brute force and the
real validation, memory filtering against estimate(), one prediction against a real torchrun run, bad input."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shipped_data import shipped_view
from k3train.runtime.process_groups import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath(ROOT))
    return env


def test_enumeration_is_exactly_the_valid_layouts():
    from k3train.config import load_config
    from k3train.planning.search.layouts import Validator, canonical
    from k3train.planning.search.space import enumerate_layouts
    from k3train.preflight import validate_run

    W = 2
    listed, _ = enumerate_layouts(TINY, [], W)
    got = {lay for lay, _ in listed}
    assert len(got) == len(listed) > 50
    # brute force: every value of every dimension (sizes up to W+1, every vpp / micro-batch up to their maxima)
    base = load_config(TINY, [])
    v = Validator(base, W)
    want = set()
    for pp, dp, cp, ep in itertools.product(range(1, W + 2), repeat=4):
        if pp * dp * cp != W:  # rejected by Config.validate's first layout check (asserted below)
            continue
        for vpp, mbs, sched, zero, moonep, rc, ov in itertools.product(
                range(1, 6), range(1, base.train.global_batch_size + 1),  # vpp > 4 never fits 8 layers at pp=2
                ("auto", "1f1b", "interleaved", "afab"), (0, 1, 2), (False, True), (False, True), (False, True)):
            try:
                cfg = v.check(dict(pp=pp, vpp=vpp, dp=dp, cp=cp, ep=ep, mbs=mbs, schedule=sched, zero=zero,
                                   moonep=moonep, recompute=rc, overlap_ep=ov))
            except ValueError:  # ConfigError / ParallelConfigError
                continue
            want.add(canonical(cfg))
    with pytest.raises(ValueError):
        v.check(dict(pp=1, dp=1, cp=1))
    assert got == want
    # F/B pairing is a dimension where it applies (EP, several micro-batches), off elsewhere
    assert {lay.overlap_ep for lay in got} == {False, True}
    assert all(not lay.overlap_ep for lay in got if lay.ep == 1)
    assert any(lay.overlap_ep for lay in got if lay.cp > 1)  # pairing under context parallelism too
    # every listed layout passes the real run validation, spelled as its command-line overrides
    for lay in sorted(got)[:: max(1, len(got) // 60)]:
        cfg = validate_run(TINY, lay.overrides(), W, for_training=False)
        assert canonical(cfg) == lay
    # pinning a dimension on the command line restricts the enumeration to it
    pinned, _ = enumerate_layouts(TINY, ["--parallel.pp=2", "--parallel.zero=1"], W)
    assert pinned and {lay for lay, _ in pinned} == {x for x in got if x.pp == 2 and x.zero == 1}


# one layout at world 2 (dp=2), every dimension pinned; planned once (calibration + one memory trace)
PIN = ["--parallel.pp=1", "--parallel.dp=2", "--parallel.ep=1", "--parallel.zero=1", "--parallel.recompute=false",
       "--train.micro_batch_size=2", f"--data.path={shipped_view('corpus_text_document')}"]  # --measure trains


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    from k3train.planning.calibration.devices import get_device
    from k3train.planning.calibration.layer_times import LayerTimes
    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    cal = tmp_path_factory.mktemp("cal") / "cpu.json"
    dev = get_device("cpu", 2, [], str(cal), log=lambda *a: None)
    lt = LayerTimes(cal, dev.threads, log=lambda *a: None, config=TINY, overrides=PIN)  # with the trainer anchor
    cache = EstimateCache()
    res = Planner(TINY, PIN, 2, dev, exhaustive=True, layer_times=lt, log=lambda *a: None, cache=cache).run()
    return dev, lt, cache, res


def test_memory_filter_matches_estimate(planned):
    from dataclasses import replace

    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    dev, lt, cache, res = planned
    (row,) = res.rows
    assert row.peak_bytes and row.pred and row.fits
    # peak_bytes is estimate()'s worst rank (both ranks traced); fits is peak <= device memory
    est = cache.results[row.layout]
    assert len(est.ranks) == 2 and row.peak_bytes == max(x.peak for x in est.ranks)
    assert row.mem_bound <= row.peak_bytes  # the static bound is a lower bound of the estimate
    # a device of exactly the peak keeps the layout, one byte less drops it (from the same estimate)
    for hbm, fits in ((row.peak_bytes, True), (row.peak_bytes - 1, False)):
        r2 = Planner(TINY, PIN, 2, replace(dev, hbm_bytes=hbm), exhaustive=True, layer_times=lt,
                     log=lambda *a: None, cache=cache).run()
        assert [x.fits for x in r2.rows] == [fits] and len(r2.ranked()) == int(fits)
    # a device smaller than weights + optimizer state: dropped on the bound, without a trace
    tiny_dev = replace(dev, hbm_bytes=row.mem_bound / 2)
    res3 = Planner(TINY, PIN, 2, tiny_dev, layer_times=lt, log=lambda *a: None, cache=EstimateCache()).run()
    assert all(r.fits is False and r.skipped == "bound" and r.peak_bytes is None for r in res3.rows)
    assert res3.ranked() == []
    # a trace budget that is spent before the first trace ends stops that trace (a fresh cache: it would trace)
    res4 = Planner(TINY, PIN, 2, dev, layer_times=lt, log=lambda *a: None, cache=EstimateCache(),
                   trace_budget_s=0.0).run()
    assert [(r.skipped, r.peak_bytes, r.fits) for r in res4.rows] == [("trace budget", None, None)]
    assert res4.ranked() == [] and any("trace budget" in n for n in res4.notes)
    # the whole plan's time budget (enumeration included) stops simulation and traces alike
    res5 = Planner(TINY, PIN, 2, dev, layer_times=lt, log=lambda *a: None, cache=EstimateCache(),
                   time_budget_s=0.0).run()
    assert [(r.skipped, r.pred, r.peak_bytes) for r in res5.rows] == [("time budget", None, None)]


def test_predicted_step_time_near_measured(planned):
    from k3train.planning.calibration.measure_step import measure_step

    dev, _, _, res = planned
    (row,) = res.rows
    p = row.pred
    assert p.step_s > 0 and min(p.breakdown().values()) >= 0
    assert abs(sum(p.breakdown().values()) - p.step_s) <= 1e-9 * p.step_s
    measured = measure_step(TINY, PIN + row.layout.overrides(), 2, steps=3, threads=dev.threads)["step_time_s"]
    assert 0.5 < p.step_s / measured < 2.0, (p.step_s, measured, p.breakdown())


def test_trainer_anchor_enters_every_prediction(planned):
    """The trainer anchor (one real one-process run of the config at its micro-batch, one micro-batch per step)
    decomposes into the planner's terms, and those terms are what the prediction adds and scales."""
    from k3train.planning.calibration.layer_times import LayerTimes, anchor_overrides
    from k3train.planning.search.layouts import Validator
    from k3train.planning.search.planner import Planner
    from k3train.planning.step_time.facts import ParamFacts
    from k3train.planning.step_time.predict import predict

    dev, lt, _, res = planned
    a = lt.anchor(res.base_cfg)
    m = a.measured
    assert (m["B"], m["T"]) == (2, res.base_cfg.train.seq_len)  # the config's micro-batch (PIN's 2)
    # the step's time outside its three timed phases; never negative (the phases are medians of their own, so
    # under load their sum may pass the step's by a little: 0.2811 vs 0.2822 s in a suite beside other work)
    rest = m["step_time_s"] - (m["time_forward_backward_s"] + a.grad_norm_s + m["time_optimizer_s"])
    assert a.host_step_s == pytest.approx(max(rest, 0.0)) and rest > -0.05 * m["step_time_s"], (rest, m)
    # the forward + backward scale: the median of the rounds' ratios (trainer step / isolated layers, in turns)
    rounds = lt.data[lt.host]["anchor"]
    (run,) = [v for v in rounds.values() if v["B"] == 2]
    ratios = sorted(r["time_forward_backward_s"] / r["isolated_fb_s"] for r in run["rounds"])
    assert len(ratios) == 3 and a.fb_scale == ratios[1]
    assert a.opt_scale * a.predicted["optimizer_s"] == pytest.approx(m["time_optimizer_s"])
    assert a.grad_norm_s > 0 and 0.2 < ratios[0] and ratios[-1] < 5 and 0.2 < a.opt_scale < 5
    # the layout's prediction carries the host work (dp=2 on this host: both ranks' share of the cores)
    (row,) = res.rows
    assert row.pred.host == pytest.approx((a.grad_norm_s + a.host_step_s) / dev.rank_speed(2))
    # without the anchor the same layout loses exactly those terms and the scalings
    bare = LayerTimes(lt.path, lt.threads, log=lambda *x: None)
    facts = ParamFacts.build(res.base_cfg)
    part = Validator(res.base_cfg, 2).partition(row.cfg)
    pl = Planner(TINY, PIN, 2, dev, layer_times=bare, log=lambda *x: None)
    p0 = predict(row.cfg, row.layout, part, pl.programs(row.layout, row.cfg.train.grad_accum_steps, False), dev, facts,
                 bare, 1.5, bare.optimizer(res.base_cfg, facts.infos))
    assert p0.host == 0.0
    assert row.pred.compute == pytest.approx(p0.compute * a.fb_scale)
    assert row.pred.optimizer == pytest.approx(p0.optimizer * a.opt_scale)
    # the anchor's own layout: one process, the config's micro-batch, the user's other overrides kept
    over = anchor_overrides(["--parallel.pp=2", "--train.micro_batch_size=4", "--optim.lr=1e-3"], 4)
    assert "--optim.lr=1e-3" in over and "--parallel.pp=2" not in over and "--parallel.pp=1" in over
    assert over[-2:] == ["--train.micro_batch_size=4", "--train.global_batch_size=4"]


def test_program_simulation_matches_the_schedule_simulator():
    # equal stages, no communication: executing the real per-rank programs gives the makespan of
    # parallel.pipeline.schedules.simulate (the bubble comes from the schedule itself)
    from parallel.pipeline.p2p import build_programs
    from parallel.pipeline.schedules import build_schedule, simulate
    from k3train.planning.step_time.costs import ActionCosts
    from k3train.planning.step_time.simulate import simulate_programs

    for sched, pp, vpp, M in (("1f1b", 4, 1, 8), ("interleaved", 4, 2, 8), ("afab", 2, 2, 4)):
        s = build_schedule(sched, pp, vpp, M)
        n = pp * vpp
        costs = ActionCosts(f=[1.0] * n, b=[2.0] * n, f_comm=[0.0] * n, b_comm=[0.0] * n, msg_s={})
        out = simulate_programs(build_programs(s, pp, vpp), pp, vpp, costs, 1)
        assert out.makespan == pytest.approx(simulate(s, pp, vpp, 1.0, 2.0).makespan)
    # no pipeline: two data-parallel replicas sharing one core run at half speed
    from k3train.planning.programs import single_program

    one = ActionCosts(f=[1.0], b=[2.0], f_comm=[0.0], b_comm=[0.0], msg_s={})
    one_core = lambda n: min(1.0, 1 / n)  # noqa: E731 - processor sharing of one core
    assert simulate_programs([single_program(4)], 1, 1, one, 1, one_core).makespan == pytest.approx(12.0)
    assert simulate_programs([single_program(4)], 1, 1, one, 2, one_core).makespan == pytest.approx(24.0)
    # in-action communication follows the compute at wall speed (its per-call costs were measured under load):
    # per micro-batch F = 1 s of compute at half speed + 1 s of collectives, B = 2 s at half speed
    talk = ActionCosts(f=[1.0], b=[2.0], f_comm=[1.0], b_comm=[0.0], msg_s={})
    out = simulate_programs([single_program(4)], 1, 1, talk, 2, one_core)
    assert out.makespan == pytest.approx(4 * (2.0 + 1.0 + 4.0))
    assert out.busy_comm[0] == pytest.approx(4.0) and out.busy_compute[0] == pytest.approx(24.0)
    # and a rank waiting in its collectives leaves the core to the other pipeline rank (all-forward, 2 micro-batches,
    # one shared core): r0 F0 computes 0-1 and talks 1-3; r0 F1 and r1 F0 share the core 3-5; r0 F1 talks 5-7
    # while r1 finishes F0 alone (7); r1 F1 runs 7-10 once r0's activation arrives
    from parallel.pipeline.p2p import build_programs as bp

    two = ActionCosts(f=[1.0, 3.0], b=[0.0, 0.0], f_comm=[2.0, 0.0], b_comm=[0.0, 0.0], msg_s={})
    shared = simulate_programs(bp(build_schedule("afab", 2, 1, 2), 2, 1), 2, 1, two, 1, one_core)
    assert shared.makespan == pytest.approx(10.0)


def test_trainer_concurrency_curve_is_a_speed_per_copy_count():
    """The planner's concurrency calibration runs copies of the real one-process trainer in lock-step: one
    copy alone is speed 1, two copies on this host are no faster, the curve is monotone."""
    from k3train.planning.calibration.anchor_run import concurrency_curve
    from k3train.planning.calibration.layer_times import anchor_overrides

    over = anchor_overrides([f"--data.path={shipped_view('corpus_text_document')}"], 2)
    curve = concurrency_curve(TINY, over, procs=2, threads=1, rounds=1, steps=1)
    assert list(curve) == ["1", "2"] and curve["1"] == 1.0 and 0.0 < curve["2"] <= 1.0


@pytest.mark.parametrize("args,how", [
    (["--world-size", "3", "--parallel.pp=2"], "process"),     # no layout divides the world
    (["--world-size", "2", "--device", "tpu9"], "in-process"),   # unknown device
    (["--world-size", "2", "--device-field", "hbm=1"], "in-process"),  # unknown device field
    (["--world-size", "2", "--parallel.zero=7"], "in-process"),  # a bad pinned value
], ids=["no-layout", "device", "device-field", "pinned-value"])
def test_bad_input_is_one_line_exit_2(args, how, capsys):
    """One case through the tool's own process (exit code, nothing else on stderr), the others through its
    ``main`` in this process (the same code after the interpreter's start-up: 1.5 s less each)."""
    if how == "process":
        p = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "--config", TINY, *args], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=300)
        rc, stderr = p.returncode, p.stderr
    else:
        from tools.plan import main

        rc = main(["--config", TINY, *args])
        stderr = capsys.readouterr().err
    assert rc == 2, stderr[-2000:]
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3train: error:"), stderr


def test_too_big_marks_what_holds_more_and_descends_depth_first():
    """``descend.too_big_follow_ups`` (no trace): after a layout is traced too big, every layout of its family
    holding at least as much per rank is marked too big -- with recompute also the family that keeps its
    activations -- and its neighbours with less memory are queued first, recompute twin first."""
    from collections import deque
    from dataclasses import replace

    from k3train.planning.search.descend import family_key, too_big_follow_ups
    from k3train.planning.search.layouts import Layout
    from k3train.planning.search.rows import Row

    base = Layout(pp=2, vpp=1, dp=4, cp=1, ep=2, moonep=False, zero=1, mbs=2, recompute=False, schedule="1f1b")
    lays = {base, replace(base, zero=0), replace(base, zero=2), replace(base, mbs=4), replace(base, mbs=1),
            replace(base, ep=1), replace(base, ep=4), replace(base, cp=2, dp=2), replace(base, recompute=True),
            replace(base, recompute=True, zero=0), replace(base, recompute=True, mbs=1)}
    rows = {lay: Row(layout=lay) for lay in lays}
    families: dict = {}
    for r in rows.values():
        families.setdefault(family_key(r.layout), []).append(r)

    def follow(lay):  # noqa: ANN001, ANN202
        seen, urgent = {lay}, deque()
        for r in rows.values():
            r.fits, r.skipped = None, ""
        too_big_follow_ups(rows[lay], rows, seen, urgent, families)
        marked = {r.layout for r in rows.values() if r.skipped.startswith("needs more memory")}
        return marked, [r.layout for r in urgent]

    marked, urgent = follow(base)
    assert marked == {replace(base, zero=0), replace(base, mbs=4), replace(base, ep=1)}
    assert urgent == [replace(base, recompute=True), replace(base, mbs=1), replace(base, ep=4),
                      replace(base, zero=2), replace(base, cp=2, dp=2)]
    rc = replace(base, recompute=True)
    marked, urgent = follow(rc)  # keeping every activation holds more than recomputing: the same without rc
    assert marked == {replace(rc, zero=0), base, replace(base, zero=0), replace(base, mbs=4), replace(base, ep=1)}
    assert urgent[0] == replace(rc, mbs=1)


def test_forwards_before_first_backward_is_the_schedule_prefix():
    """The static memory bound's forwards in flight (built without the whole schedule) are the prefix of every
    rank's action list up to its first backward, then that backward's chunk."""
    from k3train.config import ConfigError
    from k3train.planning.programs import forwards_before_first_backward
    from parallel.pipeline.schedules import build_schedule, check_schedule

    n = 0
    for sched, pp, vpp, M, paired in itertools.product(("afab", "1f1b", "interleaved"), (2, 3, 4), (1, 2, 3),
                                                       (1, 2, 4, 8), (False, True)):
        try:
            check_schedule(sched, pp, vpp, M)
        except ConfigError:
            continue
        want = []
        for acts in build_schedule(sched, pp, vpp, M, paired):
            first_b = next(a for a in acts if a.kind == "B")
            want.append([a.chunk for a in acts[:acts.index(first_b)] if a.kind == "F"] + [first_b.chunk])
        assert forwards_before_first_backward(sched, pp, vpp, M, paired) == want, (sched, pp, vpp, M, paired)
        n += 1
    assert n > 40


def test_measured_set_is_the_fastest_by_prediction():
    """``--measure`` picks the k fastest fitting layouts BY PREDICTION: a row not simulated yet enters at its
    step-time lower bound, is predicted when it reaches the front and re-enters there, so rows whose bounds are
    low but predictions high never push out the chosen layout (2026-12-04: 8 such rows took every pick)."""
    from k3train.planning.search.layouts import Layout
    from k3train.planning.search.rows import PlanResult, Row
    from k3train.planning.search.select import distinct_top
    from k3train.planning.step_time.predict import Prediction

    def lay(pp: int, dp: int, mbs: int) -> Layout:
        return Layout(pp=pp, vpp=1, dp=dp, cp=1, ep=1, moonep=False, zero=1, mbs=mbs, recompute=False,
                      schedule="1f1b" if pp > 1 else "none")

    def pred(s: float) -> Prediction:
        return Prediction(step_s=s, compute=s, exposed_comm=0.0, bubble=0.0, optimizer=0.0)

    best = Row(lay(2, 2, 4), lower_bound_s=0.40, pred=pred(0.415), peak_bytes=1, fits=True)
    twin = Row(lay(2, 2, 4), lower_bound_s=0.40, pred=pred(0.416), peak_bytes=1, fits=True)  # same core
    loose = [Row(lay(p, d, m), lower_bound_s=0.30, peak_bytes=1, fits=True) for p, d, m in
             ((1, 4, 1), (1, 4, 2), (4, 1, 1), (4, 1, 2))]  # bounds below the best, predictions far above
    slow_fits_not = Row(lay(2, 2, 8), lower_bound_s=0.2, pred=pred(0.3), peak_bytes=2, fits=False)
    rows = [*loose, twin, best, slow_fits_not]
    res = PlanResult(rows, 4, None, None, len(rows), {}, [])
    later = {id(r): 0.6 + 0.01 * i for i, r in enumerate(loose)}
    picked = distinct_top(None, res, 3, lambda planner, r, res: pred(later[id(r)]))
    assert [r.pred.step_s for r in picked] == [0.415, 0.6, 0.61]
    assert picked[0] is best and all(r.pred is not None for r in loose)


def _h100(**kw):  # noqa: ANN003, ANN202 - a published device: predictions without a calibration
    from dataclasses import replace

    from k3train.planning.calibration.devices import PUBLISHED

    return replace(PUBLISHED["h100"], **kw)


def test_best_first_ranks_what_tracing_everything_ranks():
    """Branch and bound in predicted order (a row enters at its step-time lower bound, is simulated at the front
    and re-enters at its prediction; traces go to the fastest predicted first) ranks the same top layouts as
    simulating and tracing every layout, on a device where about half the layouts fit: every layout it leaves out
    is bounded or predicted no faster than the top-th fitting one, dominated, or holds at least as much as one
    traced too big -- and the rows it traced came off the queue in predicted order."""
    import re

    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    pins = ["--parallel.moonep=false", "--parallel.zero=1", "--parallel.ep=1", "--parallel.vpp=1",
            "--parallel.recompute=false", "--parallel.pp=2", "--parallel.schedule=1f1b",  # 4 micro-batch sizes
            f"--data.path={shipped_view('corpus_text_document')}"]  # the estimate reads micro-batches
    W, k = 2, 1
    cache = EstimateCache()  # shared: the estimates of the exhaustive run are reused (the same bytes)
    every = Planner(TINY, pins, W, _h100(), exhaustive=True, log=lambda *a: None, cache=cache).run()
    peaks = sorted(r.peak_bytes for r in every.rows if r.peak_bytes is not None)
    assert len(peaks) == len(every.rows) >= 4
    # the static bound (with each FFN's traced bytes of one row, whole chunks traced here) is below every estimate
    assert all(r.mem_bound <= r.peak_bytes for r in every.rows), [(r.layout.short(), r.mem_bound, r.peak_bytes)
                                                                   for r in every.rows]
    dev = _h100(hbm_bytes=peaks[len(peaks) // 2])
    want = Planner(TINY, pins, W, dev, exhaustive=True, log=lambda *a: None, cache=cache).run().ranked()[:k]
    assert len(want) == k and 0 < sum(p <= dev.hbm_bytes for p in peaks) < len(peaks)
    lines: list[str] = []
    got = Planner(TINY, pins, W, dev, top=k, log=lines.append, cache=cache).run()
    assert [(r.layout, r.pred.step_s) for r in got.ranked()[:k]] == [(r.layout, r.pred.step_s) for r in want]
    kth = got.ranked()[k - 1].pred.step_s
    for r in got.rows:
        if r.peak_bytes is None:
            assert r.skipped in ("slower", "dominated", "bound", "needs more memory than a layout traced too big"), r
        if r.skipped == "slower":
            assert (r.pred.step_s if r.pred is not None else r.lower_bound_s) >= kth, r
    traced = [m.group(1) for x in lines if (m := re.search(r"predicted (\S+) s \[", x))]
    assert 0 < len(traced) < len(every.rows)  # the search left layouts out
    assert traced[0] == f"{min(r.pred.step_s for r in got.rows if r.pred is not None):.4g}"  # the fastest first


@pytest.mark.parametrize("recompute,mbs,pp", [(True, 1, 1), (False, 1, 1), (True, 2, 1), (True, 1, 2)])
def test_static_bound_counts_the_traced_ffn_bytes(monkeypatch, recompute, mbs, pp):
    """Under sublayer recomputation (or none) the static memory bound counts what each FFN sublayer's traced piece
    keeps (``piece_bytes.ffn_saved_bytes``: under sublayer recomputation the pieces the estimator composes; the same for
    every cp) instead of one (two) hidden states: a stronger bound that stays below the estimated peak (tiny over
    cp=2, composed per piece as K3 is). With two rows per micro-batch the pieces of one row (what the planner
    traces for every micro-batch size) still bound it. Over two pipeline stages every forward in flight also
    holds the AttnRes payload it received: counted, still below."""
    from k3train.config import load_config
    from k3train.planning.memory import compose
    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.memory.estimate import estimate
    from k3train.planning.memory.piece_bytes import end_bytes, ffn_saved_bytes, mixer_bytes
    from k3train.planning.programs import forwards_before_first_backward
    from k3train.planning.search import memory_bound
    from k3train.planning.search.layouts import Validator, canonical
    from k3train.planning.search.memory_bound import static_memory_lower_bound
    from k3train.planning.step_time.facts import ParamFacts

    monkeypatch.setattr(compose, "TRACE_BUDGET", 0)  # compose per piece (what 1M-token K3 micro-batches take)
    pins = [f"--parallel.recompute={str(recompute).lower()}", "--parallel.recompute_granularity=sublayer",
            "--parallel.cp=2", "--parallel.dp=1", f"--train.micro_batch_size={mbs}",
            f"--train.global_batch_size={2 * mbs}", f"--parallel.pp={pp}",
            # two stages, each holding both forwards
            *(["--parallel.schedule=afab", "--parallel.pp_layers=[4,4]"] if pp > 1 else []),
            "--train.seq_len=16384", "--model.max_position_embeddings=16384",
            f"--data.path={shipped_view('corpus_text_document')}"]
    cfg = load_config(TINY, pins, world_size=2 * pp)
    L, T = canonical(cfg), 8192
    cache = EstimateCache()
    ffn = ffn_saved_bytes(cfg, cache.full_model(cfg, 1, cache.fake), cache.fake, cache.pieces, 1, T)
    h = T * cfg.model.hidden_size * 4  # fp32
    assert set(ffn) == {False, True} and all(v >= h for v in ffn.values()), (ffn, h)
    part = Validator(cfg, 2 * pp).partition(cfg)
    args = (ParamFacts.build(cfg), cfg, part, L.pp, L.dp * L.cp, L.ep, L.zero, L.moonep, mbs * T,
            "sublayer" if recompute else None,
            forwards_before_first_backward(L.schedule, L.pp, L.vpp, cfg.train.grad_accum_steps))
    old, new = static_memory_lower_bound(*args), static_memory_lower_bound(*args, ffn_saved=ffn)
    peak = max(r.peak for r in estimate(cfg, 2 * pp, cache).ranks)  # reuses the FFN fits just traced
    assert (old < new if mbs == 1 else old <= new) and new <= peak, (old, new, peak)
    if recompute:  # the token mixers' traced bytes and the first backward's composed peak: closer, still below
        full = cache.full_model(cfg, 1, cache.fake)
        mix = mixer_bytes(cfg, full, cache.fake, cache.pieces, 1, T)
        ends = end_bytes(cfg, full, cache.fake, cache.pieces, 1, T)  # the embedding, the head + MTP layer
        assert set(mix) == {"kda", "mla"} and all(b >= s > 0 for s, b in mix.values()), mix
        assert set(ends) == {"embed", "head"} and all(b >= s > 0 for s, b in ends.values()), ends
        tight = static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix, ends=ends)
        assert new < static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix) < tight <= peak, (new, tight, peak)
        if pp > 1:  # the received payloads are in it: without them the bound is lower
            monkeypatch.setattr(memory_bound, "_recv_blocks", lambda part, mode: [[0] * part.vpp] * part.pp)
            assert static_memory_lower_bound(*args, ffn_saved=ffn, mixer=mix, ends=ends) < tight
        elif mbs == 1:  # the planner bounds without the end pieces first, with them when the layout comes up for
            # a trace: on a device one byte below that bound it is dropped there, without the estimate
            from k3train.planning.search.planner import Planner

            pins += ["--parallel.ep=1", "--parallel.moonep=false", f"--parallel.zero={L.zero}", "--parallel.vpp=1"]
            for hbm, dropped in ((tight - 1, True), (tight, False)):
                lines: list[str] = []
                (row,) = Planner(TINY, pins, 2, _h100(hbm_bytes=hbm), log=lines.append, cache=cache).run().rows
                assert row.mem_bound == tight and (row.skipped == "bound") == dropped, (row, hbm)
                assert (row.peak_bytes is None) == dropped and (row.peak_bytes or peak) == peak, row
                assert any("over its bound with the embedding and head pieces" in x for x in lines) == dropped


def test_planner_chooses_pairing_per_layout():
    """F/B pairing (``parallel.overlap_ep``) is a layout dimension where it applies: one layout planned paired and
    unpaired, the paired one holding one more forward in flight; on a device with room for the unpaired peak only,
    the unpaired layout is the one that fits."""
    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    pins = ["--parallel.pp=1", "--parallel.dp=2", "--parallel.cp=1", "--parallel.ep=2", "--parallel.moonep=false",
            "--parallel.zero=1", "--parallel.recompute=false", "--train.micro_batch_size=1",
            "--train.global_batch_size=4", f"--data.path={shipped_view('corpus_text_document')}"]
    cache = EstimateCache()
    res = Planner(TINY, pins, 2, _h100(), exhaustive=True, log=lambda *a: None, cache=cache).run()
    rows = {r.layout.overlap_ep: r for r in res.rows}
    assert set(rows) == {False, True} and len(res.rows) == 2
    on, off = rows[True], rows[False]
    assert on.layout.short().endswith(" paired") and "--parallel.overlap_ep=true" in on.layout.overrides()
    assert on.fits and off.fits and on.peak_bytes > off.peak_bytes, (on.peak_bytes, off.peak_bytes)
    assert on.pred.step_s != off.pred.step_s  # two programs simulated
    tight = Planner(TINY, pins, 2, _h100(hbm_bytes=off.peak_bytes), exhaustive=True, log=lambda *a: None,
                    cache=cache).run()
    assert [r.layout.overlap_ep for r in tight.ranked()] == [False]
