"""Resume into a DIFFERENT parallel layout continues the same run (docs/reliability.md: checkpoints are saved by parameter name
so that another layout can load them): runs of the real entry point (``run_train_forked``: ranks with
torchrun's environment, forked from the fork server).

Each case runs ``K`` steps in layout A (``--train.stop_at_step=K``, checkpointed), then resumes the same
directory in layout B (``--checkpoint.resume=auto``) to step ``N``; every step's loss and grad norm -- A's and
B's -- must equal the uninterrupted single-process ``N``-step run (same tolerance as the e2e layout tests: the
global batch of a step is layout-independent, only fp32 summation order differs). The cases move the model,
optimizer state (ZeRO shards, routed-expert DTensor shards, the MTP embedding replica), data position and router
biases between layouts: pp=2 x vpp=2 -> dp=2 with ZeRO-2; dp=2 x ep=2 (MoonEP, ZeRO-2) -> one process; cp=2 ->
one process. The first two layout-A runs are those test_train_e2e.py resumes in their own layout (the
``stopped_at_2`` fixture of conftest.py: made once).
"""
from __future__ import annotations

import pytest

from train_helpers import FAST, assert_ok, assert_same_run, read_metrics, run_train_forked
from train_helpers import STRAIGHT_STEPS as N

K = 2  # N = 4: step 3's update is B's first with A's optimizer state, step 4's loss shows it
CASES = {  # name: (layout A, nproc A, layout B, nproc B); layout A by name: a `stopped_at_2` run (conftest.py),
    #          the run test_train_e2e.py resumes in layout A itself (made once for both)
    "pp2_vpp2_to_dp2": ("pp2_vpp2", None, ["--parallel.zero=2"], 2),
    "dp2_ep2_to_ep1": ("dp2_ep2", None, [], 0),
    "cp2_to_cp1": (["--parallel.cp=2"], 2, [], 0),
}


def _args(prefix, out, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={N}", *FAST, *extra]


# `straight` (tests/train/conftest.py): one process, N steps without interruption -- shared with test_train_e2e.py


@pytest.mark.parametrize("case", list(CASES))
def test_resume_into_another_layout_continues_the_run(corpus_prefix, tmp_path, straight, stopped_at_2, case):
    layout_a, nproc_a, layout_b, nproc_b = CASES[case]
    out = tmp_path / case
    if isinstance(layout_a, str):
        stopped_at_2(layout_a, out)
    else:
        assert_ok(run_train_forked(_args(corpus_prefix, out, f"--train.stop_at_step={K}", "--checkpoint.resume=auto",
                                         *layout_a), nproc=nproc_a))
    assert [r["step"] for r in read_metrics(out)] == list(range(1, K + 1))
    assert (out / "checkpoints" / f"step_{K:08d}" / "COMPLETE").is_file()
    res = run_train_forked(_args(corpus_prefix, out, "--checkpoint.resume=auto", *layout_b), nproc=nproc_b)
    assert_ok(res)
    log = res.stderr + res.stdout
    assert "resumed from" in log and f"step_{K:08d}" in log, "layout B did not resume from layout A's checkpoint"
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, N + 1))
    print(case, "max |loss diff| %.2e, max rel grad_norm diff %.2e" % (
        max(abs(a["loss"] - b["loss"]) for a, b in zip(got, straight)),
        max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(got, straight))))
    assert_same_run(got, straight, case)
