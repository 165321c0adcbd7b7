"""End to end through the real entry point (``run_train_forked``: one process, or ranks with torchrun's environment
forked from the fork server; tests/cli and test_fault_tolerance.py run torchrun itself): exact resume, layout
independence."""
from __future__ import annotations

import math

import pytest

from train_helpers import FAST, STOP_LAYOUTS, assert_ok, assert_same_run, read_metrics, run_train_forked
from train_helpers import STRAIGHT_STEPS as N

# `straight` (tests/train/conftest.py): single process, N = 4 steps straight, the reference every other layout is
# compared with. The resumed runs stop at step 2 and resume to 4: step 3's update is the first to use the loaded
# optimizer state, and step 4's loss shows it.


def _args(prefix, out, steps, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={steps}", *FAST, *extra]


def test_metrics_fields(straight):
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "mem_gib", "moe_maxvio"):
        assert all(math.isfinite(r[key]) for r in straight), key
    assert straight[0]["loss"] == pytest.approx(math.log(4096), abs=0.15)  # untrained model: uniform-ish


def test_exact_resume_single_process(corpus_prefix, tmp_path, straight):
    """2 steps, stop, resume to 4 == 4 straight (bit-exact losses: same layout, same reduction order)."""
    out = tmp_path / "resumed"
    assert_ok(run_train_forked(_args(corpus_prefix, out, N, "--train.stop_at_step=2", "--checkpoint.resume=auto")))
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    with open(out / "metrics.jsonl", "a") as f:  # a step logged after the checkpoint by a run that then crashed
        f.write('{"step": 3, "loss": 123.0}\n')
    assert_ok(run_train_forked(_args(corpus_prefix, out, N, "--checkpoint.resume=auto")))
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in straight]


def test_two_ranks_pipeline_vpp_trains_and_resumes(corpus_prefix, tmp_path, straight, stopped_at_2):
    """Two ranks, pp=2 x vpp=2: stop at step 2 (checkpoints at 1 and 2; ``stopped_at_2``, shared with
    test_resume_layouts.py), then resume to 4. Same global batch, so every step's loss equals the single-process
    run (up to fp32 summation order)."""
    out = stopped_at_2("pp2_vpp2", tmp_path / "pp")
    pp = [*STOP_LAYOUTS["pp2_vpp2"][0], "--checkpoint.resume=auto"]
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_00000001", "step_00000002"]
    assert_ok(run_train_forked(_args(corpus_prefix, out, N, *pp), nproc=2))
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert_same_run(got, straight)
    for a in got:
        assert a["p2p_bytes"] > 0 and a["p2p_bytes_block_cache"] >= 0


def test_two_ranks_expert_parallel_resumes_exactly(corpus_prefix, tmp_path, straight, stopped_at_2):
    """Two ranks, dp=2 x ep=2 with MoonEP and ZeRO-2: expert shards and their optimizer state are DTensor shards
    in the checkpoint; stop at 2 (``stopped_at_2``, shared with test_resume_layouts.py), resume to 4, every step
    matches the single process."""
    out = stopped_at_2("dp2_ep2", tmp_path / "ep")
    ep = [*STOP_LAYOUTS["dp2_ep2"][0], "--checkpoint.resume=auto"]
    assert_ok(run_train_forked(_args(corpus_prefix, out, N, *ep), nproc=2))
    got = read_metrics(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert_same_run(got, straight)


def test_two_ranks_bf16_with_fp32_masters_tracks_fp32(corpus_prefix, tmp_path, straight):
    """train.dtype=bfloat16: bf16 parameters/activations/p2p payloads, fp32 master weights in the (ZeRO) optimizer.
    Same global batches as the fp32 run, so the losses stay close (bf16 rounding only)."""
    out = tmp_path / "bf16"
    assert_ok(run_train_forked(_args(corpus_prefix, out, N, "--train.dtype=bfloat16", "--parallel.pp=2",
                               "--checkpoint.resume=none"), nproc=2))
    got = read_metrics(out)
    assert len(got) == N
    for a, b in zip(got, straight):
        assert a["loss"] == pytest.approx(b["loss"], abs=0.03)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=0.05)
    assert got[-1]["loss"] < got[0]["loss"]
