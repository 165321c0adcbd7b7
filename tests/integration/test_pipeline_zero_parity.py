"""pp = 2 x dp = 2 (and vpp = 2) with ZeRO-2 / ZeRO-1: parameters AND optimizer state equal the single-process
run's after EVERY step, through the real trainer step (``Trainer.train_step``: pipeline runner, Pipeline ZeRO-2
``reduce_chunk_grads`` as each chunk finishes its backward, Per-Head Muon + AdamW, grad clipping, QK-Clip,
Quantile Balancing, lr schedule).

Four gloo ranks, all layouts in one spawn. After every step each rank compares
* every parameter it holds (its pruned stage by full FQN, incl. the last stage's MTP copy of the embedding);
* every optimizer-state entry it OWNS (Muon ``momentum_buffer``; AdamW ``exp_avg``, ``exp_avg_sq``, ``step``)
with the single-process snapshot; rank 0 checks the owners tile the state (each entry on exactly one rank of a
stage's data-parallel group; across stages only the shared embedding's replica) and every parameter is held.
ZeRO-2 is checked to have happened inside the pipeline: every optimised parameter went through the chunk hook
before ``step``, and right after its chunk's hook a non-owner holds no gradient for it.

Negative control: the same layout with the hook fired after a chunk's FIRST micro-batch backward instead of its
last (premature gradient sharding: the other rank's later micro-batches never reach the owner) must fail the
comparison by orders of magnitude -- so the tolerance above is tight enough to see a broken sharding.

Tolerances (measured values in the report of the change that added this test): parameters atol 1e-5 + rtol 1e-5
(ill-conditioned AdamW entries: 1e-3, see below); gradients and optimizer state 3e-6 (step 1) / 1e-4 (later
steps) of each tensor's max |value|; AdamW step counts exactly; loss and grad norm rel 1e-5.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from trainer_parity import assert_close_all, max_diffs, owned_grads, parity_cfg, reference_run

WORLD, STEPS = 4, 3
STATE_KINDS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "step")
ATOL, RTOL = 1e-5, 1e-5  # parameters (and rtol everywhere)
# Ill-conditioned AdamW entries. The update lr * m_hat / (sqrt(v_hat) + eps) has gain lr * eps / (sqrt(v_hat)
# + eps)^2 in g: up to lr / (4 eps) = 7.5e4 at the default eps 1e-8. Embedding rows get sparse, small gradients
# (tokens seen once or twice), some of them near-cancellations of ~3e-8, where fp32 summation-order noise (1e-7
# of the tensor's scale) becomes a 3e-5..2e-4 parameter difference (measured: single entries, vpp = 2).
# Entries whose reference sqrt(v_hat) is positive but below 100 eps (gradient RMS < 1e-6, gain > 30; ~2e3-5e4
# entries, almost all in the embedding) are held to ILL_ATOL (1/3 of one step's lr) and counted; every other
# parameter entry to ATOL. A sharding bug moves well-conditioned entries by O(lr) and corrupts the moments
# (checked relative to each tensor's scale), so it cannot hide in the ill-conditioned set.
ILL_SQRT_V_OVER_EPS, ILL_ATOL = 100.0, 1e-3
# gradients and optimizer state, relative to each tensor's scale: |diff| <= tol * max|ref| + RTOL * |ref|.
# Step 1 starts from identical parameters (measured <= 4e-7); later steps carry step 1's fp32 noise through the
# forward (small KDA decay vectors such as A_log, whose gradients are cancellations, reach 1.7e-5).
SCALE_TOL = {0: 3e-6, "later": 1e-4}
REPORT = ("grads", *STATE_KINDS)
# (name, layout overrides, zero); dp = 4 / pp = 2, GBS 4 -> 2 micro-batches per pipeline
LAYOUTS = [
    ("pp2_dp2_zero2", ["--parallel.pp=2"], 2),
    ("pp2_vpp2_dp2_zero2", ["--parallel.pp=2", "--parallel.vpp=2"], 2),
    ("pp2_dp2_zero1", ["--parallel.pp=2"], 1),
]


def _kind(key: str) -> str:
    return next(k for k in STATE_KINDS if key.endswith("." + k))


def _watch_zero2(tr, rank: int) -> set[int]:
    """Wrap the runner's chunk hook (the optimizer's ``reduce_chunk_grads``): record which parameters went
    through it and check a non-owner's gradient is gone right after. Returns the (live) set of hooked ids."""
    opt, runner = tr.optimizer, tr.pm.runner
    real = runner.on_chunk_backward_done
    assert real == opt.reduce_chunk_grads, "zero=2: the trainer installs reduce_chunk_grads as the chunk hook"
    owner = {id(i.param): i.owner for i in opt.infos}
    hooked: set[int] = set()

    def hook(params):
        real(params)
        for p in params:
            hooked.add(id(p))
            if id(p) in owner and owner[id(p)] != rank:
                assert p.grad is None, "ZeRO-2: a non-owner kept a gradient after its chunk was reduced"

    runner.on_chunk_backward_done = hook
    return hooked


