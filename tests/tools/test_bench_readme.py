"""benchmarks/bench_readme.py (`make bench`) without running a benchmark: the claim table against the files that
state the claims (docs pages, dated results) and the runs, the busy-machine refusals (a fake load average), the
parsers on captured tool output, the whole report on fake runs, and the process-group kill at a run's limit (a
sleeping python, no tool)."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_claims as bc  # noqa: E402
import bench_readme as br  # noqa: E402

# captured tool output: the lines each parser reads (numbers as the results files state them where they do)
KDA = ("torch.matmul fp32 2048x2048: 33.5 GFLOP/s at the start (...)\n"
       "     T  K=V   new ms  autograd  naive ms  vs auto  vs naive   GFLOP  mm GF/s  new/mm  auto/mm  saved new  "
       "saved auto   max|do|\n"
       "  4096  128    812.3    2323.1         -    2.86x         -   12.40     33.5   45.6%    15.9%      2.75x  "
       "     9.42x  1.19e-07\n")
ATTNRES = ("pp2vpp2: layers per virtual stage [4, 4, 3, 1] for both residuals\n"
           "pp2vpp2  off       attnres   |   12.357    +3.1% |       434.43  1.001 |      1335.22  1.003  pairs "
           "+1.0..+4.6%; quartets +2.9% (+2.0..+3.5%, 3); main-thread CPU quartets +2.5%\n"
           "pp2vpp2  off       standard  |   12.050    +0.0% |       434.20  1.000 |      1331.65  1.000\n")
LAYOUT = """\
tokens alpha repl |    fast   (plan  layout) | reference | speed-up | local sort
  1024  0.00    1 |    0.91    0.45     0.46 |    280.12 |   307.8x |       2.51
  4096  1.50    3 |    1.62    0.58     1.04 |    990.40 |   611.4x |      10.20
goal: fast <= 2 ms per layer (E=896, R=64); repl = most replicas on one rank
host: sum(range(1000)) 27.6 us, np.cumsum of 64 ints 2.15 us (per-call overhead)
"""
MOONEP_MEM = """\
layers mbs | held after fwds: MoonEP - plain | bwd peak: MoonEP - plain |     pool | repl | old design held
     1   1 |                           81920 |                    17152 |   196608 |    1 |           98304
     4   4 |                          180224 |                   -81536 |   196608 |    2 |         1572864
"""
CKPT = """\
procs  ckpt MiB  step s  sync s  async call s  async stall s sync/async
    1      1080    1.90    3.12          0.41           0.52        6.0x
    2      1080    1.20    2.05          0.30           0.61        3.4x
