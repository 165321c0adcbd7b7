"""Full tiny K3 model (KDA + Gated MLA + LatentMoE + AttnRes + MTP): forward + backward under CP equals cp = 1.

cp = 2 on a packed batch; cp = 3 and 4 on the layouts that used to hang KCP and on segments shorter than the
ShortConv halo, with the collective trace checked identical across the CP ranks.

Each CP rank runs the model on its contiguous segment with ``seq.cp = KCPContext``; the loss of every rank is its
token-loss sums divided by the GLOBAL token counts, so summing the losses and the parameter gradients over the CP
group must reproduce the single-process run on the full rows (computed by every rank itself).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from collective_trace import assert_collectives_match, trace_collectives
from dist_helpers import run_distributed
from kcp_cases import HANG_LAYOUTS

from k3train.config import load_config
from k3train.data.batch import Batch
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo
from kcp import KCPContext
from parallel.dims import ParallelDims


def _batch(B: int, T: int, vocab: int, eos: int, seed: int) -> Batch:
    """Packed rows: documents of varied lengths, some crossing the CP boundary at T/2, one ending exactly there."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, vocab, (B, T + 1), generator=g)
    s[0, [5, 11, 40]] = eos  # row 0: short docs, then one crossing the boundary
    s[1, [T // 2 - 1, 50]] = eos  # row 1: a document starts exactly at the boundary
    return Batch.from_samples(s, eos_id=eos)


def _loss(out: dict[str, torch.Tensor], lm_tokens: float, mtp_tokens: float, w: float) -> torch.Tensor:
    return out["lm_loss_sum"] / lm_tokens + w * out["mtp_loss_sum"] / mtp_tokens


def _body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    cfg = load_config("configs/tiny.yaml", ["--model.num_hidden_layers=4"]).model  # layers: KDA x3, MLA
    batch = _batch(2, 64, cfg.vocab_size, cfg.eos_token_id, seed=5)
    lm_tok, mtp_tok = batch.loss_mask.sum().item(), batch.mtp_loss_mask.sum().item()
    w = cfg.mtp_loss_weight

    ref = K3Model(cfg)
    ref.init_weights(7)
    ref.train()
    seq_ref = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
    state = ref.forward_layers(ref.embed(batch.tokens), 0, cfg.num_hidden_layers, seq_ref)
    loss_ref = _loss(ref.loss_sums(state, batch, seq_ref), lm_tok, mtp_tok, w)
    loss_ref.backward()

    model = K3Model(cfg)
    model.init_weights(7)
    model.train()
    local = batch.slice_cp(dims.cp_rank, dims.cp)
    ctx = KCPContext.from_batch(local, dims)
    seq = SeqInfo.from_doc_ids(local.doc_ids, local.positions, cp=ctx)
    state = model.forward_layers(model.embed(local.tokens), 0, cfg.num_hidden_layers, seq)
    loss = _loss(model.loss_sums(state, local, seq), lm_tok, mtp_tok, w)
    loss.backward()
    assert ctx.plan.any_chain and ctx.stats.bytes["kda_fwd"] > 0 and ctx.stats.bytes["mla_fwd"] > 0

    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.group("cp"))
    torch.testing.assert_close(total, loss_ref.detach(), atol=1e-5, rtol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=dims.group("cp"))
        g_ref = ref_params[name].grad if ref_params[name].grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grad, g_ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"grad of {name}: {m}")


def test_full_model_cp2_equals_cp1() -> None:
    run_distributed(_body, 2)


def _batch_from_lengths(rows: list[list[int]], vocab: int, eos: int, seed: int) -> Batch:
    """Packed rows whose documents have exactly the given lengths (EOS closes each; doc k+1 starts after it)."""
    T = sum(rows[0])
    s = torch.randint(3, vocab, (len(rows), T + 1), generator=torch.Generator().manual_seed(seed))
    for b, lengths in enumerate(rows):
        ends = torch.cumsum(torch.tensor(lengths), 0) - 1
        s[b, ends] = eos
    return Batch.from_samples(s, eos_id=eos)


# the model stack on the hang layouts (kcp_cases.HANG_LAYOUTS): isolated segments next to carried state,
# a document over every rank, and segments of 2 tokens (shorter than the ShortConv halo of 3)
MODEL_CASES = {3: ("whole_and_half", "mixed", "short_halo"), 4: ("failing_16_32", "one_doc", "short_halo")}


def _body_hang_layouts(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    dims = ParallelDims(cp=world_size, world_size=world_size, rank=rank).build_groups()
    cfg = load_config("configs/tiny.yaml", ["--model.num_hidden_layers=4"]).model  # KDA x3, MLA; MoE; MTP
    w = cfg.mtp_loss_weight
    ref, model = K3Model(cfg), K3Model(cfg)
    for m in (ref, model):
        m.init_weights(7)
        m.train()
    ref_params = dict(ref.named_parameters())
    for i, name in enumerate(MODEL_CASES[world_size]):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        batch = _batch_from_lengths(HANG_LAYOUTS[world_size][name], cfg.vocab_size, cfg.eos_token_id, seed=30 + i)
        lm_tok, mtp_tok = batch.loss_mask.sum().item(), max(batch.mtp_loss_mask.sum().item(), 1.0)
        seq_ref = SeqInfo.from_doc_ids(batch.doc_ids, batch.positions)
        state = ref.forward_layers(ref.embed(batch.tokens), 0, cfg.num_hidden_layers, seq_ref)
        loss_ref = _loss(ref.loss_sums(state, batch, seq_ref), lm_tok, mtp_tok, w)
        loss_ref.backward()

        local = batch.slice_cp(dims.cp_rank, dims.cp)
        with trace_collectives() as trace:
            ctx = KCPContext.from_batch(local, dims)
            seq = SeqInfo.from_doc_ids(local.doc_ids, local.positions, cp=ctx)
            state = model.forward_layers(model.embed(local.tokens), 0, cfg.num_hidden_layers, seq)
            loss = _loss(model.loss_sums(state, local, seq), lm_tok, mtp_tok, w)
            loss.backward()
        assert_collectives_match(trace)
        # KDA x3 in the stack (+ none in the MTP layer): every halo and, where a document crosses, every fold ran
        # its backward on this rank too
        assert ctx.stats.calls["halo_bwd"] == 3 and ctx.stats.calls["kda_bwd"] == (3 if ctx.plan.any_chain else 0)

        where = f"case={name} rank={rank}/{world_size}"
        total = loss.detach().clone()
        dist.all_reduce(total, group=dims.group("cp"))
        torch.testing.assert_close(total, loss_ref.detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"loss {where}: {m}")
        for pname, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=dims.group("cp"))
            g_ref = ref_params[pname].grad if ref_params[pname].grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(grad, g_ref, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"grad of {pname} {where}: {m}")


@pytest.mark.parametrize("cp", [3, 4])
def test_full_model_hang_layouts_equal_cp1(cp: int) -> None:
    run_distributed(_body_hang_layouts, cp, timeout=150)
