"""Non-finite steps: fault-injection spec, naming the first bad module, skipping without touching state, stopping.

In-process: the diagnostic re-run names the injected module (forward output, or gradient) and nothing on a clean
step; the checkpoint guard refuses NaN state. Through the real trainer (two ranks forked with torchrun's
environment): pp=2 with a NaN injected on rank 1 -- the log names the module and rank, the step is skipped
(checkpoints before and after it are equal, model, optimizer state and router biases included) and training
continues; under torchrun itself, dp=2 with a NaN at every step from 2 on -- the run stops after
``train.max_skipped_steps`` with exit 3 and every checkpoint written is finite.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from k3train.config import ConfigError, load_config
from k3train.data.batch import Batch
from k3train.preflight import check_injection
from k3train.runtime.nonfinite import (EXIT_TRAINING_STOPPED, INJECT_ENV, NonFiniteGuard, TrainingStopped,
                                       injection_from_env, step_is_finite)
from parallel.dims import single_process_dims
from parallel.pipeline.loss_norm import LossNorm
from parallel.pipeline.runner import build_step_runner
from train_helpers import FAST, read_metrics, run_train, run_train_forked


def test_injection_spec():
    s = injection_from_env({INJECT_ENV: "step=2,rank=1,module=layers.3.attn"})
    assert (s.step, s.onward, s.rank, s.module, s.where) == (2, False, 1, "layers.3.attn", "output")
    assert s.fires_at(2) and not s.fires_at(3)
    s = injection_from_env({INJECT_ENV: "step=3+,module=lm_head,where=grad"})
    assert s.onward and s.rank is None and s.where == "grad" and s.fires_at(7) and not s.fires_at(2)
    assert injection_from_env({}) is None
    for bad in ("step=2", "module=x", "step=0,module=x", "step=two,module=x", "step=1,module=x,where=input",
                "step=1,module=x,color=red", "step=1,step=2,module=x"):
        with pytest.raises(ConfigError, match=INJECT_ENV):
            injection_from_env({INJECT_ENV: bad})
    assert step_is_finite(1.0, [2.0, 0.0]) and not step_is_finite(float("nan"), [1.0])
    assert not step_is_finite(1.0, [float("inf")])


def test_diagnose_names_first_nonfinite_module(monkeypatch):
    """One tiny model (pp = 1, two micro-batches), three injections in turn through the trainer's guard."""
    cfg = load_config("configs/tiny.yaml", ["--train.seq_len=32"], world_size=1)
    runner = build_step_runner(None, cfg, single_process_dims())
    g = torch.Generator().manual_seed(0)
    batches = [Batch.from_samples(torch.randint(3, 4096, (1, 33), generator=g), eos_id=1, pad_id=2)
               for _ in range(2)]
    norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)

    def run():
        return runner.forward_backward(batches, norm)

    def diagnose(spec):
        monkeypatch.setenv(INJECT_ENV, spec)
        guard = NonFiniteGuard(runner.model, runner, rank=0, max_skipped_steps=2, comm_device=torch.device("cpu"))
        guard.begin_step(2)
        stats = run()
        try:
            return stats, guard.diagnose(run)
        finally:
            guard.injector.handle.remove()

    stats, r = diagnose("step=2,module=layers.3.attn")
    assert not math.isfinite(stats["lm_loss_sum"])
    assert (r["module"], r["what"], r["rank"], r["micro_batch"]) == ("layers.3.attn", "forward output", 0, 0)
    stats, r = diagnose("step=2,module=layers.5.ffn,where=grad")
    assert math.isfinite(stats["lm_loss_sum"])  # the forward is clean, the backward is not
    assert (r["module"], r["what"]) == ("layers.5.ffn", "gradient of the output")
    assert r["micro_batch"] == 0  # the earliest in execution order: micro-batch 0's backward runs first
    stats, r = diagnose("step=3,module=layers.3.attn")  # not this step: a clean step, a clean re-run
    assert math.isfinite(stats["lm_loss_sum"]) and r["module"] is None


def test_checkpoint_guard_and_skip_limit():
    guard = NonFiniteGuard(torch.nn.Linear(2, 2), None, rank=0, max_skipped_steps=2, comm_device=torch.device("cpu"))
    good = {"model": {"w": torch.ones(3)}, "optim": {"w.step": torch.tensor(2.0), "ids": torch.arange(3)}}
    guard.assert_finite_state(good, 5)
    bad = {"model": {"w": torch.ones(3)}, "optim": {"w.exp_avg": torch.tensor([1.0, float("inf")])}}
    with pytest.raises(TrainingStopped, match=r"step 5 checkpoint: optim\.w\.exp_avg holds non-finite"):
        guard.assert_finite_state(bad, 5)
    guard.after_step(3, True)
    guard.raise_if_exhausted(3)
    guard.after_step(4, False)  # a good step resets the count
    guard.after_step(5, True)
    guard.after_step(6, True)
    with pytest.raises(TrainingStopped, match="2 consecutive steps"):
        guard.raise_if_exhausted(6)