"""
PLAN = """\
chosen: pp2 dp2 cp1 ep1 z1 mb4 1f1b  (--parallel.pp=2 ...)
median |error| 7.2%, worst 21.8%, Spearman 0.918 over 11 layouts
"""
MEM = json.dumps({"layout": "x", "ranks": [{"rank": 0, "peak": 53224 * 1024, "measured_peak": 53337 * 1024},
                                           {"rank": 1, "peak": 41541 * 1024, "measured_peak": 41589 * 1024}]})
VISION = json.dumps({"evals": [], "ok": True, "verdict": "PASS: img gap +0.4 at step 150 vs +0.0 at step 0"})
OUTPUTS = {"kda": KDA, "attnres": ATTNRES, "moonep_layout": LAYOUT, "moonep_memory": MOONEP_MEM,
           "checkpoint": CKPT, "planner": PLAN, "memory_pp2vpp2": "log line\n" + MEM, "memory_dp2ep2": MEM,
           "vision": VISION}
HOST = {"date": "2026-01-01T00:00:00+00:00", "host": "h", "commit": "abc", "cpu": "Test CPU", "cores": 2,
        "cpu_count": 2, "flags": ["avx2"], "avx512": False, "torch": "2.x", "torch_cpu_capability": "AVX2",
        "python": "3.11", "threads_per_process": 1, "matmul_gflops_1thread": 33.5}


def idle() -> tuple[float, float, float]:
    return (0.02, 0.02, 0.02)


def fake_runner(outputs: dict[str, str], **over):  # noqa: ANN003, ANN201
    """A runner that returns captured output: ``over`` maps a run name to Outcome fields to change."""
    seen = []

    def run(r: bc.Run, tmp: Path, timeout: float) -> br.Outcome:
        seen.append(r.name)
        assert tmp.is_dir() and timeout > 0
        o = br.Outcome(rc=1 if r.name == "vision" and not json.loads(outputs[r.name])["ok"] else 0,
                       out=outputs[r.name], err="", wall_s=1.0, others_cores=0.0, timeout_s=timeout)
        for k, v in over.get(r.name, {}).items():
            setattr(o, k, v)
        return o
    run.seen = seen  # type: ignore[attr-defined]
    return run


def _main(argv: list[str], runner=None, load=idle) -> int:  # noqa: ANN001
    return br.main(argv, load=load, runner=runner or fake_runner(OUTPUTS), conditions=lambda: dict(HOST),
                   sleep=lambda s: None)


# ---------------------------------------------------------------------------------------------------------------
def test_claim_table_is_consistent_with_the_runs_and_the_files_that_state_it() -> None:
    keys = [c.key for c in bc.CLAIMS]
    assert len(keys) == len(set(keys))
    assert len(bc.RUN_BY_NAME) == len(bc.RUNS)
    for c in bc.CLAIMS:
        assert c.run in bc.RUN_BY_NAME, c.key
        assert c.op in (">=", "<="), c.key
        path = ROOT / c.file
        assert path.is_file() and path.suffix == ".md", f"{c.key}: {c.file} is not a docs or results file"
        assert c.file.startswith(("docs/", "benchmarks/results/")), f"{c.key}: {c.file}"
        stated = " ".join(path.read_text().split())
        assert " ".join(c.text.split()) in stated, f"{c.key}: {c.file} no longer says {c.text!r}"
    for r in bc.RUNS:
        assert any(c.run == r.name for c in bc.CLAIMS), f"run {r.name} measures no claim"
        assert (ROOT / r.argv[0]).is_file(), r.argv[0]
        assert r.timeout_s >= 2 * r.expected_s, r.name
        # the parser gives every claim of its run from the captured output
        assert {c.key for c in bc.CLAIMS if c.run == r.name} == set(r.parse(OUTPUTS[r.name])), r.name
    # all runs fit the 40 minutes the issue gives on 2 cores, and the default budget does not cut them short
    total = sum(r.expected_s for r in bc.RUNS)
    assert total <= 40 * 60
    assert f"~{total / 60:.0f} minutes" in br.list_claims()


def test_makefile_has_the_bench_target() -> None:
    mk = (ROOT / "Makefile").read_text()
    assert re.search(r"^bench: venv data data-mm$", mk, re.M)
    assert "benchmarks/bench_readme.py" in mk.split("\nbench:", 1)[1].split("\n\n", 1)[0]


def test_parsers_read_the_captured_lines() -> None:
    m = bc.parse_kda(KDA)
    assert (m["kda_speedup"].value, m["kda_matmul_fraction"].value, m["kda_saved"].value) == (2.86, 45.6, 2.75)
    assert bc.parse_attnres(ATTNRES)["attnres_overhead"].value == 3.1
    layout = bc.parse_moonep_layout(LAYOUT)["moonep_plan_ms"]
    assert layout.value == 1.62 and "4096 tokens" in layout.detail and "27.6 us" in layout.detail
    assert bc.parse_moonep_memory(MOONEP_MEM)["moonep_extra_flat"].value == pytest.approx(180224 / 196608)
    assert bc.parse_checkpoint(CKPT)["checkpoint_async"].value == 3.4  # the smaller over the process counts
    plan = bc.parse_plan(PLAN)
    assert plan["planner_median_error"].value == 7.2 and plan["planner_spearman"].value == 0.918
    assert "pp2 dp2 cp1 ep1 z1 mb4 1f1b" in plan["planner_median_error"].detail
    mem = bc.parse_memory("memory_pp2vpp2")("log line\n" + MEM)["memory_pp2vpp2"]
    assert mem.value == pytest.approx(100 * 113 / 53337) and "rank 1 -0.12%" in mem.detail
    assert bc.parse_vision(VISION)["vision_learns"].value == 1.0
    # a tool whose output changed fails loudly, naming what is missing
    for r in bc.RUNS:
        with pytest.raises(bc.ParseError):
            r.parse("nothing here\n")


def test_claim_bounds() -> None:
    by = {c.key: c for c in bc.CLAIMS}
    frac = by["kda_matmul_fraction"]  # its bound follows the matmul rate measured beside it (results: 33.5 vs 81-88)
    assert frac.within(41.0, 33.5) and not frac.within(38.0, 33.5) and frac.within(38.0, 85.0)
    assert frac.claimed(85.0).endswith(">= 34%") and frac.claimed(33.5).endswith(">= 40%")
    assert by["kda_saved"].within(3.0, 85.0) and not by["kda_saved"].within(3.01, 33.5)
    assert not by["planner_spearman"].within(math.nan, 33.5)
    # the table takes the KDA row's own matmul rate, not the one measured at the start
    rows = br.judge(bc.RUN_BY_NAME["kda"], br.Outcome(0, KDA.replace("33.5   45.6%", "85.0   38.0%"), "", 1.0),
                    "", matmul_gflops=20.0)
    assert [r.within for r in rows] == [True, True, True] and rows[1].bound == 34.0


def test_refuses_a_busy_machine_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    runner = fake_runner(OUTPUTS)
    assert _main(["--settle-s", "0"], runner=runner, load=lambda: (1.7, 1.2, 0.9)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "busy" in err and "1.70 > 0.5" in err and "--force" in err
    assert runner.seen == []
    assert _main(["--settle-s", "0", "--max-load", "0"], runner=runner) == 2  # any load at all
    assert runner.seen == []


def test_waits_for_the_load_to_fall_then_runs(capsys: pytest.CaptureFixture[str]) -> None:
    loads = iter([1.2, 0.9, 0.3] + [0.02] * 100)
    runner = fake_runner(OUTPUTS)
    assert _main(["--only", "kda"], runner=runner, load=lambda: (next(loads),) * 3) == 0
    assert runner.seen == ["kda"] and "waiting up to 60 s" in capsys.readouterr().out


def test_force_runs_on_a_busy_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["--force", "--only", "planner"], load=lambda: (3.0, 3.0, 3.0)) == 0
    assert "--force: the load was not checked" in capsys.readouterr().out


def test_load_between_runs_discounts_the_previous_run() -> None:
    t = [0.0]
    g = br.LoadGuard(0.5, load=lambda: (load[0], 0.0, 0.0), clock=lambda: t[0])
    load = [2.0]
    g.after("attnres", others_cores=0.1)   # the load when the run ended: all taken as its own
    t[0] = 30.0
    load[0] = 2.0 * math.exp(-0.5) + 0.3   # its remainder + a little noise: idle
    assert g.before("planner") == ""
    load[0] = 2.0                          # did not decay: something else runs
    assert "busy before 'planner'" in g.before("planner")
    g.after("planner", others_cores=0.8)   # other processes used 0.8 cores during the run
    assert "became busy during 'planner'" in g.before("memory_dp2ep2")


def test_busy_during_a_run_stops_before_the_next(capsys: pytest.CaptureFixture[str]) -> None:
    runner = fake_runner(OUTPUTS, kda={"others_cores": 0.9})
    assert _main(["--only", "kda,attnres"], runner=runner) == 2
    assert runner.seen == ["kda"] and "other processes used 0.90 cores" in capsys.readouterr().err


def test_report_of_all_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert _main(["--json", str(out), "--logs", str(tmp_path / "logs")]) == 0
    text = capsys.readouterr().out
    assert f"{len(bc.CLAIMS)} of {len(bc.CLAIMS)} claims within their bounds" in text
    assert "one-thread fp32 2048^3 matmul 33.5 GFLOP/s" in text and "Test CPU" in text and "avx512 no" in text
    for r in bc.RUNS:
        assert f"] {r.name}: " in text and (tmp_path / "logs" / f"{r.name}.log").is_file()
    res = json.loads(out.read_text())
    assert res["ok"] and res["conditions"]["threads_per_process"] == 1
    assert {c["key"] for c in res["claims"]} == {c.key for c in bc.CLAIMS}
    assert all(c["within"] and c["measured"] is not None for c in res["claims"])
    assert [r["name"] for r in res["runs"]] == [r.name for r in bc.RUNS]


def test_out_of_bound_failed_and_killed_runs_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    bad = {**OUTPUTS, "planner": PLAN.replace("Spearman 0.918", "Spearman 0.512")}
    assert _main(["--only", "planner"], runner=fake_runner(bad)) == 1
    table = capsys.readouterr().out
    assert re.search(r"planner Spearman .*0\.512\s+NO", table)
    failing = {**OUTPUTS, "vision": json.dumps({"ok": False, "verdict": "FAIL: img gap ..."})}
    assert _main(["--only", "vision"], runner=fake_runner(failing)) == 1
    assert "FAIL: img gap" in capsys.readouterr().out
    assert _main(["--only", "kda"], runner=fake_runner(OUTPUTS, kda={"rc": None})) == 1
    assert "killed at its limit" in capsys.readouterr().out
    assert _main(["--only", "memory_dp2ep2"], runner=fake_runner(OUTPUTS, memory_dp2ep2={"rc": 1, "err": "boom"})) == 1
    assert "exit 1" in capsys.readouterr().out


def test_bad_arguments() -> None:
    assert _main(["--only", "kda,nope"]) == 2
    assert _main(["--list"]) == 0


def test_execute_kills_the_process_group_at_the_limit(tmp_path: Path) -> None:
    sleeper = bc.Run("sleep", ("-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                                      "'import time; time.sleep(60)']); print('started', flush=True); "
                                      "time.sleep(60)"), "", 1, 2, lambda out: {})
    o = br.execute(sleeper, tmp_path, timeout_s=2)
    assert o.rc is None and "started" in o.out and o.wall_s < 20
    quick = bc.Run("quick", ("-c", "import os; print(os.environ['OMP_NUM_THREADS'], "
                                   "os.environ['K3TRAIN_CACHE_DIR'])"), "", 1, 2, lambda out: {})
    o = br.execute(quick, tmp_path, timeout_s=60)
    assert o.rc == 0 and o.out.split() == ["1", str(tmp_path / "cache")]


def test_execute_waits_for_what_the_run_leaves_behind(tmp_path: Path) -> None:
    """A process of the run's group that outlives its main process (as a multiprocessing fork server does, with
    the CPU of the ranks it reaped) is waited for: its work is the run's, measured inside the run, not counted as
    another process's during the next one."""
    done = tmp_path / "late_done"
    child = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(done)!r}).touch()"
    late = bc.Run("late", ("-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"),
                  "", 1, 2, lambda out: {})
    o = br.execute(late, tmp_path, timeout_s=60)
    assert o.rc == 0 and done.exists()
