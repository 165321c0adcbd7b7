"""The memory estimator's per-layer traces (what K3-length sequences compose): what they depend on, and so how
they are keyed in ``memory.trace_chunk``'s piece cache -- per local expert count where a piece runs routed experts
(the backward holds one expert weight's gradient for every local expert at once), once for every cp where a piece
reads no sequence layout."""
from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode

from k3train.config import load_config
from k3train.planning.fakerun.synthetic import trace_batch
from k3train.planning.memory import pieces
from k3train.planning.memory.compose import whole_traces
from k3train.planning.memory.estimate import estimate
from k3train.planning.memory.fake_model import build_full
from k3train.planning.memory.piece_bytes import end_bytes, ffn_saved_bytes
from k3train.planning.memory.pieces import piece_depends_on_cp, piece_layers, piece_local_experts, trace_piece
from k3train.planning.memory.trace import trace_range


FAT_EXPERTS = ("--model.routed_expert_hidden_size=512", "--model.moe_intermediate_size=512")


def test_moe_piece_holds_one_weight_gradient_per_local_expert():
    """With experts whose weights outweigh the tokens' activations (as K3's: 3584 x 3072, 22 MB an expert in
    bf16), the MoE FFN piece's backward peak grows by one expert weight's gradient per local expert (within 1%:
    the rest of the peak differs by bookkeeping bytes); what it saves for the backward does not depend on ep."""
    got, cfgs = {}, {}
    for ep in (1, 4):
        cfg = cfgs[ep] = load_config("configs/tiny.yaml", ["--train.seq_len=256", "--train.global_batch_size=8",
                                                           "--parallel.dp=4", f"--parallel.ep={ep}", *FAT_EXPERTS],
                                     world_size=4)
        layer = next(i for i in range(cfg.model.num_hidden_layers) if cfg.model.is_moe_layer(i))
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        full = build_full(cfg, ep, 0, fake)
        assert full.layers[str(layer)].ffn.experts.num_experts == cfg.model.num_experts // ep
        assert piece_local_experts(full, layer, layer + 1, False, "ffn") == cfg.model.num_experts // ep
        assert piece_local_experts(full, layer, layer + 1, False, "mixer") == 0
        batch = trace_batch(cfg, 1, 256)[0]
        got[ep] = trace_range(cfg, full, layer, layer + 1, False, False, batch, fake, False, part="ffn")
    m = cfgs[1].model
    weight_grad = m.routed_expert_hidden_size * m.moe_intermediate_size * 4  # fp32
    extra = got[1][2] - got[4][2]
    moved = m.num_experts - m.num_experts // 4
    assert abs(extra - moved * weight_grad) <= 0.01 * moved * weight_grad, (got, weight_grad)
    assert abs(got[1][0] - got[4][0]) <= 64 * moved, got


def test_ffn_and_end_pieces_at_every_ep_at_least_the_smaller_end():
    """The planner's static bound reads what the FFN sublayers keep, and the end pieces (the head's MTP layer
    runs the local experts), at the smallest and the largest ep of the space, the smaller of the two
    (``Planner._ffn_saved``, ``Planner._ends_low``): no ep between holds less."""
    got, ends = {}, {}
    for ep in (1, 2, 4, 8):
        for rc in ("false", "true"):  # the FFN without recomputation (under it a MoE keeps its input alone), the
            # end pieces under sublayer recomputation (where the planner reads them)
            over = ["--train.seq_len=8192", "--model.max_position_embeddings=8192", "--train.global_batch_size=8",
                    "--train.micro_batch_size=1", "--parallel.dp=8", f"--parallel.ep={ep}",
                    f"--parallel.recompute={rc}", "--parallel.recompute_granularity=sublayer", *FAT_EXPERTS]
            cfg = load_config("configs/tiny.yaml", over, world_size=8)
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            full = build_full(cfg, ep, 0, fake)
            if rc == "false":
                got[ep] = ffn_saved_bytes(cfg, full, fake, {}, 1, 8192)
            else:
                ends[ep] = end_bytes(cfg, full, fake, {}, 1, 8192)
        assert piece_local_experts(full, 8, 8, True, None) == 8 // ep  # the MTP layer's MoE
    for moe in got[1]:
        lo = min(got[1][moe], got[8][moe])
        assert all(got[ep][moe] >= lo for ep in got), got
    assert got[1][True] != got[8][True]  # it does move with ep (the bookkeeping and the folded route ids)
    for k in ("embed", "head"):
        for i in (0, 1):  # saved, backward peak
            lo = min(ends[1][k][i], ends[8][k][i])
            assert all(ends[ep][k][i] >= lo for ep in ends), (k, ends)
    assert ends[1]["head"][1] > ends[8]["head"][1]  # the MTP MoE's weight gradients


