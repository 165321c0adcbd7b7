"""The vision encoder's own pipeline actions (``parallel.encoder_schedule``): the placement as pure data
(schedules.place_encoder: every EF before its F(0, m), every EB after its B(0, m), the F/B order and every rank
pair's p2p sequence unchanged, bubbles never slower than before), and the runner with them against the
single-process model -- loss and EVERY gradient, encoder included, all pipeline ranks driven in one process."""
from __future__ import annotations

import random

import pytest
import torch

from k3train.config import ConfigError
from k3train.config.presets import tiny_pipeline_config as tiny_cfg
from k3train.data.batch import Batch
from k3train.model.media import MediaInputs
from parallel.pipeline.p2p import build_programs, check_programs, run_programs
from parallel.pipeline.schedules import (Action, build_schedule, forward_only_schedule, place_encoder, simulate,
                                         strip_encoder, validate_schedule)
from pipeline_harness import assert_grads_match, in_process_pipeline, reference

CASES = [("1f1b", 2, 1, 2), ("1f1b", 2, 1, 5), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 2), ("interleaved", 2, 2, 4),
         ("interleaved", 4, 2, 8), ("interleaved", 3, 3, 6), ("afab", 2, 2, 3)]


def _costs(pp: int, vpp: int, M: int, seed: int):
    rnd = random.Random(seed)
    f = [rnd.uniform(0.5, 1.5) / vpp for _ in range(pp * vpp)]
    ef = [rnd.choice([0.0, 0.1, 0.4, 1.0, 2.5]) for _ in range(M)]  # 0: a micro-batch without media
    return f, [2 * x for x in f], ef, [2 * x for x in ef]


def _inline_span(base, pp, vpp, f, b, ef, eb) -> float:
    """Makespan with the encoder inside F(0, m) / B(0, m): each EF right before, each EB right after."""
    out = []
    for a in base[0]:
        out += [Action("EF", 0, a.mb)] if (a.kind, a.chunk) == ("F", 0) else []
        out += [a] + ([Action("EB", 0, a.mb)] if (a.kind, a.chunk) == ("B", 0) else [])
    return simulate([out] + base[1:], pp, vpp, f, b, enc_f_cost=ef, enc_b_cost=eb).makespan


@pytest.mark.parametrize("kind,pp,vpp,M", CASES)
def test_placement_keeps_the_pipeline_and_its_p2p(kind: str, pp: int, vpp: int, M: int) -> None:
    base = build_schedule(kind, pp, vpp, M)
    base_progs = build_programs(base, pp, vpp)
    for seed in range(3):
        f, b, ef, eb = _costs(pp, vpp, M, seed)
        spans = {}
        for mode in ("before", "bubbles"):
            placed = place_encoder(base, pp, vpp, f, b, ef, eb, mode)
            validate_schedule(placed, pp, vpp, M)  # EF(m) before F(0, m), EB(m) after B(0, m), each once
            assert placed[1:] == base[1:] and strip_encoder(placed) == base  # F/B order untouched
            enc = [a for a in placed[0] if a.is_encoder]
            assert sorted(enc) == sorted(Action(k, 0, m) for k in ("EF", "EB") for m in range(M))
            pos = {a: i for i, a in enumerate(placed[0])}
            for m in range(M):
                assert pos[Action("EF", 0, m)] < pos[Action("F", 0, m)] < pos[Action("B", 0, m)] < pos[
                    Action("EB", 0, m)]
            assert placed[0][0] == Action("EF", 0, 0)  # the first encoder forward precedes the pipeline
            progs = build_programs(placed, pp, vpp)
            # the p2p programs are the F/B ones with encoder computes inserted: every pair's sequence is unchanged
            assert [[i for i in p if not (i.op == "compute" and i.action.is_encoder)] for p in progs] == base_progs
            assert [[i.action for i in p if i.op == "compute"] for p in progs] == placed
            check_programs(progs, pp, vpp)
            run_programs(progs, pp, vpp, ordered=True)
            run_programs(progs, pp, vpp, ordered=False)
            spans[mode] = simulate(placed, pp, vpp, f, b, enc_f_cost=ef, enc_b_cost=eb).makespan
        assert spans["bubbles"] <= spans["before"] + 1e-9
        assert spans["bubbles"] <= _inline_span(base, pp, vpp, f, b, ef, eb) + 1e-9
        assert spans["bubbles"] >= simulate(base, pp, vpp, f, b).makespan  # the encoder costs something


@pytest.mark.parametrize("kind,pp,vpp,M", [("1f1b", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4),
                                           ("interleaved", 4, 2, 8)])
