"""ZeRO-0/1/2 on gloo ranks give the same parameters as the unsharded single-process optimizer.

Every rank feeds different data; losses are divided by the GLOBAL token count (as the trainer does), so the
sharded optimizer SUMS gradients across ranks and the reference accumulates all ranks' losses in one process.
The reference runs inside every rank (no communication): ``ParallelDims()`` is the single-process layout.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import run_distributed
from k3train.config import OptimConfig
from k3train.optim import build_optimizer
from parallel.dims import ParallelDims

from optim_testing_models import TinyNet, tiny_batch

ATOL, RTOL = 1e-6, 1e-5
LRS = (0.02, 0.015, 0.01)


def _cfg(tau: float = 1.5) -> OptimConfig:
    return OptimConfig(lr=0.02, weight_decay=0.1, qk_clip_threshold=tau)


def _assert_params(model: nn.Module, ref: nn.Module, what: str, slices: dict | None = None) -> None:
    rp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = rp[n].data if not slices or n not in slices else rp[n].data[slices[n]]
        torch.testing.assert_close(p.data, want, atol=ATOL, rtol=RTOL, msg=f"{what}: {n}")


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------------------
def _body_dp(rank: int, world: int) -> None:
    dims = ParallelDims(dp=world, world_size=world, rank=rank).build_groups()
    cfg = _cfg()
    for zero in (0, 1, 2):
        model, ref = TinyNet(seed=7), TinyNet(seed=7)
        opt = build_optimizer(model, cfg, dims, zero=zero, grad_clip=0.5, log_table=False)
        ref_opt = build_optimizer(ref, cfg, ParallelDims(), zero=0, grad_clip=0.5, log_table=False)
        clipped = 0.0
        for step, lr in enumerate(LRS):
            batches = [tiny_batch(100 * step + r) for r in range(world)]
            ntok = sum(b[1].numel() for b in batches)
            (model.loss_sum(*batches[rank]) / ntok).backward()
            if zero == 2:  # a "chunk" finishes early: its grads go to owners and vanish elsewhere
                chunk = list(model.attn.parameters())
                opt.reduce_chunk_grads(chunk)
                chunk_ids = {id(p) for p in chunk}
                for inf in opt.infos:
                    if id(inf.param) in chunk_ids:
                        assert (inf.param.grad is None) == (inf.owner != rank), inf.fqn
            out = opt.step(lr)
            for b in batches:
                (ref.loss_sum(*b) / ntok).backward()
            rout = ref_opt.step(lr)
            assert math.isclose(out["grad_norm"], rout["grad_norm"], rel_tol=1e-5), (out, rout)
            assert rout["grad_norm"] > 0.5  # clipping is active, so the global norm matters
            assert out["qk_clipped_heads"] == rout["qk_clipped_heads"]
            clipped += out["qk_clipped_heads"]
            _assert_params(model, ref, f"zero={zero} world={world} step={step}")
            if zero == 2:  # after the step only owned gradients remain on this rank
                owned_bytes = sum(i.numel * 4 for i in opt.infos if i.owner == rank)
                assert opt.grad_bytes() == owned_bytes, (opt.grad_bytes(), owned_bytes)
            opt.zero_grad()
            ref_opt.zero_grad()
        assert clipped > 0  # QK-Clip fired (with MAX-all-reduced qk_max) and agreed with the reference
        # optimizer-state bytes: the shards tile the unsharded state, each ~1/DP of it
        sizes = _gather(opt.state_bytes())
        full = ref_opt.state_bytes()
        if zero == 0:
            assert sizes == [full] * world
        else:
            assert sum(sizes) == full
            largest = max(i.state_numel() * 4 for i in opt.infos)
            assert max(sizes) <= full / world + largest, (sizes, full)
        # checkpoint: each rank holds only its own entries; together they are the unsharded state
        sds = _gather({k: v.clone() for k, v in opt.state_dict().items()})
        merged = {}
        for sd in sds:
            assert zero == 0 or not (set(sd) & set(merged))
            merged.update(sd)
        ref_sd = ref_opt.state_dict()
        assert set(merged) == set(ref_sd)
        for k, v in ref_sd.items():
            torch.testing.assert_close(merged[k], v, atol=ATOL, rtol=RTOL, msg=k)
        # ... and a fresh optimizer (any layout) restores its share from the merged dict
        fresh = build_optimizer(model, cfg, dims, zero=zero, log_table=False)
        fresh.load_state_dict(merged)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, opt.state_dict()[k]), k


def test_zero_matches_unsharded_2_ranks():
    run_distributed(_body_dp, 2)


def test_zero_matches_unsharded_4_ranks():
    run_distributed(_body_dp, 4)


# ---------------------------------------------------------------------------------------------------------------
class TwoStage(nn.Module):
    """Emulates pipeline stages: stage s holds ``s{s}`` only (same FQNs as the full model). ``shared`` is held by
    BOTH stages (like the MTP-shared embedding): its gradient is summed over the pp group before the step and
    the last stage's copy is excluded from the grad norm."""

    def __init__(self, stages=(0, 1)):
        super().__init__()
        self.parts = nn.ModuleDict({f"s{s}": TinyNet(seed=11 + s, d=16 if s == 0 else 24) for s in stages})
        self.shared = nn.Parameter(torch.randn(32, 8, generator=torch.Generator().manual_seed(3)))

    def loss_sum(self, stage: int, tokens, labels):
        return self.parts[f"s{stage}"].loss_sum(tokens, labels) + self.shared[tokens].sin().sum()