def _fire_hook_early(tr) -> None:
    """Negative control: reduce each chunk's gradients after its FIRST micro-batch backward (a broken runner)."""
    opt, runner = tr.optimizer, tr.pm.runner
    runner.on_chunk_backward_done = None  # whatever is left is reduced by step()
    real_run, fired = runner.run_instr, set()

    def run_instr(ins):
        real_run(ins)
        if ins.op == "compute" and ins.action.kind == "B" and ins.action.chunk not in fired:
            fired.add(ins.action.chunk)
            opt.reduce_chunk_grads(list(runner.chunk_params[ins.action.chunk]))

    runner.run_instr = run_instr


def _param_diffs(params: dict, ref: dict, ocfg, what: str, check: bool) -> tuple[float, float, int]:
    """Parameters against the reference: ``(max |diff| over well-conditioned entries, max |diff| over
    ill-conditioned AdamW entries, their count)``; with ``check``, every entry within its tolerance."""
    well, ill_max, ill_count = 0.0, 0.0, 0
    for k, v in params.items():
        want = ref["params"][k]
        assert want.shape == v.shape, f"{what} {k}: shape {tuple(v.shape)} != {tuple(want.shape)}"
        d = (v - want).abs()
        ill = torch.zeros_like(d, dtype=torch.bool)
        if k + ".exp_avg_sq" in ref["optim"]:  # AdamW entry
            t = float(ref["optim"][k + ".step"])
            sqrt_v = (ref["optim"][k + ".exp_avg_sq"] / (1 - ocfg.adam_beta2 ** t)).sqrt()
            ill = (sqrt_v > 0) & (sqrt_v < ILL_SQRT_V_OVER_EPS * ocfg.adam_eps)
        tol = torch.where(ill, torch.full_like(d, ILL_ATOL), ATOL + RTOL * want.abs())
        if check:
            bad = d > tol
            assert not bool(bad.any()), (f"{what} {k}: {int(bad.sum())} entries off, max |diff| "
                                         f"{float(d[bad].max()):.3e} (ill-conditioned: {int((bad & ill).sum())})")
        if v.numel():
            well = max(well, float(d[~ill].max()) if bool((~ill).any()) else 0.0)
            ill_max = max(ill_max, float(d[ill].max()) if bool(ill.any()) else 0.0)
            ill_count += int(ill.sum())
    return well, ill_max, ill_count


