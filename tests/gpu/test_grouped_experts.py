"""torch._grouped_mm routed experts (bf16, sm90+) vs the per-expert loop in fp32 on the same values."""
import pytest
import torch

from gpu_cases import experts_compare

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                       reason="torch._grouped_mm's CUDA kernel needs sm90+"),
]


def test_grouped_mm_experts_match_the_loop():
    r = experts_compare()
    assert r["ok"], r
