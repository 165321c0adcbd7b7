"""EAGLE-3 draft training through the real trainer (``train.objective=eagle3``, k3train/draft/): a tiny target is
trained and checkpointed once; then

* one process, 3 draft steps (the reference): every target parameter and buffer (Quantile-Balancing biases) stays
  bit for bit the target checkpoint's, the optimizer holds state for the draft only and the draft moves;
  ``metrics.jsonl`` and the run summary carry ``draft_accept`` / ``draft_accept_len`` on the training batch and the
  validation split;
* pp = 2, dp = 2 and dp = 2 x ep = 2 with MoonEP (two gloo ranks, the layouts in one spawn): per step the loss and
  acceptance (training batch and validation split), the draft's gradients, every parameter and the owned optimizer
  state equal the reference. Every run fine-tunes under MXFP4 / MXFP8 QAT of the routed experts;
* bad targets (preflight, one line each): another model, one without an MTP layer.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from k3train.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from trainer_parity import assert_close_all, max_diffs, owned_grads, parity_cfg  # noqa: E402

STEPS = 3
DATA = ["--data.split=90,10,0", "--train.eval_interval=2", "--train.eval_iters=1"]
# the draft is fine-tuned under MXFP4 / MXFP8 QAT of the routed experts (the frozen target's forward quantized too)
DRAFT = ["--train.objective=eagle3", "--train.draft_feature_blocks=[1,2]", "--train.qat=mxfp4",
         "--train.qat_activations=mxfp8"]
LAYOUTS = [("pp2", ["--parallel.pp=2"]), ("dp2", ["--parallel.dp=2"]),
           ("dp2_ep2_moonep", ["--parallel.dp=2", "--parallel.ep=2", "--parallel.moonep=true"])]
PARAM_ATOL = 1e-5  # parameters: as test_pipeline_zero_parity.py (a wrong gradient moves them by O(lr))
# after step 1 the QAT rounding-boundary effect below reaches the parameters too (measured on an AVX2 host: 1.4e-5
# on 3 of 8192 expert weights at step 3); still far below one Muon update (RMS 0.2 * lr = 6e-4)
PARAM_ATOL_LATER = 1e-4
# gradients / optimizer state. Step 1 starts from identical parameters: element-wise within STEP1_SCALE_TOL of each
# tensor's max |value| (fp32 summation order only). Later steps start from parameters that differ by fp32 noise, and
# under QAT such noise can move an expert weight across an MXFP4 rounding boundary -- a whole quantization step for
# that element (measured: one gradient entry at 5.7e-3 of its tensor's scale at step 3) -- so there each tensor is
# held to ||mine - ref|| <= LATER_REL_TOL ||ref||. The same happens to an MXFP8-rounded expert input: one token's
# activation a step apart changes whole rows of w_down's gradient (measured on the CI host, dp2 ep2 MoonEP step 3:
# 1.35e-3 of the norm, spread over 4 rows of 32). A lost micro-batch or rank moves a gradient by O(its norm).
STEP1_SCALE_TOL, LATER_REL_TOL = 3e-6, 5e-3


def _draft_cfg(out: Path, target: Path, world: int, layout: list[str], extra: list[str] = ()):
    return parity_cfg(out, STEPS, world, [*DATA, *DRAFT, f"--checkpoint.target={target}", *layout, *extra])


def _train(cfg):
    from k3train.trainer import Trainer

    tr = Trainer(cfg)
    try:
        tr.train()
        return {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()}, \
            {n: b.detach().clone() for n, b in tr.pm.model.named_buffers() if n.endswith(".bias")}
    finally:
        tr.close()


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """A tiny target (2 steps, with its MTP layer) and one without an MTP layer (1 step), checkpointed."""
    d = tmp_path_factory.mktemp("eagle3")
    params, biases = _train(parity_cfg(d / "target", 2, 1, DATA))
    _train(parity_cfg(d / "nomtp", 1, 1, [*DATA, "--model.num_nextn_predict_layers=0"]))
    return {"dir": d, "target": d / "target" / "checkpoints" / "step_00000002", "params": params, "biases": biases,
            "nomtp": d / "nomtp" / "checkpoints" / "step_00000001"}


def _snapshot(tr, rec) -> dict:
    return {"params": {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()},
            "optim": {k: v.detach().clone() for k, v in tr.optimizer.state_dict().items()},
            "grads": owned_grads(tr), "rec": rec}


def _run_steps(tr) -> list[dict]:
    """The loop of Trainer.train, with a snapshot after every step."""
    out = []
    for _ in range(STEPS):
        rec = tr.train_step()
        if tr.evaluator.due(tr.step, STEPS):
            rec.update(tr.evaluator.evaluate())
        tr.metrics.log(rec)
        tr.summary.add(rec)
        out.append(_snapshot(tr, rec))
    return out


@pytest.fixture(scope="module")
def reference(targets) -> list[dict]:
    from k3train.trainer import Trainer

    tr = Trainer(_draft_cfg(targets["dir"] / "ref", targets["target"], 1, []))
    try:
        snaps = _run_steps(tr)
        snaps[0]["buffers"] = {n: b.detach().clone() for n, b in tr.pm.model.named_buffers() if n.endswith(".bias")}
        snaps[0]["summary"] = tr.summary.lines(1.0, [0.0], "none")
        quant = tr.pm.model.mtp.ffn.experts.quant
        snaps[0]["qat"] = (quant.weights, quant.inputs)
    finally:
        tr.close()
    return snaps


def test_target_frozen_draft_trained_and_acceptance_logged(targets, reference):
    first, last = reference[0], reference[-1]
    assert first["qat"] == ("mxfp4", "mxfp8")
    draft = {n for n in last["params"] if n.split(".")[0] in ("mtp", "eagle3")}
    assert "eagle3.weight" in draft and len(draft) > 10
    for n, p in last["params"].items():  # the target: exactly the checkpoint's weights after every draft step
        if n not in draft:
            assert torch.equal(p, targets["params"][n]), n
    for n, b in first["buffers"].items():  # QB router biases: the target's unchanged, the draft's own router moves
        if not n.startswith("mtp."):
            assert torch.equal(b, targets["biases"][n]), n
    assert any(not torch.equal(first["buffers"][n], targets["biases"][n]) for n in first["buffers"]
               if n.startswith("mtp."))
    assert all(k.split(".")[0] in ("mtp", "eagle3") for k in last["optim"]) and last["optim"]
    w = last["params"]["eagle3.weight"]
    d = w.shape[0]
    assert float(w[:, :2 * d].abs().max()) > 0  # W_E3 leaves [0 0 I]: it learns to use the low and mid features
    moved = [n for n in draft if n != "eagle3.weight" and not torch.equal(last["params"][n], targets["params"][n])]
    assert len(moved) == len(draft) - 1, sorted(draft - set(moved))
    rows = [json.loads(x) for x in (targets["dir"] / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert len(r["draft_accept"]) == 7 and all(0 < a <= 1 for a in r["draft_accept"])
        assert 0 < r["draft_accept_len"] <= 7 and math.isfinite(r["loss"])
    assert "val_draft_accept" in rows[1] and len(rows[1]["val_draft_accept"]) == 7 and "val_draft_accept_len" in rows[2]
    summary = "\n".join(first["summary"])
    assert "draft acceptance (training batch, step 3)" in summary and "draft acceptance (validation, step 3)" in summary


def _assert_state_close(mine: dict, ref: dict, step: int, what: str) -> None:
    if step == 0:
        assert_close_all(mine, ref, 0.0, 1e-5, what, scale_atol=STEP1_SCALE_TOL)
        return
    for k, v in mine.items():
        err = float((v.double() - ref[k].double()).norm())
        assert err <= LATER_REL_TOL * float(ref[k].double().norm()) + 1e-12, (what, k, err, float(ref[k].norm()))


def _local(mine: dict, ref: dict, ep_rank: int) -> dict:
    """The reference entries of ``mine``'s keys; a routed-expert stack (and its state) sharded by EP: this rank's
    slice of experts ``[ep_rank * n, (ep_rank + 1) * n)``."""
    out = {}
    for k, v in mine.items():
        r = ref[k]
        if v.shape != r.shape and v.dim() == r.dim() and v.shape[1:] == r.shape[1:]:
            r = r[ep_rank * v.shape[0]:(ep_rank + 1) * v.shape[0]]
        out[k] = r
    return out


def _layout_body(rank: int, world: int, ref_path: str, target: str, out: str) -> None:
    from k3train.trainer import Trainer

    refs = torch.load(ref_path)
    for name, layout in LAYOUTS:
        tr = Trainer(_draft_cfg(Path(out) / name, Path(target), world, layout))
        try:
            for step, ref in enumerate(refs):
                rec = tr.train_step()
                if tr.evaluator.due(tr.step, STEPS):
                    rec.update(tr.evaluator.evaluate())
                want = ref["rec"]
                for k in ("loss", "draft_accept_len", "val_loss", "val_draft_accept_len"):
                    if k in want:
                        assert math.isclose(rec[k], want[k], rel_tol=1e-5), (name, step, k, rec[k], want[k])
                for k in ("draft_accept", "val_draft_accept"):
                    if k in want:
                        torch.testing.assert_close(torch.tensor(rec[k]), torch.tensor(want[k]), rtol=1e-5, atol=1e-6)
                assert math.isclose(rec["grad_norm"], want["grad_norm"], rel_tol=1e-5), (name, step)
                ep = tr.dims.ep_rank
                params = {n: p.detach() for n, p in tr.pm.model.named_parameters()}
                assert_close_all(params, _local(params, ref["params"], ep), PARAM_ATOL if step == 0 else
                                 PARAM_ATOL_LATER, 1e-5,
                                 f"{name} rank {rank} step {step + 1}: param")
                mine, state = owned_grads(tr), tr.optimizer.state_dict()
                _assert_state_close(mine, _local(mine, ref["grads"], ep), step,
                                    f"{name} rank {rank} step {step + 1}: grad")
                _assert_state_close(state, _local(state, ref["optim"], ep), step,
                                    f"{name} rank {rank} step {step + 1}: state")
                held = [None] * world
                dist.all_gather_object(held, (sorted(mine), max_diffs(mine, _local(mine, ref["grads"], ep))[1]))
                if rank == 0:  # the ranks' owned gradients together are the reference's draft gradients
                    assert set().union(*(set(h[0]) for h in held)) == set(ref["grads"]), name
        finally:
            tr.metrics.close()


def test_pp2_and_dp2_draft_training_equal_one_process(targets, reference, tmp_path):
    torch.save(reference, tmp_path / "ref.pt")
    assert all(s["grads"] for s in reference)
    run_distributed(_layout_body, 2, str(tmp_path / "ref.pt"), str(targets["target"]), str(tmp_path))


def test_bad_targets_are_one_preflight_line_each(targets, tmp_path):
    from k3train.preflight import preflight

    cases = [(targets["nomtp"], [], "has no MTP layer"),
             (targets["target"], ["--model.routed_expert_hidden_size=64"], "is a checkpoint of another model: "
                                                                            "model.routed_expert_hidden_size 32 -> 64"),
             (tmp_path / "nowhere", [], "does not exist"),
             (targets["target"].parent, [], "is not a complete checkpoint")]
    for path, extra, needle in cases:
        cfg = _draft_cfg(tmp_path / "bad", path, 1, [], extra)
        with pytest.raises(ConfigError) as e:
            preflight(cfg)
        line = str(e.value)
        assert line.startswith("checkpoint.target: ") and needle in line and "\n" not in line, line
