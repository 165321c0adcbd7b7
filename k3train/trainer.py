"""The training loop: build (model -> parallelize -> optimizer -> data), resume, step, log, checkpoint.

One optimizer step:
  1. the loader yields this rank's micro-batches of the step's global batch (layout-independent) and the global
     token counts, so every micro-batch loss is normalised by the GLOBAL count (gradients are the global mean);
  2. the step runner (pipeline schedule, or a plain accumulation loop at pp = 1) runs forward + backward (an EAGLE-3
     draft run, ``train.objective=eagle3``: the frozen target's forward-only pass with the draft's forward + backward
     on the last stage, k3train/draft/objective.py);
  3. the optimizer reduces gradients (DP / ZeRO) and computes the global grad norm; the loss sums are
     all-reduced. Both are global, so every rank takes the same branch: finite -> 4; otherwise the step is
     skipped after a diagnostic re-run names the first non-finite module (k3train/runtime/nonfinite.py);
  4. routers' Quantile-Balancing statistics are summed over every rank that routes the layer, biases updated
     for the next step; the optimizer clips, steps (Muon + AdamW), QK-Clip;
  5. every ``train.eval_interval`` steps and at the end: the validation loss (k3train/evaluate.py);
  6. rank 0 logs ``metrics.jsonl`` and a progress line; checkpoints every ``checkpoint.interval`` steps.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3train.checkpoint import CheckpointManager, checkpoint_root, prepare_run_dir, step_dir_name
from k3train.checkpoint.fingerprint import run_fingerprint, schedule_record
from k3train.checkpoint.rng import get_rng_state, seed_everything, set_rng_state
from k3train.config import Config, ConfigError
from k3train.data import GlobalBatchLoader
from k3train.draft.target import load_target
from k3train.evaluate import Evaluator
from k3train.hf.load import load_hf_weights, log_load_stats
from k3train.model.kernels import (
    Installed,
    apply_kernels,
    choose_kernels,
    describe_kernels,
    kernel_settings,
    target_for,
)
from k3train.optim import build_optimizer, lr_at
from k3train.parallelize import ParallelModel, parallelize
from k3train.preflight import starts_from_hf
from k3train.reporting.metrics import MetricsLogger, memory_gib, resolve_peak_flops
from k3train.reporting.run_summary import RunSummary, gather_peak_memory
from k3train.runtime.nonfinite import NonFiniteGuard, step_is_finite
from k3train.runtime.process_groups import init_distributed, shutdown
from k3train.runtime.signals import StopRun, StopSignals, signal_name
from parallel.dims import ParallelDims
from parallel.pipeline.loss_norm import LossNorm

log = logging.getLogger(__name__)


def _setup_logging(rank: int, level: str) -> None:
    root = logging.getLogger()
    root.setLevel(getattr(logging, level) if rank == 0 else logging.WARNING)
    if not root.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                                         "%H:%M:%S"))
        root.addHandler(h)
    for noisy in ("megatron", "torch.distributed.checkpoint"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if rank != 0:  # every rank reaches the same warnings: rank 0 prints them once
        for h in root.handlers:
            if not any(isinstance(f, _RankZeroWarnings) for f in h.filters):
                h.addFilter(_RankZeroWarnings())


class _RankZeroWarnings(logging.Filter):
    """On ranks other than 0: drop WARNING records (rank 0 logs the same one) unless logged with
    ``extra=RANK_SPECIFIC`` (k3train/runtime/process_groups.py: something only this rank saw). Errors always pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or bool(getattr(record, "rank_specific", False))


