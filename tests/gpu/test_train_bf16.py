"""A bf16 training run of the tiny config on CUDA through the real entry point: the start-up log names the
kernels, the first step's loss equals the CPU fp32 run's within bf16 tolerance, and later losses stay finite."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import FAST, assert_ok, read_metrics, run_train  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiny_bf16_steps_on_cuda_match_cpu_fp32(tmp_path):
    from gpu_cases import small_corpus

    data = small_corpus(str(tmp_path / "data"))
    runs = {}
    for name, dev, dtype in (("cuda", "cuda", "bfloat16"), ("cpu", "cpu", "float32")):
        out = tmp_path / name
        res = run_train(["--config", "configs/tiny.yaml", *FAST, f"--data.path={data}", "--train.steps=3",
                         f"--train.device={dev}", f"--train.dtype={dtype}", f"--train.out_dir={out}"])
        assert_ok(res)
        runs[name] = (read_metrics(out), res.stderr + res.stdout)
    (gpu, log), (cpu, _) = runs["cuda"], runs["cpu"]
    assert "kda: " in log and "experts: " in log and "mla: " in log
    assert gpu[0]["loss"] == pytest.approx(cpu[0]["loss"], rel=2e-2)
    assert all(math.isfinite(r["loss"]) for r in gpu)
