"""Composed parallel layouts through the trainer's real path (``k3train.parallelize.parallelize``) equal the
single-process K3Model on the same global batch of real KJV tokens: one step's loss, EVERY parameter gradient and
the routers' Quantile-Balancing step.

Per layout (world size 4; all layouts run in ONE spawn of 4 gloo ranks, each rebuilding its ParallelDims groups):

* every rank builds its part with ``parallelize(cfg, dims, cpu)`` (meta-built pipeline stage, name-seeded init,
  expert sharding + dispatcher, KCP contexts) and checks its initial parameters are the reference's (expert shards
  = slices of the full stacks);
* it runs ``ParallelModel.forward_backward`` on its micro-batches, cut exactly as ``GlobalBatchLoader`` cuts them
  (rows by dp rank, micro-batches of 1 row, contiguous CP segment), with the trainer's global ``LossNorm``;
* the summed loss statistics over all ranks equal the reference's;
* gradients are reduced as the optimizer would (SUM over ``dp_cp`` for dense parameters, over ``edp`` for routed
  experts; the runner has already summed the last stage's MTP-shared embedding copy over ``embd``), routed-expert
  shards are all-gathered over ``ep`` (``gather_full_experts``), and every parameter a rank holds is compared by
  FQN with the reference gradient (fp32, atol 1e-5, rtol 1e-4); the union over ranks covers every parameter;
* QB: the routers' per-step statistics summed over ``dp_cp`` equal the reference's (expert loads exactly: the
  same top-k choices; the integer histograms up to one score moved by rounding), and after
  ``ParallelModel.sync_router_balance()`` every rank's router bias is within one histogram bin of the
  single-process ``balance_step()`` bias and identical on every rank holding that router; with EP, MoonEP made
  replicas and balanced the per-rank load exactly (static EP made none).

The single-process reference is computed once in the pytest process and shipped to the ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from composed_cases import (WORLD, Layout, Reference, crosses_cp_boundary, kjv_global_batch, loss_norm,
                                        make_cfg, rank_micro_batches, reference)

ATOL, RTOL = 1e-5, 1e-4

LAYOUTS = [
    # 4 micro-batches per pipeline (dp = 1): interleaved 1F1B with 2 virtual stages per rank; KCP inside stages
    Layout("pp2_vpp2_cp2", pp=2, vpp=2, cp=2),
    # dp = 2 -> 2 micro-batches per pipeline; experts sharded over the two data-parallel ranks of each stage
    Layout("pp2_vpp2_dp2_ep2_moonep", pp=2, vpp=2, ep=2, moonep=True),
    Layout("pp2_dp2_ep2_static", pp=2, vpp=1, ep=2, moonep=False),
    # dp = 2 x cp = 2 x ep = 2: each EP group is one CP pair, the EDP group joins the two data-parallel replicas
    Layout("dp2_cp2_ep2_moonep", cp=2, ep=2, moonep=True),
    # the standard PreNorm residual (model.residual ablation) through PP x KCP x MoonEP at once
    Layout("standard_pp2_vpp2_cp2_ep2_moonep", pp=2, vpp=2, cp=2, ep=2, moonep=True, variant="standard"),
    # the Kimi Linear variants (k3train/hf: SwiGLU, no latent MoE, grouped top-k, low-rank KDA gate, MLA without
    # q_lora / output gate, softplus decay, standard residual) through PP x KCP x MoonEP and DP x KCP x MoonEP
    Layout("kimi_linear_pp2_vpp2_cp2_ep2_moonep", pp=2, vpp=2, cp=2, ep=2, moonep=True, variant="kimi_linear"),
    Layout("kimi_linear_dp2_cp2_ep2_moonep", cp=2, ep=2, moonep=True, variant="kimi_linear"),
]


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _check_layout(rank: int, layout: Layout, full, ref: Reference) -> None:
    from k3train.model.moe import GroupedExperts, LatentMoE
    from k3train.parallelize import parallelize
    from moonep import EPDispatcher, gather_full_experts, is_expert_param
    from parallel.dims import ParallelDims

    cfg = make_cfg(layout)
    dims = ParallelDims.from_config(cfg.parallel, WORLD, rank).build_groups()
    assert (dims.pp, dims.cp, dims.ep) == (layout.pp, layout.cp, layout.ep)
    pm = parallelize(cfg, dims, torch.device("cpu"))
    model = pm.model
    E = cfg.model.num_experts

    # --- the composition is what the layout says ------------------------------------------------------------
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    assert moes, "every stage of these layouts holds MoE layers"
    for moe in moes:
        assert moe.experts.w_gate.shape[0] == E // dims.ep
        if dims.ep > 1:
            assert isinstance(moe.dispatcher, EPDispatcher) and moe.dispatcher.moonep == layout.moonep
    assert len(pm.runner.chunks) == layout.vpp
    if dims.pp > 1 and dims.is_last_stage:
        assert pm.runner.replica_params and model.embed_tokens is not None  # the MTP's embedding copy

    # --- initial values: name-seeded init through meta build, pruning and expert sharding --------------------
    for name, p in model.named_parameters():
        want = ref.params[name]
        if is_expert_param(p) and dims.ep > 1:
            n = p.shape[0]
            want = want[dims.ep_rank * n:(dims.ep_rank + 1) * n]
        assert torch.equal(p.detach(), want), f"initial value of {name}"

    # --- one step, micro-batches cut as the loader cuts them -------------------------------------------------
    micro = rank_micro_batches(full, dims.dp, dims.dp_rank, dims.cp, dims.cp_rank)
    assert len(micro) == cfg.train.grad_accum_steps
    stats = pm.forward_backward(micro, loss_norm(cfg, full))

    tot = torch.tensor([stats["loss"], stats["lm_loss_sum"], stats["mtp_loss_sum"]], dtype=torch.float64)
    dist.all_reduce(tot)  # loss sums live on the last stage of every (dp, cp) pipeline
    want = torch.tensor([ref.stats["loss"], ref.stats["lm_loss_sum"], ref.stats["mtp_loss_sum"]],
                        dtype=torch.float64)
    torch.testing.assert_close(tot, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"loss sums: {m}")

    # --- the optimizer's gradient reduction, by hand --------------------------------------------------------
    for name, p in model.named_parameters():
        group = dims.group("edp") if is_expert_param(p) else dims.group("dp_cp")
        if group is not None:
            dist.all_reduce(_grad(p), group=group)

    checked: list[str] = []

    def compare(name: str, got: torch.Tensor) -> None:
        torch.testing.assert_close(got, ref.grads[name], atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"grad of {name}: {m}")
        checked.append(name)

    expert_names = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            full_grads = gather_full_experts(mod, dims, grads=True)  # collective over ep (same stage)
            for pname, g in zip(("w_gate", "w_up", "w_down"), full_grads):
                assert g.shape[0] == E
                compare(f"{mname}.{pname}", g)
                expert_names.add(f"{mname}.{pname}")
    for name, p in model.named_parameters():
        if name not in expert_names:
            compare(name, _grad(p))

    # every parameter of the full model is owned (and checked) by some rank
    owned: list[list[str]] = [[] for _ in range(WORLD)]
    dist.all_gather_object(owned, checked)
    missing = set(ref.grads) - {n for names in owned for n in names}
    assert not missing, f"parameters checked by no rank: {sorted(missing)}"

    # --- Quantile Balancing ---------------------------------------------------------------------------------
    routers = [(n, r) for mod in pm.modules for n, r in mod.routers()]
    for name, r in routers:  # the step's statistics summed over all token-routing ranks of this stage
        loads, hist = r.expert_loads.clone(), r.qb_hist.clone()
        if dims.group("dp_cp") is not None:
            dist.all_reduce(loads, group=dims.group("dp_cp"))
            dist.all_reduce(hist, group=dims.group("dp_cp"))
        assert torch.equal(loads, ref.loads[name]), f"{name}: expert loads {loads} != {ref.loads[name]}"
        # integer histograms of alpha - s: at most one score may land in another bin through rounding
        moved = int((hist - ref.hist[name]).abs().sum())
        assert hist.sum() == ref.hist[name].sum() and moved <= 2, f"{name}: QB histogram differs by {moved}"
    worst, totals = pm.sync_router_balance()
    assert "moe_maxvio" in worst
    if dims.ep > 1:  # MoonEP replicated hot experts and balanced every rank's routes exactly; static EP did not
        if layout.moonep:
            assert totals["ep_replicas"] > 0 and worst["ep_load_max_over_mean_after"] == 1.0, (worst, totals)
        else:
            assert totals["ep_replicas"] == 0, (worst, totals)
    mine = {}
    for name, r in routers:
        diff = (r.bias - ref.bias[name]).abs().max().item()
        assert diff <= ref.bin_width[name] * (1 + 1e-6), f"{name}: bias off by {diff} > one bin"
        assert r.bias.abs().max() > 0, f"{name}: QB did not move the bias"
        mine[name] = r.bias.clone()
    every: list[dict] = [{} for _ in range(WORLD)]
    dist.all_gather_object(every, mine)
    for name, b in mine.items():
        for other in every:
            if name in other:
                assert torch.equal(other[name], b), f"{name}: bias differs across ranks"
    assert {n for d in every for n in d} == set(ref.bias), "every router is held by some rank"


def _body(rank: int, world: int, layouts: list[Layout], full, refs: dict[str, Reference]) -> None:
    torch.set_num_threads(1)
    for layout in layouts:
        try:
            _check_layout(rank, layout, full, refs[layout.variant])
        except Exception as e:
            raise AssertionError(f"layout {layout.name}: {e}") from e


@pytest.fixture(scope="module")
def data_and_ref():
    full = kjv_global_batch()
    assert crosses_cp_boundary(full, 2), "the batch must have documents crossing the CP boundary"
    assert int(full.doc_ids.max()) >= 1 and bool((full.tokens == 1).any()), "several documents per row"
    return full, {v: reference(make_cfg(variant=v), full) for v in {lay.variant for lay in LAYOUTS}}


def test_composed_layouts_match_single_process(data_and_ref) -> None:
    """pp2 x vpp2 x cp2; pp2 x dp2 x ep2 (MoonEP, vpp2) and (static EP, vpp1); dp2 x cp2 x ep2 (MoonEP); and
    pp2 x vpp2 x cp2 x ep2 (MoonEP) with the standard residual; the Kimi Linear model variants in pp2 x vpp2 x cp2
    x ep2 and dp2 x cp2 x ep2 (MoonEP)."""
    full, refs = data_and_ref
    run_distributed(_body, WORLD, LAYOUTS, full, refs)
