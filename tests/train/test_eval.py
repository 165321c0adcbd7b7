"""Validation loss through the real trainer: the value against an independent forward of the checkpointed model,
layout independence (pp=2 x vpp=2 x dp=2, and cp=2 x ep=2 ranks, against one process), and no effect on the
training trajectory."""
from __future__ import annotations

import math

import pytest
import torch

from k3train.config import ConfigError, load_config
from train_helpers import FAST, assert_ok, read_metrics, run_train_forked

EVAL = ["--data.split=90,10,0", "--train.eval_interval=2", "--train.eval_iters=2"]


def _args(prefix, out, steps, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={steps}", *FAST, "--checkpoint.resume=none", *extra]


@pytest.fixture(scope="module")
def single(corpus_prefix, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_single")
    res = run_train_forked(_args(corpus_prefix, out, 3, *EVAL))
    assert_ok(res)
    return out, read_metrics(out), res.stdout


def test_val_loss_logged_and_equals_direct_forward(single, corpus_prefix, tmp_path):
    """val_loss at steps 2 (interval) and 3 (end of training) only; at step 3 it equals the token-weighted mean
    loss of a plain K3Model forward (eval mode, no_grad) of the step-3 checkpoint over the first eval_iters
    global batches of the valid split."""
    out, recs, stdout = single
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 3]
    assert all("val_mtp_loss" in r for r in recs if "val_loss" in r)
    assert "val_loss" in stdout  # the progress line
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from k3train.data import GlobalBatchLoader
    from k3train.model.model import K3Model

    cfg = load_config("configs/tiny.yaml", [f"--data.path={corpus_prefix}", *FAST, *EVAL], world_size=1)
    dcp_to_torch_save(out / "checkpoints" / "step_00000003", tmp_path / "ck.pt")
    model = K3Model(cfg.model)
    model.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False)["model"])
    model.eval()
    loader = GlobalBatchLoader(cfg, split="valid")
    sums = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for i in range(cfg.train.eval_iters):
            o = model(loader.global_batch(i * cfg.train.global_batch_size))
            sums += torch.stack([o["lm_loss_sum"], o["mtp_loss_sum"], o["lm_tokens"], o["mtp_tokens"]]).double()
    assert recs[-1]["val_loss"] == pytest.approx(float(sums[0] / sums[2]), rel=1e-6)
    assert recs[-1]["val_mtp_loss"] == pytest.approx(float(sums[1] / sums[3]), rel=1e-6)
    assert recs[-1]["val_loss"] != recs[0]["loss"]  # a different split than training


def test_eval_does_not_change_training(single, corpus_prefix, tmp_path):
    """The same run without evaluation: bit-identical per-step losses and grad norms (no QB statistics, QK-Clip
    maxima, RNG or data position touched by the evaluation)."""
    out = tmp_path / "noeval"
    assert_ok(run_train_forked(_args(corpus_prefix, out, 3, *EVAL, "--train.eval_interval=0")))
    got = read_metrics(out)
    ref = single[1]
    assert all("val_loss" not in r for r in got)
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in ref]
    assert [r["moe_maxvio"] for r in got] == [r["moe_maxvio"] for r in ref]


@pytest.mark.parametrize("layout,nproc", [
    (["--parallel.pp=2", "--parallel.vpp=2", "--parallel.dp=2"], 4),
    (["--parallel.cp=2", "--parallel.ep=2", "--parallel.zero=2"], 2),
], ids=["pp2xvpp2xdp2", "cp2xep2"])
def test_val_loss_is_layout_independent(single, corpus_prefix, tmp_path, layout, nproc):
    out = tmp_path / "layout"
    assert_ok(run_train_forked(_args(corpus_prefix, out, 3, *EVAL, *layout), nproc=nproc))
    got, ref = read_metrics(out), single[1]
    assert [r["step"] for r in got if "val_loss" in r] == [2, 3]
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        for k in ("val_loss", "val_mtp_loss"):
            if k in b:
                assert math.isfinite(a[k]) and a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a["step"])


def test_eval_config_errors():
    with pytest.raises(ConfigError, match=r"train\.eval_interval: .*data\.split='100,0,0' gives it weight 0"):
        load_config("configs/tiny.yaml", ["--train.eval_interval=5", "--data.split=100,0,0"], world_size=1)
    with pytest.raises(ConfigError, match=r"train\.eval_iters: must be >= 1"):
        load_config("configs/tiny.yaml", ["--train.eval_interval=5", "--train.eval_iters=0"], world_size=1)
    with pytest.raises(ConfigError, match=r"train\.max_skipped_steps: must be >= 1"):
        load_config("configs/tiny.yaml", ["--train.max_skipped_steps=0"], world_size=1)
    load_config("configs/tiny.yaml", ["--train.eval_interval=0", "--data.split=100,0,0"], world_size=1)


@pytest.mark.parametrize("schedule,pp,vpp,M", [("afab", 2, 2, 3), ("1f1b", 4, 1, 6), ("interleaved", 2, 2, 4),
                                               ("interleaved", 4, 2, 8), ("interleaved", 3, 3, 3)])
def test_forward_only_programs_are_deadlock_free(schedule, pp, vpp, M):
    """The evaluation pass runs each schedule's forwards only: every forward once, no deadlock, and the two ends
    of every rank pair post the same p2p sequence (the static checks of the training programs)."""
    from parallel.pipeline.p2p import build_programs, check_programs
    from parallel.pipeline.schedules import build_schedule, forward_only_schedule, simulate

    sched = forward_only_schedule(build_schedule(schedule, pp, vpp, M))
    assert all(len(acts) == vpp * M and all(a.kind == "F" for a in acts) for acts in sched)
    programs = build_programs(sched, pp, vpp, simulate(sched, pp, vpp))
    check_programs(programs, pp, vpp)
    assert not any(i.op != "compute" and i.msg.kind == "grad" for prog in programs for i in prog)
