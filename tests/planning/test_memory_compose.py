"""The memory estimator's per-layer traces (what K3-length sequences compose) depend on ep only through the
per-expert bookkeeping (a few bytes per local expert), which is why one trace per (micro-batch, cp, dtype) serves
every ep (``memory.trace_chunk``'s piece cache)."""
from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import load_config
from k3train.planning import memory


def test_moe_layer_trace_equal_across_ep():
    got = {}
    for ep in (1, 4):
        cfg = load_config("configs/tiny.yaml", ["--train.seq_len=256", "--train.global_batch_size=8",
                                                "--parallel.dp=4", f"--parallel.ep={ep}"], world_size=4)
        layer = next(i for i in range(cfg.model.num_hidden_layers) if memory._layer_is_moe(cfg, i))
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        full = memory.build_full(cfg, ep, 0, fake)
        assert full.layers[str(layer)].ffn.experts.num_experts == cfg.model.num_experts // ep
        batch = memory.trace_batch(cfg, 1, 256)[0]
        got[ep] = memory.trace_range(cfg, full, layer, layer + 1, False, False, batch, fake, False)
    for x, y in zip(got[1], got[4]):  # saved, forward peak, backward peak
        assert y > 0 and abs(x - y) <= 1e-4 * y, (got[1], got[4])


def test_ffn_piece_does_not_depend_on_cp():
    """An FFN sublayer reads no sequence layout (``K3Layer.run_ffn``): traced on CP rank 0 and 1 of a cp=4 group
    with the real KCP context it holds exactly what it holds without CP, which is why its composed fits are cached
    once for every cp (``memory.piece_depends_on_cp``) -- a token mixer's are not (its KCP pairs / keys)."""
    cfg = load_config("configs/tiny.yaml", ["--train.seq_len=512", "--train.global_batch_size=8", "--parallel.cp=4",
                                            "--parallel.dp=1", "--parallel.recompute=true",
                                            "--parallel.recompute_granularity=sublayer"], world_size=4)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    full = memory.build_full(cfg, 1, 0, fake)
    T = 128
    row = [memory.trace_batch(cfg, 1, T, r)[0] for r in range(4)]
    for i in (0, 1, 3):  # dense FFN, MoE FFN, the MLA layer's MoE FFN
        plain = memory.trace_range(cfg, full, i, i + 1, False, False, row[0], fake, True, None, None, None, "ffn")
        assert plain[0] > 0
        for r in (0, 1):
            under_cp = memory.trace_range(cfg, full, i, i + 1, False, False, row[r], fake, True, r, row, None, "ffn")
            assert under_cp == plain, (i, r, under_cp, plain)
    assert not memory.piece_depends_on_cp(cfg, ("ffn", True), None)
    assert memory.piece_depends_on_cp(cfg, ("mixer", "kda"), None) and memory.piece_depends_on_cp(cfg, ("head",), None)