def test_bubbles_hide_encoder_time_with_equal_stages(kind: str, pp: int, vpp: int, M: int) -> None:
    """Equal stages (forward 1/vpp, backward 2/vpp), encoder forward 0.25, backward 0.5 per micro-batch: the
    placement in bubbles is strictly shorter than everything before / after the pipeline, and re-simulating
    it shows the idle time used (less of the encoder's total time is exposed)."""
    base = build_schedule(kind, pp, vpp, M)
    f, b, ef, eb = 1 / vpp, 2 / vpp, 0.25, 0.5
    plain = simulate(base, pp, vpp, f, b).makespan
    span = {mode: simulate(place_encoder(base, pp, vpp, f, b, ef, eb, mode), pp, vpp, f, b, enc_f_cost=ef,
                           enc_b_cost=eb).makespan for mode in ("before", "bubbles")}
    total = M * (ef + eb)
    assert span["before"] == pytest.approx(plain + total)  # nothing hidden
    assert span["bubbles"] < span["before"] - 0.5 * ef
    assert span["bubbles"] - plain < total  # exposed < total: the bubbles took some of it


def test_forward_only_inline_and_bad_input() -> None:
    base = build_schedule("1f1b", 2, 1, 3)
    fwd = forward_only_schedule(base)
    placed = place_encoder(fwd, 2, 1, 1.0, 2.0, 0.5, 1.0, "bubbles")
    validate_schedule(placed, 2, 1, 3)
    assert [a for a in placed[0] if a.is_encoder] == [Action("EF", 0, m) for m in range(3)]
    full = place_encoder(base, 2, 1, 1.0, 2.0, 0.5, 1.0, "bubbles")
    assert forward_only_schedule(full)[0] == [a for a in full[0] if a.kind in ("F", "EF")]
    validate_schedule(forward_only_schedule(full), 2, 1, 3)
    assert place_encoder(full, 2, 1, 1.0, 2.0, 0.5, 1.0, "inline") == base
    with pytest.raises(ValueError, match="encoder schedule must be one of"):
        place_encoder(base, 2, 1, 1.0, 2.0, 0.5, 1.0, "early")
    with pytest.raises(ValueError, match="3 micro-batches"):
        place_encoder(base, 2, 1, 1.0, 2.0, [0.5, 0.5], 1.0)
    r0 = full[0]
    late = [a for a in r0 if a != Action("EF", 0, 1)]
    late.insert(late.index(Action("F", 0, 1)) + 1, Action("EF", 0, 1))
    with pytest.raises(ValueError, match="EF0.1 scheduled after F0.1"):
        validate_schedule([late, full[1]], 2, 1, 3)
    early = [a for a in r0 if a != Action("EB", 0, 2)]
    early.insert(early.index(Action("B", 0, 2)), Action("EB", 0, 2))
    with pytest.raises(ValueError, match="EB0.2 scheduled before B0.2"):
        validate_schedule([early, full[1]], 2, 1, 3)
    with pytest.raises(ValueError, match="first stage's rank 0 only"):
        validate_schedule([r0, [Action("EF", 0, 0)] + full[1]], 2, 1, 3)
    with pytest.raises(ValueError, match="permutation"):
        validate_schedule([[a for a in r0 if a != Action("EB", 0, 0)], full[1]], 2, 1, 3)


def test_config_names_a_bad_encoder_schedule() -> None:
    assert tiny_cfg(2, 1).parallel.encoder_schedule == "bubbles"
    with pytest.raises(ConfigError, match="parallel.encoder_schedule: must be 'bubbles', 'before' or 'inline'"):
        tiny_cfg(2, 1, extra=["--parallel.encoder_schedule=overlap"])


# --------------------------------------------------------------------------------------------------------------
# the runner (all pipeline ranks in one process, tests/parallel/pipeline_harness.py)
# --------------------------------------------------------------------------------------------------------------
PH = 250  # the media placeholder id of the tiny vocabulary (256)
VISION = ["--vision.enabled=true", "--vision.num_hidden_layers=2", "--vision.hidden_size=32",
          "--vision.num_attention_heads=2", "--vision.head_dim=16", "--vision.intermediate_size=64",
          "--vision.pos_emb_height=8", "--vision.pos_emb_width=8", "--vision.projector_hidden_size=48",
          f"--model.media_placeholder_token_id={PH}"]
GRIDS = [[[1, 4, 4]], [], [[2, 4, 6], [1, 2, 2]], [[1, 6, 4]]]  # per micro-batch (the 2nd: no media)


def vl_cfg(pp: int, vpp: int, mode: str, M: int = 4, recompute: bool = False):
    return tiny_cfg(pp, vpp, micro_batches=M, recompute=recompute,
                    extra=VISION + [f"--parallel.encoder_schedule={mode}"])


