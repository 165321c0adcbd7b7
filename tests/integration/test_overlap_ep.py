"""``parallel.overlap_ep`` (F/B pairing, parallel/pairing.py) through the real trainer step at dp = 2 x ep = 2,
three micro-batches per rank (two paired actions per step): overlap on vs off gives bit-identical per-step
losses and grad norms, every parameter gradient after every step, and every parameter and optimizer-state entry
after 3 steps -- with MoonEP, without it, and with activation recomputation; and at cp = 2 x ep = 2 (the KCP
and MLA-CP exchanges of the two sides on ``cp`` and ``cp_pair``, every group's collectives identical across its
ranks). The same at pp = 2 x vpp = 2 x dp = 2
x ep = 2 (MoonEP, ZeRO-2: the chunk hooks after a pair), four micro-batches: the interleaved schedule's adjacent
F/B computes paired (p2p_programs.pair_programs), the collectives of every group (``ep`` and ``ep_pair`` apart)
identical across its ranks.

Then a forced failure inside one side of a pair (``K3TRAIN_FAULT_RAISE``, k3train/runtime/fault_injection.py) on every
rank: the step ends with one :class:`PairedActionError` naming the failed side on each rank, no hang; the ranks
are still in step afterwards (a barrier, then a normal step completes).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from trainer_parity import parity_cfg

WORLD, STEPS = 2, 3
EP = ["--parallel.ep=2", "--train.global_batch_size=6"]  # dp 2 (auto), 3 micro-batches per rank
CP_EP = ["--parallel.cp=2", "--parallel.ep=2", "--train.global_batch_size=3"]  # dp 1, 3 micro-batches
VARIANTS = [("moonep", []), ("no_moonep", ["--parallel.moonep=false"]), ("moonep_recompute",
                                                                         ["--parallel.recompute=true"])]


def _run(out: Path, layout: list[str], overlap: bool, keep: bool = False, world: int = WORLD, ep: list = EP):
    from k3train.trainer import Trainer

    tr = Trainer(parity_cfg(out, STEPS, world, ep + layout + [f"--parallel.overlap_ep={str(overlap).lower()}"]))
    assert (tr.pm.runner.pair is not None) == overlap
    steps = []
    for _ in range(STEPS):
        rec = tr.train_step()
        grads = {n: p.grad.clone() for n, p in tr.pm.model.named_parameters() if p.grad is not None}
        steps.append((rec["loss"], rec["grad_norm"], grads))
    params = {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()}
    state = {k: v.detach().clone() for k, v in tr.optimizer.state_dict().items()}
    if overlap:  # side 1 did the paired forwards' dispatches
        assert tr.pm.ep_state.pair_side.buffers.nbytes() > 0
    if keep:
        return tr, steps, params, state
    tr.close(destroy_groups=False)
    return None, steps, params, state


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different entries"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what} {k}: max |diff| {float((a[k] - b[k]).abs().max()):.3e}"


def _fails(tr, spec: str, side: str) -> None:
    from parallel.pairing import PairedActionError

    os.environ["K3TRAIN_FAULT_RAISE"] = spec
    try:
        with pytest.raises(PairedActionError) as err:
            tr.train_step()
    finally:
        del os.environ["K3TRAIN_FAULT_RAISE"]
    msg = str(err.value)
    assert f"rank {dist.get_rank()}: parallel.overlap_ep paired action failed: the {side} raised InjectedFault" \
        in msg and "which completed" in msg, msg
    dist.barrier()  # no rank hangs, and every group is still in step


def _compare(name: str, off: tuple, on: tuple) -> None:
    (_, off_steps, off_params, off_state), (_, on_steps, on_params, on_state) = off, on
    for s, ((l0, n0, g0), (l1, n1, g1)) in enumerate(zip(off_steps, on_steps)):
        assert (l0, n0) == (l1, n1), f"{name} step {s + 1}: loss/grad norm {(l0, n0)} vs {(l1, n1)}"
        _same(g0, g1, f"{name} step {s + 1} gradient")
    _same(off_params, on_params, f"{name} parameter")
    _same(off_state, on_state, f"{name} optimizer state")


def _cp_variant(out: Path, rank: int) -> None:
    """cp 2 x ep 2 (dp 1, MoonEP, 3 micro-batches): the paired forward's KCP / MLA-CP exchanges (built in its
    context on side 1) on ``cp_pair``, its backward's later on ``cp`` (SidedGroup), bit-identical to unpaired."""
    from collective_trace import assert_collectives_match, trace_collectives

    off = _run(out / "cp_off", [], False, ep=CP_EP)
    with trace_collectives() as trace:
        on = _run(out / "cp_on", [], True, ep=CP_EP)
    everyone = assert_collectives_match(trace)
    descs = {e.desc for e in everyone[rank]}
    assert {"cp", "cp_pair", "ep", "ep_pair"} <= descs, descs
    _compare("cp2 ep2", off, on)


