"""The planner's search (k3train/planning/search/): the default search returns exactly the complete search's best
(no budget, bounds prune, nothing else), every bound stays on its side of every estimate and prediction, the
planner's memory figure is tools/memory.py's, and the persistent memory cache is used only when it is this code's
and this config's, whole."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shipped_data import shipped_view

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
DSV3 = str(ROOT / "benchmarks" / "published" / "dsv3.yaml")
# the tiny config on short rows (cheap traces), on a private view of the shipped corpus (the estimate reads it)
SHORT = ["--train.seq_len=64", "--train.global_batch_size=8", f"--data.path={shipped_view('corpus_text_document')}"]


def _dev(name: str = "h100", **kw):  # noqa: ANN003, ANN202 - a published device: predictions need no calibration
    from k3train.planning.calibration.devices import PUBLISHED

    return replace(PUBLISHED[name], **kw)


def _quiet(*a) -> None:  # noqa: ANN002
    pass


@pytest.mark.parametrize("world,pins", [
    (2, []),                                              # pp, dp, ep, vpp; pairing on and off
    (4, ["--parallel.pp=1"]),                             # dp, cp, ep (4 ranks); pairing on and off
    (4, ["--parallel.cp=2", "--parallel.zero=1"]),        # cp 2 under pp and ep
], ids=["w2", "w4-pp1", "w4-cp2"])
def test_default_search_returns_the_complete_searchs_best(world, pins):
    """On a device where every layout fits (the step-time side: bounds, order, proof), the default search (budgets,
    heuristics, top 10) proves the same best layout, with the same prediction, as the complete search."""
    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    cache = EstimateCache()  # shared: the chosen layout's estimate is traced once
    over = SHORT + pins
    want = Planner(TINY, over, world, _dev(), complete=True, top=1, log=_quiet, cache=cache).run()
    got = Planner(TINY, over, world, _dev(), log=_quiet, cache=cache, time_budget_s=600).run()
    assert want.status.proven and got.status.proven, (want.status, got.status)
    (w, *_), (g, *_) = want.ranked(), got.ranked()
    assert (g.layout, g.pred.step_s) == (w.layout, w.pred.step_s)
    assert g.peak_bytes is not None and g.peak_bytes == w.peak_bytes  # the chosen layout's exact figure
    lays = {r.layout for r in got.rows}
    assert {x.overlap_ep for x in lays} == {False, True} and max(x.ep for x in lays) > 1
    # the default ranks its top 10 in predicted order, every one fitting, the complete search's best first
    preds = [r.pred.step_s for r in got.ranked()]
    assert preds == sorted(preds) and len(preds) == min(10, len(got.rows))


def test_planner_memory_is_the_memory_tools(capsys):
    """A layout gets the same memory figure from the planner (pinned, and as a searched plan's chosen layout) as
    from tools/memory.py with the same settings -- DeepSeek-V3's pp16 dp64 ep64 z1 recompute layout on 1,024 H100s
    among them, which the planner reported '>119.72 GiB (too big)' against the estimator's 67 GiB (issue 46: a
    chunk-recomputed trace's early stop counted every forward in flight's pieces)."""
    from k3train.planning.search.planner import Planner
    from tools.memory import main as memory_main

    def tool_peak(config: str, world: int, over: list[str]) -> int:
        assert memory_main(["--config", config, "--world-size", str(world), *over, "--json"]) == 0
        return max(r["peak"] for r in json.loads(capsys.readouterr().out)["ranks"])

    dsv3 = ["--parallel.pp=16", "--parallel.vpp=1", "--parallel.dp=64", "--parallel.cp=1", "--parallel.ep=64",
            "--parallel.zero=1", "--train.micro_batch_size=1", "--parallel.recompute=true",
            "--parallel.schedule=1f1b", "--parallel.overlap_ep=false", "--parallel.moonep=false",
            f"--data.path={shipped_view('corpus_text_document')}"]  # the estimate reads the corpus: a private view
    tool = tool_peak(DSV3, 1024, dsv3)  # its pieces kept in the memory cache: the planner traces none again
    (row,) = Planner(DSV3, dsv3, 1024, _dev(), log=_quiet, store=True).run().rows
    assert row.fits and not row.peak_is_bound and row.peak_bytes == tool
    assert row.peak_bytes < _dev().hbm_bytes and row.mem_bound <= row.peak_bytes
    res = Planner(TINY, SHORT, 2, _dev(), log=_quiet).run()
    chosen = res.ranked()[0]
    assert chosen.peak_bytes == tool_peak(TINY, 2, SHORT + chosen.layout.overrides())


def _plan_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, list]:
    """A plan with a memory store in ``tmp_path``, then the same plan again: (rows, rows, traces of the second)."""
    from k3train.planning.memory import chunk, pieces
    from k3train.planning.search.planner import Planner

    traces: list[int] = []
    for mod in (chunk, pieces):  # count the traces (a spy on the real function)
        real = mod.trace_range
        monkeypatch.setattr(mod, "trace_range", lambda *a, _real=real, **k: traces.append(1) or _real(*a, **k))
    pins = SHORT + ["--parallel.pp=1", "--parallel.zero=1", "--train.micro_batch_size=2", "--parallel.cp=1"]

    def plan() -> list:
        res = Planner(TINY, pins, 2, _dev(), log=_quiet, store=tmp_path).run()
        return [(r.layout, r.pred and r.pred.step_s, r.peak_bytes, r.mem_upper, r.fits, r.skipped) for r in res.rows]

    first = plan()
    n = len(traces)
    second = plan()
    return first, second, traces[n:]


def test_memory_store_second_plan_traces_nothing(tmp_path, monkeypatch):
    """The persistent memory cache: a second plan of the same config traces nothing and gives the same rows; a
    file written by other code, a truncated one, or another config's is not used (traced again, rewritten)."""
    from k3train.config import load_config
    from k3train.planning.memory.store import MemoryStore

    first, second, traced = _plan_twice(tmp_path, monkeypatch)
    assert traced == [] and second == first and any(r[2] for r in first)
    (path,) = tmp_path.glob("memory-*.json")
    good = path.read_text()
    base = load_config(TINY, SHORT)
    for damage, why in ((lambda d: {**d, "code": "another checkout"}, "other code"),
                        (None, "unreadable"),
                        (lambda d: {**d, "config": d["config"].replace('"hidden_size"', '"hidden_sizes"')},
                         "another config")):
        path.write_text(good[: len(good) // 2] if damage is None else json.dumps(damage(json.loads(good))))
        store = MemoryStore(base, tmp_path)
        assert store.ignored.startswith(why) and not store.estimates and not store.pieces.stored
    # a damaged entry is dropped, the others kept
    d = json.loads(good)
    k = next(iter(d["pieces"]))
    d["pieces"][k] = [[1, 2]]
    path.write_text(json.dumps(d))
    store = MemoryStore(base, tmp_path)
    assert not store.ignored and k not in store.pieces.stored and len(store.pieces.stored) == len(d["pieces"]) - 1
    # another model's config is another file
    assert MemoryStore(load_config(TINY, SHORT + ["--model.hidden_size=96"]), tmp_path).path != path


def _bounds_on_their_side(every, upper, dev) -> None:  # noqa: ANN001
    """Every memory bound of ``every`` (an exhaustive plan: each row traced) below its estimate, every upper bound
    (``upper``: the same space planned where everything fits on it) above it, every step-time bound below the
    prediction -- the family's (compute alone, with communication) below the row's."""
    from k3train.planning.search.layouts import Validator
    from k3train.planning.search.planner import Planner  # noqa: F401 - the same modules the plan ran
    from k3train.planning.search.time_bound import compute_lower_bound, family_compute_bound, family_lower_bound
    from k3train.planning.step_time.facts import ParamFacts
    from parallel.pipeline.partition import build_partition

    base = every.base_cfg
    facts, val = ParamFacts.build(base), Validator(base, every.world)
    whole = build_partition(base.model, replace(base.parallel, pp=1, vpp=1, pp_layers=[]), base.train.seq_len)
    ups = {r.layout: r.mem_upper for r in upper.rows if r.mem_upper is not None}
    assert ups, "no upper bound computed"
    for r in every.rows:
        assert r.peak_bytes is not None and not r.peak_is_bound, r
        assert r.mem_bound <= r.peak_bytes, (r.layout.short(), r.mem_bound, r.peak_bytes)
        assert ups.get(r.layout, r.peak_bytes) >= r.peak_bytes, (r.layout.short(), ups.get(r.layout), r.peak_bytes)
        lb = compute_lower_bound(r.cfg, r.layout, val.partition(r.cfg), dev, facts, None, 1.5, None,
                                 exact_pairs=True)  # the search's refined bound: at least the first one
        fam = family_lower_bound(r.cfg, r.layout, whole, dev, None, 1.5)
        # (at pp 1 the bound is the prediction itself, summed in another order: a rounding apart)
        assert family_compute_bound(r.cfg, r.layout, dev, None, 1.5) <= fam <= lb * (1 + 1e-12) <= r.pred.step_s * (
            1 + 1e-9), (r.layout.short(), fam, lb, r.pred.step_s)


@pytest.mark.parametrize("granularity", ["sublayer", "chunk"])
def test_bounds_stay_on_their_side_of_composed_estimates(granularity, monkeypatch):
    """Where the estimator composes a micro-batch from per-layer pieces (K3, DeepSeek-V3: here forced on the tiny
    config over cp 2), the static bound with the FFN, token-mixer and end pieces -- traced on one row, scaled to the
    micro-batch's rows -- stays below every estimate, the upper bound above it, under sublayer and whole-chunk
    recomputation and none; and the default search ranks what the complete one ranks on a device where half fit."""
    from k3train.planning.memory import compose
    from k3train.planning.memory.cache import EstimateCache
    from k3train.planning.search.planner import Planner

    monkeypatch.setattr(compose, "TRACE_BUDGET", 0)
    pins = ["--parallel.pp=1", "--parallel.cp=2", "--parallel.ep=1", "--parallel.zero=1", "--train.seq_len=2048",
            "--train.global_batch_size=2", f"--parallel.recompute_granularity={granularity}",
            f"--data.path={shipped_view('corpus_text_document')}"]
    cache = EstimateCache()
    every = Planner(TINY, pins, 2, _dev(), exhaustive=True, log=_quiet, cache=cache).run()
    assert {(r.layout.mbs, r.layout.recompute) for r in every.rows} == {(1, False), (1, True), (2, False), (2, True)}
    upper = Planner(TINY, pins, 2, _dev(), log=_quiet, cache=cache).run()
    _bounds_on_their_side(every, upper, _dev())
    peaks = sorted(r.peak_bytes for r in every.rows)
    dev = _dev(hbm_bytes=(peaks[1] + peaks[2]) // 2)
    want = Planner(TINY, pins, 2, dev, complete=True, top=1, log=_quiet, cache=cache).run()
    got = Planner(TINY, pins, 2, dev, top=1, log=_quiet, cache=cache).run()
    assert want.status.proven and got.status.proven
    assert [(r.layout, r.pred.step_s) for r in got.ranked()[:1]] == [(r.layout, r.pred.step_s)
                                                                     for r in want.ranked()[:1]]