def vl_batches(cfg, M: int) -> list[Batch]:
    """``M`` micro-batches of one row each, their placeholders filled by ``GRIDS`` (cycled)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(M):
        grids = GRIDS[i % len(GRIDS)]
        s = torch.randint(3, PH, (1, cfg.train.seq_len + 1), generator=g)
        s[0, 1] = 1  # an EOS: two documents
        gt = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        n = sum((h // 2) * (w // 2) for _, h, w in grids)
        s[0, 3:3 + n] = PH
        b = Batch.from_samples(s, eos_id=1)
        b.media = (MediaInputs(torch.randn(int(gt.prod(-1).sum()), 3, 14, 14, generator=g), gt) if grids
                   else MediaInputs.empty(14))
        b.media_rows, b.media_token_id = torch.zeros(len(grids), dtype=torch.long), PH
        out.append(b)
    return out


_REF: dict = {}


@pytest.mark.parametrize("pp,vpp,M,mode,recompute", [
    (2, 1, 4, "bubbles", False), (2, 1, 4, "before", False), (2, 1, 4, "inline", False),
    (2, 2, 4, "bubbles", False), (2, 2, 4, "before", False), (3, 1, 3, "bubbles", True)])
def test_vl_pipeline_with_encoder_actions_matches_single_process(pp, vpp, M, mode, recompute) -> None:
    cfg = vl_cfg(pp, vpp, mode, M, recompute)
    batches = vl_batches(cfg, M)
    if M not in _REF:
        _REF[M] = reference(cfg, batches)
    ref, rstats = _REF[M]
    assert any(k.startswith("vision.encoder.blocks.1.") for k in ref) and all(
        float(ref[k].abs().max()) > 0 for k in ref if k.startswith("vision."))
    runners, stats = in_process_pipeline(cfg, batches)
    for r in runners:
        assert_grads_match(r.model, ref)  # every parameter (the encoder's on the first rank), fp32 tight
    assert {n for r in runners for n, _ in r.model.named_parameters()} == set(ref)
    assert sum(s["loss"] for s in stats) == pytest.approx(rstats["loss"], rel=1e-6)
    enc = [a for a, _ in runners[0].action_times if a.is_encoder]
    if mode == "inline":
        assert not enc and stats[0]["encoder_s"] == 0.0
    else:
        assert sorted(enc) == sorted(Action(k, 0, m) for k in ("EF", "EB") for m in range(M))
        assert stats[0]["encoder_s"] > 0
    assert all(not a.is_encoder for r in runners[1:] for a, _ in r.action_times)


def test_encoder_chunk_hook_fires_after_the_last_encoder_backward() -> None:
    """Pipeline ZeRO-2's hook: every parameter handed over once, its gradient final (the encoder's after the last
    EB, which here comes after the first chunk's last B)."""
    cfg = vl_cfg(2, 1, "bubbles")
    seen: list[tuple[int, list]] = []
    runners, _ = in_process_pipeline(cfg, vl_batches(cfg, 4), hook=lambda rank, params: seen.append(
        (rank, [(id(p), None if p.grad is None else p.grad.clone()) for p in params])))
    acts = [a for a, _ in runners[0].action_times]
    assert acts.index(Action("EB", 0, 3)) > acts.index(Action("B", 0, 3))
    for rank, r in enumerate(runners):
        calls = [ps for rk, ps in seen if rk == rank]
        assert sorted(i for ps in calls for i, _ in ps) == sorted(id(p) for p in r.model.parameters())
        final = {id(p): p.grad for p in r.model.parameters()}
        for ps in calls:
            for i, g in ps:
                if g is not None:
                    torch.testing.assert_close(g, final[i], atol=0, rtol=0)  # nothing added after the hook
    vision = {id(p) for p in runners[0].model.vision.parameters()}
    assert any(i in vision for ps in (ps for rk, ps in seen if rk == 0) for i, _ in ps)


def test_forward_only_runs_each_encoder_forward_before_its_stage0_forward() -> None:
    cfg = vl_cfg(2, 2, "bubbles")
    batches = vl_batches(cfg, 4)
    _, rstats = reference(cfg, batches)
    runners, stats = in_process_pipeline(cfg, batches, forward_only=True)
    assert sum(s["loss"] for s in stats) == pytest.approx(rstats["loss"], rel=1e-6)
    acts = [a for a, _ in runners[0].action_times]
    assert {a.kind for a in acts} == {"F", "EF"}
    assert all(acts.index(Action("EF", 0, m)) < acts.index(Action("F", 0, m)) for m in range(4))


def test_nonfinite_order_puts_the_encoder_before_stage0_forward_and_after_its_backward() -> None:
    """k3train/runtime/nonfinite.py's event order with the encoder's own actions: EF(m) before F(0, m), EB(m) after
    B(0, m) (as inline, where the encoder runs first in F and last in B)."""
    from types import SimpleNamespace

    from k3train.runtime.nonfinite import FirstNonFinite

    runner = SimpleNamespace(current=None)
    rec = FirstNonFinite(torch.nn.Linear(1, 1), runner)
    keys = {}
    for kind, backward in (("EF", False), ("F", False), ("B", True), ("EB", True)):
        runner.current = (kind, 0, 1)
        for _ in range(3 if kind in ("EF", "B") else 1):  # the last EF / B firing vs the first F / EB one
            keys[kind] = rec._key(backward)
    assert keys["EF"] < keys["F"] < keys["B"] < keys["EB"]
    runner.current = ("F", 1, 0)
    assert rec._key(False) > keys["F"]  # a later stage's forward still sorts after stage 0's
    rec.remove()