def test_estimate_does_not_reuse_pieces_of_another_ep():
    """The planner's cache keeps the composed pieces of every layout it traced: an estimate after another ep's
    pieces were traced equals a fresh one (the search and a plan pinned to the layout report the same peak)."""
    from k3train.planning.memory.cache import EstimateCache

    over = ["--train.seq_len=32768", "--model.max_position_embeddings=32768", "--train.global_batch_size=4",
            "--train.micro_batch_size=1", "--parallel.dp=4", "--data.path=/nonexistent", *FAT_EXPERTS]  # synthetic
    cfgs = {ep: load_config("configs/tiny.yaml", over + [f"--parallel.ep={ep}"], world_size=4) for ep in (1, 4)}
    assert not whole_traces(cfgs[4], 1, 32768)  # composed from pieces
    shared = EstimateCache()
    first = estimate(cfgs[1], 4, shared)
    after = estimate(cfgs[4], 4, shared)
    fresh = estimate(cfgs[4], 4, EstimateCache())
    assert [r.peak for r in after.ranks] == [r.peak for r in fresh.ranks]
    # 6 of the 8 experts' weight gradients (512 x 512 fp32) fewer in a MoE layer's backward at ep 4
    assert max(r.peak for r in first.ranks) > max(r.peak for r in fresh.ranks) + 6 * 512 * 512 * 4


def test_ffn_piece_does_not_depend_on_cp():
    """An FFN sublayer reads no sequence layout (``K3Layer.run_ffn``): traced on CP rank 0 and 1 of a cp=4 group
    with the real KCP context it holds exactly what it holds without CP, which is why its composed fits are cached
    once for every cp (``memory.piece_depends_on_cp``) -- a token mixer's are not (its KCP pairs / keys)."""
    cfg = load_config("configs/tiny.yaml", ["--train.seq_len=512", "--train.global_batch_size=8", "--parallel.cp=4",
                                            "--parallel.dp=1", "--parallel.recompute=true",
                                            "--parallel.recompute_granularity=sublayer"], world_size=4)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    full = build_full(cfg, 1, 0, fake)
    T = 128
    row = [trace_batch(cfg, 1, T, r)[0] for r in range(4)]
    for i in (0, 1, 3):  # dense FFN, MoE FFN, the MLA layer's MoE FFN
        plain = trace_range(cfg, full, i, i + 1, False, False, row[0], fake, True, None, None, None, "ffn")
        assert plain[0] > 0
        for r in (0, 1):
            under_cp = trace_range(cfg, full, i, i + 1, False, False, row[r], fake, True, r, row, None, "ffn")
            assert under_cp == plain, (i, r, under_cp, plain)
    assert not piece_depends_on_cp(cfg, ("ffn", True), None)
    assert piece_depends_on_cp(cfg, ("mixer", "kda"), None) and piece_depends_on_cp(cfg, ("head",), None)



def _piece_bytes(cfg, full, fake, cache, key, rank, T):
    """``memory.trace_piece`` of a mixer / layer / head piece as ``trace_chunk`` calls it."""
    reps = piece_layers(cfg)
    if key == ("head",):
        L = cfg.model.num_hidden_layers
        return trace_piece(cfg, full, fake, cache, key, L, L, False, True, None, (), "mla", B=1, T=T,
                                  cp_rank=rank)
    i = reps[key]
    sub = "mixer" if key[0] == "mixer" else None
    return trace_piece(cfg, full, fake, cache, key, i, i + 1, False, False, sub, (),
                              cfg.model.layer_kind(i), B=1, T=T, cp_rank=rank)


def test_pieces_above_cp16_extend_their_line_exactly(monkeypatch):
    """Above ``CP_TRACED_MAX`` a cp-dependent piece is traced at ``CP_LINE`` and extended on its line: at cp 24 it
    holds exactly what a trace at cp 24 holds, on the first, second, a middle and the last CP rank, with and
    without the MLA query balance, for the KDA and MLA mixers and the head (sublayer recomputation) and an MLA layer
    (layer recomputation)."""
    T, C, traced_max = 256, 24, pieces.CP_TRACED_MAX
    for balance, gran in ((True, "sublayer"), (False, "layer")):
        cfg = load_config("configs/tiny.yaml", [f"--train.seq_len={C * T}", f"--model.max_position_embeddings={C * T}",
                                                "--train.global_batch_size=2", "--train.micro_batch_size=1",
                                                f"--parallel.cp={C}", "--parallel.dp=1", "--parallel.recompute=true",
                                                f"--parallel.recompute_granularity={gran}",
                                                f"--parallel.mla_cp_balance={str(balance).lower()}"], world_size=C)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        full = build_full(cfg, 1, 0, fake)
        if gran == "sublayer":
            keys = [("mixer", "kda"), ("mixer", "mla"), ("head",)]
        else:  # an MLA layer (its keys without the balance: rank r attends r + 1 segments)
            keys = [next(k for k in piece_layers(cfg) if k[0] == "mla")]
        for key in keys:
            line_cache, direct_cache = {}, {}
            for rank in (0, 1, 13, C - 1):
                line = _piece_bytes(cfg, full, fake, line_cache, key, rank, T)
                monkeypatch.setattr(pieces, "CP_TRACED_MAX", 64)
                direct = _piece_bytes(cfg, full, fake, direct_cache, key, rank, T)
                monkeypatch.setattr(pieces, "CP_TRACED_MAX", traced_max)
                assert line == direct and min(direct) > 0, (balance, key, rank, line, direct)
            assert any(k[len(key) + 1] == C for k in direct_cache) and not any(
                k[len(key) + 1] == C for k in line_cache), "the line is not traced at cp 24; the direct trace is"
