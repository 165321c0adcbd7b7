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



def _piece_bytes(cfg, full, fake, cache, key, rank, T):
    """``memory.trace_piece`` of a mixer / layer / head piece as ``trace_chunk`` calls it."""
    reps = memory.piece_layers(cfg)
    if key == ("head",):
        L = cfg.model.num_hidden_layers
        return memory.trace_piece(cfg, full, fake, cache, key, L, L, False, True, None, (), "mla", B=1, T=T,
                                  cp_rank=rank)
    i = reps[key]
    sub = "mixer" if key[0] == "mixer" else None
    return memory.trace_piece(cfg, full, fake, cache, key, i, i + 1, False, False, sub, (),
                              cfg.model.layer_kind(i), B=1, T=T, cp_rank=rank)


def test_pieces_above_cp16_extend_their_line_exactly(monkeypatch):
    """Above ``CP_TRACED_MAX`` a cp-dependent piece is traced at ``CP_LINE`` and extended on its line: at cp 24 it
    holds exactly what a trace at cp 24 holds, on the first, second, a middle and the last CP rank, with and
    without the MLA query balance, for the KDA and MLA mixers and the head (sublayer recomputation) and an MLA layer
    (layer recomputation)."""
    T, C, traced_max = 256, 24, memory.CP_TRACED_MAX
    for balance, gran in ((True, "sublayer"), (False, "layer")):
        cfg = load_config("configs/tiny.yaml", [f"--train.seq_len={C * T}", f"--model.max_position_embeddings={C * T}",
                                                "--train.global_batch_size=2", "--train.micro_batch_size=1",
                                                f"--parallel.cp={C}", "--parallel.dp=1", "--parallel.recompute=true",
                                                f"--parallel.recompute_granularity={gran}",
                                                f"--parallel.mla_cp_balance={str(balance).lower()}"], world_size=C)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        full = memory.build_full(cfg, 1, 0, fake)
        if gran == "sublayer":
            keys = [("mixer", "kda"), ("mixer", "mla"), ("head",)]
        else:  # an MLA layer (its keys without the balance: rank r attends r + 1 segments)
            keys = [next(k for k in memory.piece_layers(cfg) if k[0] == "mla")]
        for key in keys:
            line_cache, direct_cache = {}, {}
            for rank in (0, 1, 13, C - 1):
                line = _piece_bytes(cfg, full, fake, line_cache, key, rank, T)
                monkeypatch.setattr(memory, "CP_TRACED_MAX", 64)
                direct = _piece_bytes(cfg, full, fake, direct_cache, key, rank, T)
                monkeypatch.setattr(memory, "CP_TRACED_MAX", traced_max)
                assert line == direct and min(direct) > 0, (balance, key, rank, line, direct)
            assert any(k[len(key) + 1] == C for k in direct_cache) and not any(
                k[len(key) + 1] == C for k in line_cache), "the line is not traced at cp 24; the direct trace is"