def _apply_kernels(cfg: Config, pm: ParallelModel, device: torch.device) -> dict[str, Any]:
    """Choose each op's kernel for this device (k3train/model/kernels.py), point the built layers at it, and log
    one line per op (``kda: fla chunk_kda (triton)`` / ``kda: k3train chunked (torch)``, ``mla: ...``, ...)."""
    choices = choose_kernels(kernel_settings(cfg.train), target_for(cfg, device), Installed.probe())
    apply_kernels(pm.modules, choices, cfg.model)
    for line in describe_kernels(choices):
        log.info("%s", line)
    return choices


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.env = init_distributed(cfg.parallel.backend, cfg.train.device, cfg.parallel.collective_timeout_s,
                                    cfg.train.num_threads)
        _setup_logging(self.env.rank, cfg.logging.level)
        if self.env.num_threads:
            log.info("threads: %d per rank (%s)", self.env.num_threads, self.env.threads_reason)
        self.dims = ParallelDims.from_config(cfg.parallel, self.env.world_size, self.env.rank).build_groups(
            timeout_s=self.env.collective_timeout_s or None)  # every group gets parallel.collective_timeout_s
        log.info("layout: %s", self.dims.describe())
        # tensors for small collectives live where the backend wants them (gloo: CPU, nccl: the GPU)
        self._comm_device = self.env.device if self.env.backend == "nccl" else torch.device("cpu")
        self.out_dir = Path(cfg.train.out_dir)
        if self.env.is_main:  # overwrite=true moves another run's data aside; stale .tmp_step_* dirs go
            prepare_run_dir(cfg)
        if dist.is_initialized():
            dist.barrier()
        seed_everything(cfg.train.seed)

        self.pm: ParallelModel = parallelize(cfg, self.dims, self.env.device)

        if starts_from_hf(cfg):  # before the optimizer: its fp32 masters of bf16 parameters start from these values
            log_load_stats(load_hf_weights(self.pm.modules, cfg), cfg.checkpoint.load_hf)
        self.kernels = _apply_kernels(cfg, self.pm, self.env.device)

        self._lr_at = lr_at
        self.optimizer = build_optimizer(self.pm.modules, cfg, self.dims, param_group_fn=self.pm.grad_group_fn,
                                         norm_exclude=self.pm.runner.replica_params)
        self.pm.set_chunk_backward_hook(self.optimizer)

        self.loader = GlobalBatchLoader.from_dims(cfg, self.dims, device=self.env.device)
        self.evaluator = Evaluator(cfg, self.dims, self.pm, self._comm_device, self.env.device)  # builds the valid split if used
        self.nonfinite = NonFiniteGuard(self.pm.model, self.pm.runner, self.env.rank, cfg.train.max_skipped_steps,
                                        self._comm_device)
        self.ckpt = CheckpointManager(checkpoint_root(cfg), keep=cfg.checkpoint.keep,
                                      async_save=cfg.checkpoint.async_save)
        self._ckpt_meta = {"fingerprint": run_fingerprint(cfg), "schedule": schedule_record(cfg)}
        self.step = 0
        resumed = self._maybe_resume()
        if self.pm.draft is not None and not resumed:  # a new EAGLE-3 draft run starts from the frozen target
            load_target(self.ckpt, self.pm, cfg)
            log.info("EAGLE-3 draft (%s loss, %d steps): target loaded from %s; training the MTP layer and W_E3",
                     cfg.train.draft_loss, cfg.train.draft_steps, cfg.checkpoint.target)
        if self.env.is_main:  # only now, with the start known to be good, replace the run's config.yaml
            tmp = self.out_dir / f".config.yaml.tmp{os.getpid()}"
            cfg.save(tmp)
            os.replace(tmp, self.out_dir / "config.yaml")
        self.peak_flops, peak_source = self._peak_flops()
        log.info("MFU denominator: %.1f GFLOP/s per rank (%s)", self.peak_flops / 1e9, peak_source)
        self.summary = RunSummary(cfg.train.global_batch_size * cfg.train.seq_len, self.peak_flops, peak_source)
        self.metrics = MetricsLogger(self.out_dir, self.env.is_main, cfg.logging, cfg.to_dict(),
                                     resume_step=self.step if resumed else None)

    def _peak_flops(self) -> tuple[float, str]:
        """Rank 0 resolves the MFU denominator (configured, or measured once per host and cached:
        k3train/reporting/metrics.py) and broadcasts it, so every rank and every run on this machine uses the same one."""
        flops, source = resolve_peak_flops(self.cfg.logging.peak_flops, self.env.device) if self.env.is_main \
            else (0.0, "")
        if dist.is_initialized() and self.env.world_size > 1:
            t = torch.tensor([flops], dtype=torch.float64, device=self._comm_device)
            dist.broadcast(t, src=0)
            flops = float(t.item())
        return flops, source

    # ------------------------------------------------------------------------------------------------------
    def _tensor_state(self) -> dict[str, Any]:
        return {"model": self.pm.state_dict(), "optim": self.pm.optimizer_state_dict(self.optimizer)}

    def _rank_state(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.loader.state_dict(), "rng": get_rng_state()}

    def _maybe_resume(self) -> bool:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return False
        # verify checksums (each rank a share of the files); fall back past damaged ones, moving them aside
        candidates = self.ckpt.complete_checkpoints()[::-1] if mode == "auto" else [Path(mode)]
        path, damaged = self.ckpt.select(candidates)
        for bad, why in damaged:
            if mode != "auto":  # an explicit path is the user's choice: refuse (bad input), never fall back
                raise ConfigError(f"checkpoint.resume: {bad} is damaged ({why}); pick another checkpoint or "
                                  f"resume=auto (which falls back to the newest one that verifies)")
            moved = self.ckpt.quarantine(bad)
            log.warning("checkpoint %s is damaged (%s): moved to %s; %s", bad.name, why, moved.name,
                        f"resuming from {path.name}" if path else "no older checkpoint verifies")
        if path is None:
            if damaged:
                raise RuntimeError(f"no checkpoint in {self.ckpt.root} verifies (damaged ones moved aside)")
            return False
        state = self._tensor_state()
        rank_state = self.ckpt.load(path, state)
        self.pm.load_state_dict(state["model"])
        self.optimizer.load_state_dict(self.pm.local_tensors(state["optim"]))
        self.step = rank_state["step"]
        self.loader.load_state_dict(rank_state["data"])
        if "rng" in rank_state:
            set_rng_state(rank_state["rng"])
        log.info("resumed from %s at step %d", path, self.step)
        return True

    def save_checkpoint(self) -> None:
        state = self._tensor_state()  # built once: under EP it wraps every expert tensor as a DTensor
        self.nonfinite.assert_finite_state(state, self.step)  # never a checkpoint with NaN/inf
        self.ckpt.save(self.step, state, self._rank_state(),
                       meta={"layout": self.dims.describe().split(";")[0], **self._ckpt_meta})

    # ------------------------------------------------------------------------------------------------------
    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    def _reduce_over_pp(self, m: dict[str, Any], op: Any) -> dict[str, Any]:
        """Per-layer metrics (MoE load, QK-Clip) come from the layers each pipeline rank holds: combine them
        over the pipeline group. Every rank must produce the same keys."""
        keys = sorted(k for k, v in m.items() if isinstance(v, (int, float)))
        if not dist.is_initialized() or self.dims.pp == 1:
            return {k: m[k] for k in keys}
        t = torch.tensor([float(m[k]) for k in keys] + [0.0], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=op, group=self.dims.group("pp"))
        return dict(zip(keys, t.tolist()))

    def _loss_norm(self, micro_batches: Any) -> tuple[Any, Any]:
        """The step's loss normalisation -- global loss-token counts: this rank's micro-batches summed over every
        rank holding other rows/segments -- and its forward + backward: the model's, or the draft's
        (train.objective=eagle3, k3train/draft/objective.py)."""
        cfg, draft = self.cfg, self.pm.draft
        if draft is None:
            mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0
            norm = LossNorm.from_batches(micro_batches, mtp_w, group=self.dims.group("dp_cp"),
                                         device=self._comm_device)
            return norm, self.pm.forward_backward
        norm = draft.norm(micro_batches, group=self.dims.group("dp_cp"), device=self._comm_device)
        return norm, draft.forward_backward

    def _apply_or_skip(self, finite: bool, lr: float, fb: Any, micro_batches: Any, norm: Any
                       ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], float, dict[str, Any] | None]:
        """A finite step moves the Quantile Balancing biases, then the optimizer steps; a non-finite one is
        skipped: name the first non-finite module (a diagnostic re-run on every rank), change nothing. Returns
        ``(moe_worst, moe_totals, optimizer stats, optimizer seconds, the non-finite report or None)``."""
        if finite:
            moe_worst, moe_totals = self.pm.sync_router_balance()  # QB biases move only on an applied step
            t_opt = time.perf_counter()
            ostats = self.optimizer.step(lr)
            return moe_worst, moe_totals, ostats, time.perf_counter() - t_opt, None

        def rerun() -> None:  # unpaired (parallel.overlap_ep): the diagnosis hooks follow one thread
            self.optimizer.zero_grad()
            with self.pm.runner.unpaired():
                fb(micro_batches, norm)

        report = self.nonfinite.diagnose(rerun)
        self.optimizer.zero_grad()
        self.pm.discard_step_statistics()
        return {}, {}, self.optimizer.skip_step(), 0.0, report

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        micro_batches = self.loader.next_step()
        draft = self.pm.draft  # train.objective=eagle3 (k3train/draft/objective.py)
        norm, fb = self._loss_norm(micro_batches)
        self.nonfinite.begin_step(self.step + 1)
        self.optimizer.zero_grad()
        t_fb = time.perf_counter()
        stats = fb(micro_batches, norm)
        t_gn = time.perf_counter()
        grad_norm = self.optimizer.clip_grad_norm_()  # global (all ranks), so the decision below is too
        t_gn_end = time.perf_counter()
        # every rank computes its share; the sum over ranks is the global quantity (loss sums live on last stages)
        sums = self._all_reduce_sum([stats.get("lm_loss_sum", 0.0), stats.get("mtp_loss_sum", 0.0),
                                     stats.get("p2p_bytes", 0.0), stats.get("p2p_bytes_hidden", 0.0),
                                     stats.get("p2p_bytes_block_cache", 0.0), stats.get("p2p_bytes_grad", 0.0)])
        drafted = draft.metrics(self._all_reduce_sum(draft.flat(stats))) if draft is not None else {}
        loss = drafted.pop("loss") if draft is not None else sums[0] / max(1, norm.lm_tokens)
        lr = self._lr_at(self.step, cfg.optim, cfg.train.steps)
        finite = step_is_finite(grad_norm, [*sums[:2], loss])
        moe_worst, moe_totals, ostats, t_opt, report = self._apply_or_skip(finite, lr, fb, micro_batches, norm)
        self.step += 1
        self.nonfinite.after_step(self.step, report is not None, f"loss {loss:.4g} / grad norm {grad_norm:.4g}",
                                  report)
        total_keys = sorted(moe_totals)
        moe_sums = self._all_reduce_sum([moe_totals[k] for k in total_keys]) if total_keys else []
        dt = time.perf_counter() - t0
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        tps = tokens / dt
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": self.pm.flops_per_token * tps / (self.peak_flops * self.env.world_size),
            "mem_gib": memory_gib(self.env.device),
            # this rank's phases (waits for other ranks included): what the planner's breakdown is checked against
            "time_forward_backward_s": t_gn - t_fb,
            "time_grad_norm_s": t_gn_end - t_gn,
            "time_optimizer_s": t_opt,
        }
        if draft is None and norm.mtp_tokens:
            rec["mtp_loss"] = sums[1] / norm.mtp_tokens
        rec.update(drafted)  # draft_accept [S], draft_accept_len (the loss above is the draft's)
        if self.dims.pp > 1:
            rec.update(p2p_bytes=int(sums[2]), p2p_bytes_hidden=int(sums[3]), p2p_bytes_block_cache=int(sums[4]),
                       p2p_bytes_grad=int(sums[5]))
        rec.update(self._reduce_over_pp(moe_worst, dist.ReduceOp.MAX))
        rec.update({k: int(v) for k, v in zip(total_keys, moe_sums)})
        if report is not None:
            rec.update(nonfinite_module=report["module"], nonfinite_rank=report["rank"])
        # fixed keys with defaults: a stage without MLA layers reports no QK statistics of its own
        rec.update(self._reduce_over_pp({"qk_max": ostats.get("qk_max", 0.0), "skipped": ostats.get("skipped", 0.0)},
                                        dist.ReduceOp.MAX))
        rec.update(self._reduce_over_pp({"qk_clipped_heads": ostats.get("qk_clipped_heads", 0.0)}, dist.ReduceOp.SUM))
        return rec

    def train(self) -> None:
        cfg = self.cfg
        total = cfg.train.steps
        if self.step >= total:
            log.info("nothing to do: checkpoint is at step %d >= train.steps %d", self.step, total)
            return
        log.info("training steps %d..%d", self.step + 1, total)
        t_start = time.perf_counter()
        # SIGTERM / SIGINT: stop at an agreed step boundary with a checkpoint (k3train/runtime/signals.py); close() uninstalls
        self._stop_signals = StopSignals(self.env.rank, self._comm_device, cfg.checkpoint.preempt_timeout_s,
                                         self._stop_deadline_line).install()
        interval = cfg.checkpoint.interval
        stop = min(total, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else total
        while self.step < stop:
            rec = self.train_step()
            if self.evaluator.due(self.step, total):
                rec.update(self.evaluator.evaluate())
            self.metrics.log(rec)
            self.summary.add(rec)
            if (self.step % cfg.logging.log_interval == 0 or self.step == total or "val_loss" in rec
                    or rec.get("skipped")):
                self.metrics.progress(rec, total)
            self.nonfinite.raise_if_exhausted(self.step)  # TrainingStopped after max_skipped_steps in a row
            signum = self._stop_signals.agree()  # every rank, every step: one MAX all-reduce of the signal flag
            if signum:
                self._stop_at_boundary(signum)
            self.ckpt.poll()  # completes a background checkpoint once every rank's write is done (collective)
            if interval and self.step % interval == 0 and self.step < stop:
                self.save_checkpoint()
        if cfg.checkpoint.save_final or stop < total:
            self.save_checkpoint()
        self.ckpt.wait()
        mem = gather_peak_memory(memory_gib(self.env.device), self.env.device)  # collective: every rank
        self.metrics.close()  # wandb's end-of-run report first, then ours
        if self.env.is_main:
            last = self.ckpt.latest()
            for line in self.summary.lines(time.perf_counter() - t_start, mem, str(last) if last else "none"):
                print(line, flush=True)

    def _stop_at_boundary(self, signum: int) -> None:
        """All ranks agreed to stop after this step: checkpoint it (before the stop deadline) and raise StopRun."""
        self.save_checkpoint()
        self.ckpt.wait()  # a background save completes before the stop deadline is disarmed
        self._stop_signals.disarm()
        raise StopRun(signum, self.step, step_dir_name(self.step))

    def _stop_deadline_line(self, signum: int) -> str:
        """Printed (rank 0) when checkpoint.preempt_timeout_s passed before the stop's checkpoint was written."""
        last = self.ckpt.latest()
        return (f"k3train: error: stopped by {signal_name(signum)}, but the checkpoint after step "
                f"{self.step} was not written within checkpoint.preempt_timeout_s="
                f"{self.cfg.checkpoint.preempt_timeout_s:g}s; the last complete checkpoint stays: "
                f"{last.name if last else 'none'}")

    def close(self, destroy_groups: bool = True) -> None:
        """Flush metrics, restore signal handlers, tear down the process groups -- except after a collective
        failure (``destroy_groups=False``): destroying a group whose peer died can abort or hang the process."""
        if hasattr(self, "_stop_signals"):
            self._stop_signals.uninstall()
        if destroy_groups and hasattr(self, "ckpt"):  # a background checkpoint still writing completes first
            self.ckpt.close()
        self.metrics.close() if hasattr(self, "metrics") else None
        if hasattr(self, "pm") and self.pm.runner.pair is not None:  # the F/B pairing worker thread
            self.pm.runner.pair.close()
            self.pm.runner.pair = None
        if destroy_groups:
            shutdown()
