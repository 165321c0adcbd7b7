"""fla's chunk_kda (through k3train/ops/kda_fla.py) vs k3train's chunk_kda on CUDA: varlen documents, an initial
state per document, K3's lower-bounded gate; outputs, final states and every input's gradient, fp32 and bf16."""
import importlib.util

import pytest
import torch

from gpu_cases import kda_compare

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                       reason="needs flash-linear-attention (pip install k3train[gpu])"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kda_matches_the_torch_op(dtype):
    r = kda_compare(dtype, T=1024, H=4, K=128)
    assert r["ok"], r


def test_fla_kda_is_wrong_for_a_wrong_gate():
    """The comparison can fail: fla without the decay (g = 0) is far from the reference."""
    from gpu_cases import kda_inputs
    from k3train.ops.kda import chunk_kda
    from k3train.ops.kda_fla import fla_chunk_kda

    inp = kda_inputs(256, 2, 64, torch.float32)
    args = dict(scale=64 ** -0.5, cu_seqlens=inp["cu_seqlens"], g_lower_bound=-5.0)
    o, _ = fla_chunk_kda(inp["q"], inp["k"], inp["v"], torch.zeros_like(inp["g"]), inp["beta"], **args)
    ref, _ = chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **args)
    assert (o - ref).norm() / ref.norm() > 0.1
