"""tools/memory.py: the estimate (real code on fake tensors) against the measured peak of real training steps,
the JSON schema, bad input, and that the full-K3 estimate allocates nothing."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shipped_data import shipped_view
from k3train.runtime.process_groups import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(ROOT / "tools" / "memory.py")]
KEYS = {"rank", "pp_rank", "dp_rank", "cp_rank", "ep_rank", "params", "grads", "optimizer", "activations",
        "buffers", "peak"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath(ROOT))
    return env


def _run(args: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:  # noqa: ANN003
    return subprocess.run(TOOL + args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout, **kw)


def _limit_memory() -> None:
    # 6 GiB of address space: torch's own mappings fit; one K3 MoE layer's experts (tens of GB) would not
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


# the tiny config on 4 x 64 tokens per step, on a private view of the shipped corpus (--measure trains)
SHORT = ["--train.seq_len=64", "--train.global_batch_size=4", f"--data.path={shipped_view('corpus_text_document')}"]
LAYOUTS = {
    "pp2_vpp2_uneven": ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.pp_layers=[3,1,2,2]"],
    # whole-chunk recomputation (recompute_granularity: chunk) through MoonEP's dispatcher
    "dp2_ep2_zero2_moonep": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.zero=2", "--parallel.moonep=true",
                             "--parallel.recompute=true"],
    # the real KCP context (MLA causal balance), collectives simulated; the long-context paths: every sublayer, head
    # chunk (2 of 4 heads) and MoE token chunk (4 of 16 tokens per rank) recomputed on its own
    "cp2_recompute": ["--parallel.cp=2", "--parallel.recompute=true", "--parallel.recompute_granularity=sublayer",
                      "--model.mixer_head_chunk=2", "--model.moe_token_chunk=16"],
}
VL = str(ROOT / "configs" / "tiny-vl.yaml")
# every slow tool run of this file (its arguments; PREEXEC: what runs in the child first), longest first: the order
# they are started in
RUNS = {
    "cp2_recompute": ["--config", "configs/tiny.yaml", "--world-size", "2", *LAYOUTS["cp2_recompute"], *SHORT,
                      "--measure", "--steps", "3", "--json"],
    "dp2_ep2_zero2_moonep": ["--config", "configs/tiny.yaml", "--world-size", "2", *LAYOUTS["dp2_ep2_zero2_moonep"],
                             *SHORT, "--measure", "--steps", "3", "--json"],
    "pp2_vpp2_uneven": ["--config", "configs/tiny.yaml", "--world-size", "2", *LAYOUTS["pp2_vpp2_uneven"], *SHORT,
                        "--measure", "--steps", "3", "--json"],
    "k3": ["--config", "configs/k3.yaml", "--world-size", "512", "--parallel.pp=8", "--parallel.dp=64",
           "--parallel.ep=64", "--parallel.zero=1", "--train.seq_len=16384", "--train.global_batch_size=64", "--json",
           f"--data.path={shipped_view('corpus_text_document')}"],
    "vision": ["--config", VL, "--world-size", "2", "--parallel.pp=2", "--train.global_batch_size=4", "--media",
               "data", "--measure", "--steps", "3", "--json", f"--data.path={shipped_view('mm')}"],
}
PREEXEC = {"k3": _limit_memory}
TEST_RUNS = {"test_estimate_within_10_percent_of_measured": None,  # None: the parametrized layout's name
             "test_k3_estimate_allocates_nothing": "k3", "test_estimate_within_10_percent_of_measured_vision": "vision"}


class _ToolRuns:
    """The tool runs of the selected tests, two at a time in the background (each is one process on one core for
    its estimate, the longer part; what they compute -- byte counts of traced and of live tensors -- does not
    depend on timing or load, so running them side by side on the CI's 2 cores changes no result, only the wall
    time). Started in ``RUNS`` order; ``result(key)`` waits for one, starting queued runs as slots free up."""

    def __init__(self, keys: list[str], tmp: Path, slots: int = 2) -> None:
        self.pending, self.tmp, self.slots = [k for k in RUNS if k in keys], tmp, slots
        self.running: dict[str, tuple[subprocess.Popen, float]] = {}
        self.done: dict[str, subprocess.CompletedProcess] = {}

    def _start(self) -> None:
        while self.pending and len(self.running) < self.slots:
            k = self.pending.pop(0)
            so, se = open(self.tmp / f"{k}.out", "w"), open(self.tmp / f"{k}.err", "w")  # noqa: SIM115
            with so, se:
                p = subprocess.Popen(TOOL + RUNS[k], cwd=ROOT, env=_env(), stdout=so, stderr=se, text=True,
                                     preexec_fn=PREEXEC.get(k), start_new_session=True)
            self.running[k] = (p, time.monotonic())

    def _reap(self) -> None:
        for k, (p, t0) in list(self.running.items()):
            if p.poll() is None:
                assert time.monotonic() - t0 < 900, f"tools/memory.py {k} ran past 900 s"
                continue
            del self.running[k]
            self.done[k] = subprocess.CompletedProcess(p.args, p.returncode, (self.tmp / f"{k}.out").read_text(),
                                                       (self.tmp / f"{k}.err").read_text())

    def result(self, key: str) -> subprocess.CompletedProcess:
        if key not in self.done and key not in self.running and key in self.pending:
            self.pending.remove(key)
            self.pending.insert(0, key)
        self._start()
        while key not in self.done:
            assert key in self.running or key in self.pending, key
            time.sleep(0.1)
            self._reap()
            self._start()
        return self.done[key]

    def close(self) -> None:
        """Runs still going when the module ends (a test failed or was deselected): stop them and their torchrun."""
        for p, _ in self.running.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def tool_runs(request, tmp_path_factory):
    keys = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) in TEST_RUNS:
            keys.append(TEST_RUNS[item.originalname] or item.callspec.params["name"])
    runs = _ToolRuns(keys, tmp_path_factory.mktemp("memory_tool"))
    yield runs
    runs.close()


@pytest.mark.parametrize("name", list(LAYOUTS))  # uneven interleaved pp; dp x ep with ZeRO-2 and MoonEP; cp
def test_estimate_within_10_percent_of_measured(name, tool_runs):
    # estimate, then 3 real steps under torchrun (about 30 s per layout on 2 idle cores, run two at a time)
    world = 2
    p = tool_runs.result(name)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert len(out["ranks"]) == world
    for r in out["ranks"]:
        assert KEYS | {"measured_peak"} <= set(r)
        assert all(isinstance(r[k], int) and r[k] >= 0 for k in KEYS | {"measured_peak"})
        assert r["peak"] >= r["params"] + r["optimizer"] + r["buffers"]
        err = (r["peak"] - r["measured_peak"]) / r["measured_peak"]
        assert abs(err) <= 0.10, (r, err)


def test_bad_input_is_one_line_exit_2():
    p = _run(["--config", "configs/tiny.yaml", "--world-size", "3", "--parallel.pp=2"], timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().startswith("k3train: error:") and len(p.stderr.strip().splitlines()) == 1


def test_k3_estimate_allocates_nothing(tool_runs):
    """Full-width K3 (2.78T parameters; per-layer traces composed for 16K tokens per micro-batch) completes
    under a 6 GiB address-space limit, every pipeline stage listed."""
    p = tool_runs.result("k3")  # RUNS["k3"], under _limit_memory
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert {r["pp_rank"] for r in out["ranks"]} == set(range(8)) and len(out["ranks"]) == 512
    worst = max(r["peak"] for r in out["ranks"])
    assert worst > 100 * 2**30  # hundreds of GiB per rank were "held" -- none of it allocated


def test_estimate_within_10_percent_of_measured_vision(tool_runs):
    """tiny-vl, the encoder on the first of two pipeline stages, traced on the data's own media (--media data:
    what the measured steps run). About 25 s on 2 idle cores."""
    p = tool_runs.result("vision")  # RUNS["vision"]
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert "vision encoder on the data's own media" in out["layout"]
    for r in out["ranks"]:
        err = (r["peak"] - r["measured_peak"]) / r["measured_peak"]
        assert abs(err) <= 0.10, (r, err)


def test_vision_first_stage_traces_the_encoder():
    """The worst case (every position a placeholder of the largest image that fits a row) against the same
    config with vision off: the tower's parameters and optimizer state, its saved activations (8-32 fp32
    vectors of the encoder width per patch and block) and the step's pixels. In-process, synthetic rows."""
    import torch

    from k3train.config import load_config
    from k3train.model.vit_tower import VisionTower
    from k3train.planning.memory.estimate import estimate
    from k3train.planning.memory.media import worst_case_grids

    base = ["--train.seq_len=64", "--train.global_batch_size=2", "--data.path=/nonexistent"]  # M = 1
    vl = load_config(VL, base, world_size=1)
    txt = load_config(VL, base + ["--vision.enabled=false", "--data.format=text"], world_size=1)
    assert worst_case_grids(vl, 64) == [(1, 16, 16)]  # one 224 x 224 px image (64 tokens) fills a row
    a, b = estimate(vl, 1), estimate(txt, 1)
    ra, rb = a.ranks[0], b.ranks[0]
    with torch.device("meta"):
        tower = 4 * sum(p.numel() for p in VisionTower(vl.vision, vl.model.hidden_size).parameters())
    assert ra.params - rb.params == tower and ra.optimizer > rb.optimizer
    P, L, D = 2 * 256, vl.vision.num_hidden_layers, vl.vision.hidden_size  # patches of the micro-batch
    act = a.stages[0]["chunks"][0]["saved"] - b.stages[0]["chunks"][0]["saved"]
    assert 8 * P * L * D * 4 <= act <= 32 * P * L * D * 4, act / (P * L * D * 4)
    assert ra.detail["media_pixels"] == ra.buffers == P * 3 * 14 * 14 * 4 and rb.buffers == 0
    assert ra.peak - rb.peak >= tower + act
    assert "vision encoder on every position of each 64-token row a placeholder of 224x224 px images" in a.layout