def _body_pp(rank: int, world: int) -> None:
    dims = ParallelDims(pp=2, dp=2, world_size=world, rank=rank).build_groups()
    cfg = _cfg()
    stage = dims.pp_rank
    for zero in (0, 1, 2):
        model, ref = TwoStage(stages=(stage,)), TwoStage()
        opt = build_optimizer(model, cfg, dims, zero=zero, grad_clip=0.3, log_table=False,
                              norm_exclude=[model.shared] if stage == 1 else [])
        ref_opt = build_optimizer(ref, cfg, ParallelDims(), zero=0, grad_clip=0.3, log_table=False)
        for step, lr in enumerate(LRS):
            batches = [tiny_batch(10 * step + r) for r in range(2)]  # per dp rank, same on both stages
            ntok = sum(b[1].numel() for b in batches)
            (model.loss_sum(stage, *batches[dims.dp_rank]) / ntok).backward()
            dist.all_reduce(model.shared.grad, group=dims.group("pp"))  # what the pipeline runner does
            opt.reduce_chunk_grads([model.shared])
            out = opt.step(lr)
            for s in (0, 1):
                for b in batches:
                    (ref.loss_sum(s, *b) / ntok).backward()
            rout = ref_opt.step(lr)
            # the global norm spans both stages (pp group) and both dp ranks, each parameter once
            assert math.isclose(out["grad_norm"], rout["grad_norm"], rel_tol=1e-5), (out, rout)
            assert rout["grad_norm"] > 0.3
            _assert_params(model, ref, f"pp zero={zero} step={step}")
            opt.zero_grad()
            ref_opt.zero_grad()


def test_zero_pipeline_layout_global_norm():
    run_distributed(_body_pp, 4)


# ---------------------------------------------------------------------------------------------------------------
class ExpertNet(nn.Module):
    """Dense layers + routed-expert weights stacked ``[E, d, f]``; ``experts`` selects the local expert slice."""

    def __init__(self, n_experts=4, d=12, f=6, vocab=32, experts: slice | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.w_in = nn.Parameter(torch.empty(n_experts, d, f))
        self.w_out = nn.Parameter(torch.empty(n_experts, f, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if experts is not None:
                self.w_in = nn.Parameter(self.w_in[experts].clone())
                self.w_out = nn.Parameter(self.w_out[experts].clone())

    def loss_sum(self, tokens, labels, experts: slice = slice(None)):
        x = self.embed_tokens(tokens)
        x = x + self.proj(x).tanh()
        h = torch.einsum("btd,edf->btef", x, self.w_in[experts]).tanh()
        x = x + torch.einsum("btef,efd->btd", h, self.w_out[experts])
        return nn.functional.cross_entropy(self.lm_head(x).flatten(0, 1), labels.flatten(), reduction="sum")


def _body_ep(rank: int, world: int) -> None:
    dims = ParallelDims(dp=4, ep=2, world_size=world, rank=rank).build_groups()
    cfg = _cfg(tau=0.0)
    n_exp, ep = 4, 2
    local = slice(dims.ep_rank * n_exp // ep, (dims.ep_rank + 1) * n_exp // ep)
    group_fn = lambda fqn, p: "edp" if fqn.startswith("w_") else "dp_cp"  # noqa: E731
    for zero in (0, 1, 2):
        model, ref = ExpertNet(n_exp, experts=local), ExpertNet(n_exp)
        opt = build_optimizer(model, cfg, dims, group_fn, zero=zero, grad_clip=0.5, log_table=False)
        ref_opt = build_optimizer(ref, cfg, ParallelDims(), zero=0, grad_clip=0.5, log_table=False)
        for inf in opt.infos:  # expert owners are in this rank's EDP group
            assert inf.owner in dims.ranks("edp" if inf.fqn.startswith("w_") else "dp_cp")
        for step, lr in enumerate(LRS):
            batches = [tiny_batch(7 * step + r) for r in range(world)]
            ntok = sum(b[1].numel() for b in batches)
            (model.loss_sum(*batches[rank]) / ntok).backward()
            out = opt.step(lr)
            for r, b in enumerate(batches):  # rank r's tokens meet the experts of its EP rank (r % ep)
                e = r % ep
                (ref.loss_sum(*b, experts=slice(e * n_exp // ep, (e + 1) * n_exp // ep)) / ntok).backward()
            rout = ref_opt.step(lr)
            assert math.isclose(out["grad_norm"], rout["grad_norm"], rel_tol=1e-5), (out, rout)
            assert rout["grad_norm"] > 0.5
            _assert_params(model, ref, f"ep zero={zero} step={step}", {"w_in": local, "w_out": local})
            opt.zero_grad()
            ref_opt.zero_grad()


def test_zero_expert_parallel_groups():
    run_distributed(_body_ep, 4)
