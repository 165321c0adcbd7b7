"""CUDA-only tests (marked ``cuda``; each file skips itself without a CUDA device, with the reason). Run them with
``pytest -m cuda tests/gpu`` or as part of ``tools/gpu_check.py``. Their comparisons live in gpu_cases.py, which the
check tool shares."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