def _step_diffs(tr, rec, ref, rank: int, step: int, check: bool) -> dict:
    """This rank's max |diff| against the reference step (absolute, and ``*_rel``: relative to each tensor's
    max |value|) for parameters, owned gradients and each optimizer-state kind; loss and grad norm."""
    params = {n: p.detach() for n, p in tr.pm.model.named_parameters()}
    state = tr.optimizer.state_dict()
    groups = {"grads": (owned_grads(tr), ref["grads"])}
    for kind in STATE_KINDS:
        groups[kind] = ({k: v for k, v in state.items() if _kind(k) == kind}, ref["optim"])
    out = {"loss": abs(rec["loss"] - ref["loss"]), "grad_norm": abs(rec["grad_norm"] - ref["grad_norm"]),
           "param_names": sorted(params), "state_keys": sorted(state), "pp_rank": tr.dims.pp_rank}
    for name, (mine, want) in groups.items():
        out[name], out[name + "_rel"] = max_diffs(mine, want)
    out["params"], out["params_ill"], out["ill_entries"] = _param_diffs(
        params, ref, tr.cfg.optim, f"rank {rank} step {step + 1}: parameter", check)
    if check:
        tol = SCALE_TOL.get(step, SCALE_TOL["later"])
        for name in ("grads", *STATE_KINDS):
            assert_close_all(*groups[name], 0.0, RTOL, f"rank {rank} step {step + 1}: {name}", scale_atol=tol)
        for k, v in groups["step"][0].items():
            assert torch.equal(v, ref["optim"][k]), f"rank {rank}: {k} = {v} != {ref['optim'][k]}"
        assert math.isclose(rec["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-6), (rec["loss"], ref["loss"])
        assert math.isclose(rec["grad_norm"], ref["grad_norm"], rel_tol=1e-5), (rec["grad_norm"], ref["grad_norm"])
    return out


def _check_ownership(per_rank: list[dict], ref, zero: int) -> None:
    """Rank 0: the ranks' parameters cover the model, their owned state entries tile the reference state."""
    assert set().union(*(d["param_names"] for d in per_rank)) == set(ref["params"]), "parameters held by no rank"
    assert set().union(*(d["state_keys"] for d in per_rank)) == set(ref["optim"]), "state entries owned by no rank"
    for i, a in enumerate(per_rank):
        for b in per_rank[i + 1:]:
            both = set(a["state_keys"]) & set(b["state_keys"])
            if a["pp_rank"] == b["pp_rank"]:  # one data-parallel group: ZeRO gives every entry one owner
                assert zero == 0 or not both, f"entries owned twice in one dp group: {sorted(both)[:3]}"
            else:  # different stages share only the MTP-shared embedding (first stage + last stage's replica)
                assert all(k.startswith("embed_tokens.") for k in both), sorted(both)[:3]


def _run_layout(rank: int, name: str, layout: list[str], zero: int, steps: int, refs, out: Path,
                negative: bool = False) -> dict:
    from k3train.trainer import Trainer

    tr = Trainer(parity_cfg(out / name, STEPS, WORLD, layout + [f"--parallel.zero={zero}"]))
    assert (tr.dims.pp, tr.dims.dp, tr.optimizer.zero) == (2, 2, zero)
    hooked = _watch_zero2(tr, rank) if zero == 2 and not negative else None
    if negative:
        _fire_hook_early(tr)
    report = []
    for s in range(steps):
        rec = tr.train_step()
        if hooked is not None:
            assert hooked == {id(i.param) for i in tr.optimizer.infos}, "parameters not sharded by the chunk hook"
            hooked.clear()
        mine = _step_diffs(tr, rec, refs[s], rank, s, check=not negative)
        every = [None] * WORLD
        dist.all_gather_object(every, mine)
        if rank == 0:
            _check_ownership(every, refs[s], zero)
            keys = ["params", "params_ill", "ill_entries"] + [k for n in REPORT for k in (n, n + "_rel")]
            keys += ["loss", "grad_norm"]
            report.append({k: max(d[k] for d in every) for k in keys})
    tr.metrics.close()
    return {"layout": name, "zero": zero, "negative": negative, "steps": report}


def _body(rank: int, world: int, ref_path: str, out: str) -> None:
    refs = torch.load(ref_path)
    results = [_run_layout(rank, name, layout, zero, STEPS, refs, Path(out)) for name, layout, zero in LAYOUTS]
    results.append(_run_layout(rank, "negative_early_hook", ["--parallel.pp=2"], 2, 1, refs, Path(out),
                               negative=True))
    if rank == 0:
        (Path(out) / "parity.json").write_text(json.dumps(results, indent=1))


def test_pp2_dp2_zero_params_and_state_match_single_process(tmp_path: Path) -> None:
    refs = reference_run(tmp_path / "ref", STEPS)
    assert all(r["optim"] for r in refs) and refs[0]["grad_norm"] > 0
    torch.save(refs, tmp_path / "ref.pt")
    run_distributed(_body, WORLD, str(tmp_path / "ref.pt"), str(tmp_path), timeout=600)
    results = json.loads((tmp_path / "parity.json").read_text())
    for r in results:
        print(f"{r['layout']} zero={r['zero']}", *(f"step{i + 1}: " + " ".join(f"{k}={v:.2e}" for k, v in s.items())
                                                  for i, s in enumerate(r["steps"])), sep="\n  ")
    neg = results[-1]["steps"][0]
    # the broken sharding is caught: the state misses whole micro-batches' gradients
    assert neg["momentum_buffer_rel"] > 1e3 * SCALE_TOL[0] and neg["params"] > 100 * ATOL, neg
