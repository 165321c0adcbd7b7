"""Pipeline runner vs the single-process K3Model: loss and EVERY parameter gradient, all ranks driven in one
process over an in-memory transport (same runner code; gloo is covered by test_pipeline_dist.py)."""
from __future__ import annotations

import pytest
import torch

from k3train.config.presets import tiny_pipeline_config as tiny_cfg
from parallel.pipeline.attnres_comm import BlockCache
from pipeline_harness import assert_grads_match, full_model, in_process_pipeline, make_batches, reference

_REF: dict = {}


def _ref(cfg, batches, key):
    if key not in _REF:
        _REF[key] = reference(cfg, batches)
    return _REF[key]


def _check(cfg, M: int, mtp: int = 1):
    batches = make_batches(cfg, M)
    ref, rstats = _ref(cfg, batches, (M, mtp))
    runners, stats = in_process_pipeline(cfg, batches)
    n = sum(assert_grads_match(r.model, ref) for r in runners)
    owned = {name for r in runners for name, _ in r.model.named_parameters()}
    assert owned == set(ref), "the stages together must hold every parameter of the full model"
    assert n >= len(ref)
    assert sum(s["loss"] for s in stats) == pytest.approx(rstats["loss"], rel=1e-6)
    assert sum(s["lm_loss_sum"] for s in stats) == pytest.approx(rstats["lm_loss_sum"], rel=1e-6)
    assert stats[-1]["mtp_loss_sum"] == pytest.approx(rstats["mtp_loss_sum"], rel=1e-6)
    assert sum(s["p2p_bytes"] for s in stats) == sum(s["p2p_recv_bytes"] for s in stats)
    return runners, stats


@pytest.mark.parametrize("pp,vpp,M", [(2, 1, 3), (2, 2, 4), (3, 2, 3), (4, 2, 4), (2, 3, 2)])
@pytest.mark.parametrize("comm", ["cached", "full"])
def test_grads_match_single_process(pp: int, vpp: int, M: int, comm: str) -> None:
    _check(tiny_cfg(pp, vpp, comm=comm, micro_batches=M), M)


def test_cached_moves_fewer_bytes_and_matches_plan() -> None:
    M = 4
    out = {}
    for comm in ("cached", "full"):
        cfg = tiny_cfg(2, 2, comm=comm, micro_batches=M, pp_layers=[2, 2, 2, 2])
        runners, stats = _check(cfg, M)
        out[comm] = {k: sum(s[k] for s in stats) for k in stats[0] if k.startswith("p2p_bytes")}
        tokens = cfg.train.micro_batch_size * cfg.train.seq_len
        plan = runners[0].plan.step_bytes(M, tokens, cfg.model.hidden_size, 4)
        assert out[comm]["p2p_bytes"] == plan["total"]
        assert out[comm]["p2p_bytes_block_cache"] == plan["block_cache"]
        assert out[comm]["p2p_bytes_hidden"] == plan["hidden"]
        assert out[comm]["p2p_bytes_grad"] == plan["grad"]
    assert out["cached"]["p2p_bytes"] < out["full"]["p2p_bytes"]
    assert out["cached"]["p2p_bytes_hidden"] == out["full"]["p2p_bytes_hidden"]


@pytest.mark.parametrize("pp,vpp,layers", [(2, 2, [3, 1, 2, 2]), (4, 1, [1, 3, 2, 2]), (2, 2, [1, 4, 1, 2])])
def test_uneven_partitions(pp: int, vpp: int, layers: list[int]) -> None:
    cfg = tiny_cfg(pp, vpp, pp_layers=layers, micro_batches=4)
    _check(cfg, 4)


def test_afab_and_many_microbatches_pp2() -> None:
    _check(tiny_cfg(2, 2, schedule="afab", micro_batches=4), 4)
    _check(tiny_cfg(2, 2, micro_batches=8), 8)


def test_without_mtp() -> None:
    cfg = tiny_cfg(2, 2, micro_batches=2, mtp=0)
    runners, _ = _check(cfg, 2, mtp=0)
    assert runners[-1].model.embed_tokens is None and not runners[0].shared_params


def test_recompute_exact_and_buffers_not_double_counted() -> None:
    """Full-stage recomputation: same gradients, and the MoE routers' QB statistics (buffers) equal the
    reference's (the recomputed forward must not count the tokens twice)."""
    M = 4
    cfg = tiny_cfg(2, 2, recompute=True, micro_batches=M)
    runners, _ = _check(cfg, M)
    batches = make_batches(cfg, M)
    model = full_model(cfg)
    from k3train.model.seq import SeqInfo

    for b in batches:  # forward only: the statistics a single pass produces
        seq = SeqInfo.from_doc_ids(b.doc_ids, b.positions)
        model.forward_layers(model.embed(b.tokens), 0, 8, seq)
    ref_bufs = dict(model.named_buffers())
    n = 0
    for r in runners:
        for name, buf in r.model.named_buffers():
            if name.startswith("layers."):
                torch.testing.assert_close(buf, ref_bufs[name], msg=f"buffer {name}")
                n += 1
    assert n > 0