def test_bad_injection_is_bad_input(corpus_prefix, monkeypatch):
    """Preflight: a module the model lacks or a rank outside the world is one line and exit 2 before any work."""
    cfg = load_config("configs/tiny.yaml", [], world_size=1)
    for spec, msg in (("step=2,module=layers.99.attn", "the model has no module 'layers.99.attn'"),
                      ("step=2,rank=2,module=lm_head", "rank=2 but the run has 1 ranks")):
        monkeypatch.setenv(INJECT_ENV, spec)
        with pytest.raises(ConfigError, match=msg):
            check_injection(cfg)
    monkeypatch.setenv(INJECT_ENV, "step=2,module=layers.99.attn")
    res = run_train_forked(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}", *FAST, "--check"])
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train:")]
    assert lines == [f"k3train: error: {INJECT_ENV}: the model has no module 'layers.99.attn' (e.g. layers.0.attn, "
                     "lm_head)"]


# ---------------------------------------------------------------------------------------------------------------
def _args(prefix, out, steps, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={steps}", *FAST, "--checkpoint.resume=none", "--checkpoint.interval=1",
            "--checkpoint.keep=10", *extra]


def _flat_checkpoint(path, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    sd = torch.load(out, weights_only=False)
    return {f"{sec}.{k}": v for sec in ("model", "optim") for k, v in sd[sec].items()}


def _inject_env(monkeypatch, spec):
    monkeypatch.setenv(INJECT_ENV, spec)


def test_two_ranks_pp2_skips_nan_step_and_continues(corpus_prefix, tmp_path, monkeypatch):
    _inject_env(monkeypatch, "step=2,rank=1,module=layers.7.attn")  # pp=2: layer 7 lives on the last stage
    out = tmp_path / "pp"
    res = run_train_forked(_args(corpus_prefix, out, 3, "--parallel.pp=2"), nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    log = res.stdout + res.stderr
    assert "step 2: non-finite loss nan" in log
    assert "forward output of layers.7.attn on rank 1" in log and "step skipped (1 in a row" in log
    recs = read_metrics(out)
    assert [r["skipped"] for r in recs] == [0.0, 1.0, 0.0]
    assert recs[1]["nonfinite_module"] == "layers.7.attn" and recs[1]["nonfinite_rank"] == 1
    assert all(math.isfinite(r["loss"]) for r in recs if r["step"] != 2)
    assert recs[1]["loss"] is None  # metrics.jsonl is strict JSON: the skipped step's NaN loss is null
    ck = out / "checkpoints"
    before, after, later = (_flat_checkpoint(ck / f"step_0000000{s}", tmp_path) for s in (1, 2, 3))
    assert before.keys() == after.keys()
    assert any(".router.bias" in k for k in before) and any(k.endswith(".exp_avg_sq") for k in before)
    for k in before:  # parameters, router biases, Muon momentum, Adam moments and step counters: untouched
        assert torch.equal(before[k], after[k]), k
    assert sum(not torch.equal(after[k], later[k]) for k in after) > len(after) // 2  # training went on


def test_torchrun_dp2_stops_after_max_skipped_steps(corpus_prefix, tmp_path, monkeypatch):
    _inject_env(monkeypatch, "step=2+,rank=1,module=layers.2.ffn")
    out = tmp_path / "dp"
    res = run_train(_args(corpus_prefix, out, 6, "--train.max_skipped_steps=2"), nproc=2)
    # every worker exits 3; torchrun itself then exits 1 and names the workers' exit code
    assert res.returncode != 0 and re.search(rf"exitcode\s*:\s*{EXIT_TRAINING_STOPPED}\b", res.stderr), \
        res.stderr[-4000:]
    assert "forward output of layers.2.ffn on rank 1" in res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]
    assert lines == ["k3train: error: stopping at step 3: 2 consecutive steps had a non-finite loss or gradient "
                     "(train.max_skipped_steps=2); parameters are those before the first skipped step, the last "
                     "complete checkpoint is kept"]
    assert [(r["step"], r["skipped"]) for r in read_metrics(out)] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_00000001", "step_00000002"]  # none after the stop
    for name in saved:
        assert all(torch.isfinite(v).all() for v in _flat_checkpoint(out / "checkpoints" / name, tmp_path).values()
                   if v.is_floating_point())
