"""A tiny K3Model (configs/tiny.yaml: KDA + MLA, dense first layer, 7 LatentMoE layers, MTP) under dp=2 x ep=2
with MoonEP vs the single-process model on the same global batch: loss sums, every gradient, name-seeded init of
the expert shards, and the QB bias after one step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from k3train.config.presets import tiny_model_config
from k3train.data.batch import Batch
from k3train.model import K3Model
from moonep import apply_expert_parallel, collect_moonep_metrics, param_reduce_group, sync_router_balance
from parallel.dims import ParallelDims

B, T = 1, 16


def _batch(seed: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(3, vocab, (B, T + 1), generator=g)
    s[:, 5] = 1
    return Batch.from_samples(s, eos_id=1)


def _loss(model: K3Model, batch: Batch, n_tokens: float) -> torch.Tensor:
    out = model(batch)
    return out["lm_loss_sum"] / n_tokens + 0.3 * out["mtp_loss_sum"] / n_tokens


def _body(rank: int, ws: int) -> None:
    cfg = tiny_model_config()
    dims = ParallelDims(dp=ws, ep=ws, world_size=ws, rank=rank).build_groups()
    batches = [_batch(s, cfg.vocab_size) for s in range(ws)]
    n_tok = float(sum(b.loss_mask.sum() for b in batches))

    ref = K3Model(cfg)
    ref.init_weights(7)
    ref.train()
    ref_total = sum(_loss(ref, b, n_tok) for b in batches)
    ref_total.backward()

    model = K3Model(cfg)
    apply_expert_parallel(model, dims, moonep=True)
    model.init_weights(7)  # name-seeded per global expert: the shards equal slices of the full stacks
    model.train()
    ref_p = dict(ref.named_parameters())
    loss = _loss(model, batches[rank], n_tok)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_total.detach(), atol=1e-5, rtol=1e-5)

    for name, p in model.named_parameters():
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        group = param_reduce_group(name, p, dims)
        if group is not None:
            dist.all_reduce(grad, group=group)
        want, want_p = ref_p[name].grad, ref_p[name].detach()
        if getattr(p, "_k3_expert_parallel", False):
            n = p.shape[0]
            want = want[rank * n:(rank + 1) * n]
            want_p = want_p[rank * n:(rank + 1) * n]
        assert torch.equal(p.detach(), want_p), name
        if want is None:
            want = torch.zeros_like(p)
        torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-4, msg=name)

    m = collect_moonep_metrics(model)
    assert m["moonep/worst_max_over_mean_after"] == 1.0
    assert m["moonep/worst_max_over_mean_before"] > 1.0 and m["moonep/replicas"] > 0  # MoonEP did work
    # QB: the global batch's statistics -> the same bias as the single process (histogram estimator: exact)
    sync_router_balance(model, dims)
    ref_routers = dict(ref.routers())
    for name, r in model.routers():
        ref_routers[name].balance_step()
        assert torch.equal(r.bias, ref_routers[name].bias) and r.bias.abs().max() > 0, name


def test_tiny_model_dp2_ep2_moonep() -> None:
    run_distributed(_body, 2)
