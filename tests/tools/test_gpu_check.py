"""tools/gpu_check.py on a machine without CUDA: one line saying so, exit 0, no report written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path of tools/gpu_check.py")
def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py"), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], p.stdout
    assert not out.exists()