def _body(rank: int, world: int, out: str) -> None:
    _cp_variant(Path(out), rank)
    for name, layout in VARIANTS:
        keep = name == VARIANTS[-1][0]
        off = _run(Path(out) / f"{name}_off", layout, False)
        on = _run(Path(out) / f"{name}_on", layout, True, keep=keep)
        _compare(name, off, on)
        tr = on[0]
    # forced failures inside one side of a pair, on every rank
    _fails(tr, "pair_forward:1", "forward of micro-batch 1")
    _fails(tr, "pair_backward:1", "backward of micro-batch 1")
    rec = tr.train_step()  # the next step runs normally
    assert torch.isfinite(torch.tensor(rec["loss"]))
    tr.close(destroy_groups=False)


def test_overlap_ep_bit_identical_and_fails_cleanly(tmp_path: Path) -> None:
    run_distributed(_body, WORLD, str(tmp_path))


PP_EP = ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.ep=2", "--parallel.zero=2",
         "--train.global_batch_size=8"]  # dp 2, 4 micro-batches per pipeline


def _pp_body(rank: int, world: int, out: str) -> None:
    from collective_trace import assert_collectives_match, trace_collectives

    import threading

    from parallel.pipeline.p2p import P2PTransport

    _, off_steps, off_params, off_state = _run(Path(out) / "pp_off", [], False, world=world, ep=PP_EP)
    posted, send = [], P2PTransport.send  # (message, posting thread) of every send

    def traced_send(self, msg, *args, **kw):  # noqa: ANN001, ANN202
        posted.append((msg, threading.current_thread().name))
        return send(self, msg, *args, **kw)

    P2PTransport.send = traced_send
    try:
        with trace_collectives() as trace:
            tr, on_steps, on_params, on_state = _run(Path(out) / "pp_on", [], True, keep=True, world=world,
                                                     ep=PP_EP)
    finally:
        P2PTransport.send = send
    everyone = assert_collectives_match(trace)
    assert any(e.desc == "ep_pair" for e in everyone[rank]), "no collective on the pair side"
    runner = tr.pm.runner
    firsts = runner._pair_firsts
    assert firsts and all(len(f) >= 2 for f in firsts.values()), firsts  # steady-state pairs on every rank
    # a pair's first compute posts its trailing sends from its own thread, as soon as it is done: those of a
    # paired forward from the pair worker (the stage waiting for that output does not wait for the backward)
    (key, fi), = firsts.items()
    prog = runner._programs[key][1]
    expect = {p.msg for i, ins in enumerate(prog) if ins.op == "compute" and ins.action.kind == "F"
              and ins.action in fi for p in prog[i + 2:i + 2 + fi[ins.action]] if p.op == "send"}
    assert {m for m, th in posted if th == "k3train-pair-worker"} == expect
    assert expect or runner.pp_rank == 1, "pipeline rank 0 pairs F first (interleaved pp 2 x vpp 2)"
    for s, ((l0, n0, g0), (l1, n1, g1)) in enumerate(zip(off_steps, on_steps)):
        assert (l0, n0) == (l1, n1), f"pp step {s + 1}: loss/grad norm {(l0, n0)} vs {(l1, n1)}"
        _same(g0, g1, f"pp step {s + 1} gradient")
    _same(off_params, on_params, "pp parameter")
    _same(off_state, on_state, "pp optimizer state")
    tr.close(destroy_groups=False)


def test_overlap_ep_pipeline_bit_identical(tmp_path: Path) -> None:
    run_distributed(_pp_body, 4, str(tmp_path))
