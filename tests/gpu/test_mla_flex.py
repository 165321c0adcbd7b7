"""FlexAttention MLA (k3train/ops/mla_flex.py) and the blockwise op vs the dense reference on CUDA: document +
causal mask, q/k 192 and v 128 wide, output, per-head max logit and gradients, fp32 and bf16."""
import pytest
import torch

from gpu_cases import mla_compare

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_and_blockwise_mla_match_the_dense_reference(dtype):
    r = mla_compare(dtype, T=512, H=4)
    assert r["flex"]["ok"], r["flex"]
    if "blockwise" in r and isinstance(r["blockwise"], dict):
        assert r["blockwise"]["ok"], r["blockwise"]
