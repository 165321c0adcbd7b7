"""tools/gpu_check.py on a machine without CUDA: one line saying so, exit 0, no report written."""
from __future__ import annotations

import json
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


def test_a_section_saves_each_finished_case_so_a_timeout_keeps_them(tmp_path, monkeypatch):
    """Sections save their results after every case (the first H200 run lost a whole section to one slow case):
    the file the driver reads after killing a section holds every case that finished, with its seconds."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    path = tmp_path / "section.json"
    monkeypatch.setattr(gpu_check, "_SECTION_OUT", [str(path)])
    out = {"compare": []}
    gpu_check._add(out, "compare", lambda n: {"n": n, "ok": True}, 1)
    gpu_check._add(out, "compare", lambda n: {"n": n, "ok": True}, 2)
    saved = json.loads(path.read_text())
    assert [c["n"] for c in saved["compare"]] == [1, 2] and all("seconds" in c for c in saved["compare"])