def test_hooks_fire_once_per_param_with_final_grads() -> None:
    """Every parameter is handed to on_chunk_backward_done exactly once per step, and its gradient does not change
    afterwards (Pipeline ZeRO-2 may reduce and drop it right away)."""
    cfg = tiny_cfg(2, 2, micro_batches=4)
    seen: list[tuple[int, list]] = []
    runners, _ = in_process_pipeline(cfg, make_batches(cfg, 4), hook=lambda rank, params: seen.append(
        (rank, [(id(p), None if p.grad is None else p.grad.clone()) for p in params])))
    for rank, r in enumerate(runners):
        calls = [ps for rk, ps in seen if rk == rank]
        ids = [i for ps in calls for i, _ in ps]
        assert sorted(ids) == sorted(id(p) for p in r.model.parameters()), "each parameter exactly once"
        final = {id(p): p.grad for p in r.model.parameters()}
        for ps in calls:
            for i, g in ps:
                if g is not None:
                    torch.testing.assert_close(g, final[i], atol=0, rtol=0)  # nothing added after the hook
        assert len(calls) == r.partition.vpp + (1 if r.shared_params else 0)


def test_dropping_the_cache_gradient_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: if the cached blocks' gradients were not routed to the earlier chunk (as with a detached
    cache), the loss is unchanged but the gradient check fails."""
    M = 2
    cfg = tiny_cfg(2, 2, micro_batches=M)
    batches = make_batches(cfg, M)
    ref, rstats = _ref(cfg, batches, (M, 1))
    orig = BlockCache.input_grads

    def broken(self, chunk, mb, inp):
        for t in inp.cached:
            t.grad = None
        return orig(self, chunk, mb, inp)

    monkeypatch.setattr(BlockCache, "input_grads", broken)
    runners, stats = in_process_pipeline(cfg, batches)
    assert sum(s["loss"] for s in stats) == pytest.approx(rstats["loss"], rel=1e-6)
    with pytest.raises(AssertionError):
        for r in runners:
            assert_grads_match(r.model, ref)


def test_pp1_local_runner_matches_and_hooks_once() -> None:
    from parallel.dims import ParallelDims
    from parallel.pipeline import LocalRunner, LossNorm, build_step_runner

    M = 2
    cfg = tiny_cfg(1, 1, micro_batches=M)
    batches = make_batches(cfg, M)
    ref, rstats = _ref(cfg, batches, (M, 1))
    calls: list[list] = []
    runner = build_step_runner(None, cfg, ParallelDims(), seed=7, on_chunk_backward_done=calls.append)
    assert isinstance(runner, LocalRunner) and runner.chunks == [(0, 8)]
    stats = runner.forward_backward(batches, LossNorm.from_batches(batches, cfg.model.mtp_loss_weight))
    assert_grads_match(runner.model, ref)
    assert stats["loss"] == pytest.approx(rstats["loss"], rel=1e-6) and stats["p2p_bytes"] == 0
    assert len(calls) == 1 and {id(p) for p in calls[0]} == {id(p) for p in runner.model.parameters()}


def test_too_few_microbatches_is_a_clear_error() -> None:
    from k3train.config import ConfigError
    from parallel.dims import ParallelDims
    from parallel.pipeline import build_step_runner

    cfg = tiny_cfg(2, 2, micro_batches=4)
    with pytest.raises(ConfigError, match="train.global_batch_size.*multiple of parallel.pp"):
        build_step_runner(None, cfg, ParallelDims(pp=2, world_size=2), num_microbatches=3)


def test_loss_norm() -> None:
    from parallel.pipeline import LossNorm

    sums = {"lm_loss_sum": torch.tensor(6.0), "mtp_loss_sum": torch.tensor(3.0)}
    assert float(LossNorm(3, 2, 0.5)(sums)) == pytest.approx(6 / 3 + 0.5 * 3 / 2)
    assert float(LossNorm(3, 0, 0.5)(sums)) == pytest.approx(2.0)  # no MTP tokens: no MTP term
    cfg = tiny_cfg(2, 1, micro_batches=2)
    b = make_batches(cfg, 2)
    n = LossNorm.from_batches(b, 0.3)
    assert n.lm_tokens == sum(float(x.loss_mask.sum()) for x in b) and n.mtp_weight == 0.3
