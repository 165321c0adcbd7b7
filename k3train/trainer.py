"""The training loop: build (model -> parallelize -> optimizer -> data), resume, step, log, checkpoint.

One optimizer step:
  1. the loader yields this rank's micro-batches of the step's global batch (layout-independent) and the global
     token counts, so every micro-batch loss is normalised by the GLOBAL count (gradients are the global mean);
  2. the step runner (pipeline schedule, or a plain accumulation loop at pp = 1) runs forward + backward;
  3. routers' Quantile-Balancing statistics are summed over every rank that routes the layer, biases updated
     for the next step;
  4. the optimizer reduces gradients (DP / ZeRO), clips by the global norm, steps (Muon + AdamW), QK-Clip;
  5. rank 0 logs ``metrics.jsonl`` and a progress line; checkpoints every ``checkpoint.interval`` steps.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3train.checkpoint import CheckpointManager
from k3train.checkpoint.rng import get_rng_state, seed_everything, set_rng_state
from k3train.config import Config
from k3train.dist_env import init_distributed, shutdown
from k3train.metrics import MetricsLogger, measure_peak_flops, memory_gib
from k3train.parallelize import ParallelModel, parallelize
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


class Trainer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.env = init_distributed(cfg.parallel.backend, cfg.train.device)
        _setup_logging(self.env.rank, cfg.logging.level)
        self.dims = ParallelDims.from_config(cfg.parallel, self.env.world_size, self.env.rank).build_groups()
        log.info("layout: %s", self.dims.describe())
        # tensors for small collectives live where the backend wants them (gloo: CPU, nccl: the GPU)
        self._comm_device = self.env.device if self.env.backend == "nccl" else torch.device("cpu")
        self.out_dir = Path(cfg.train.out_dir)
        if self.env.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.out_dir / "config.yaml")
        seed_everything(cfg.train.seed)

        self.pm: ParallelModel = parallelize(cfg, self.dims, self.env.device)
        from k3train.optim import build_optimizer, lr_at

        self._lr_at = lr_at
        self.optimizer = build_optimizer(self.pm.modules, cfg, self.dims, param_group_fn=self.pm.grad_group_fn,
                                         norm_exclude=self.pm.runner.replica_params)
        self.pm.set_chunk_backward_hook(self.optimizer)
        from k3train.data import GlobalBatchLoader

        self.loader = GlobalBatchLoader.from_dims(cfg, self.dims)
        self.ckpt = CheckpointManager(cfg.checkpoint.dir or self.out_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self.step = 0
        resumed = self._maybe_resume()
        self.peak_flops = cfg.logging.peak_flops or measure_peak_flops(self.env.device)
        log.info("MFU denominator: %.1f GFLOP/s per rank (%s)", self.peak_flops / 1e9,
                 "configured" if cfg.logging.peak_flops else "measured fp32 matmul at start-up")
        self.metrics = MetricsLogger(self.out_dir, self.env.is_main, cfg.logging, cfg.to_dict(),
                                     resume_step=self.step if resumed else None)

    # ------------------------------------------------------------------------------------------------------
    def _tensor_state(self) -> dict[str, Any]:
        return {"model": self.pm.state_dict(), "optim": self.pm.optimizer_state_dict(self.optimizer)}

    def _rank_state(self) -> dict[str, Any]:
        return {"step": self.step, "data": self.loader.state_dict(), "rng": get_rng_state()}

    def _maybe_resume(self) -> bool:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return False
        path = self.ckpt.latest() if mode == "auto" else Path(mode)
        if path is None:
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
        self.ckpt.save(self.step, self._tensor_state(), self._rank_state(),
                       meta={"layout": self.dims.describe().split(";")[0]})

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

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.perf_counter()
        micro_batches = self.loader.next_step()
        mtp_w = cfg.model.mtp_loss_weight if cfg.model.num_nextn_predict_layers else 0.0
        # global loss-token counts: this rank's micro-batches summed over every rank holding other rows/segments
        norm = LossNorm.from_batches(micro_batches, mtp_w, group=self.dims.group("dp_cp"), device=self._comm_device)
        self.optimizer.zero_grad()
        stats = self.pm.forward_backward(micro_batches, norm)
        moe_worst, moe_totals = self.pm.sync_router_balance()
        lr = self._lr_at(self.step, cfg.optim, cfg.train.steps)
        ostats = self.optimizer.step(lr)
        self.step += 1
        # every rank computes its share; the sum over ranks is the global quantity (loss sums live on last stages)
        total_keys = sorted(moe_totals)
        sums = self._all_reduce_sum([stats.get("lm_loss_sum", 0.0), stats.get("mtp_loss_sum", 0.0),
                                     stats.get("p2p_bytes", 0.0), stats.get("p2p_bytes_hidden", 0.0),
                                     stats.get("p2p_bytes_block_cache", 0.0), stats.get("p2p_bytes_grad", 0.0)]
                                    + [moe_totals[k] for k in total_keys])
        dt = time.perf_counter() - t0
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        tps = tokens / dt
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": sums[0] / max(1, norm.lm_tokens),
            "lr": lr,
            "grad_norm": float(ostats.get("grad_norm", 0.0)),
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": self.pm.flops_per_token * tps / (self.peak_flops * self.env.world_size),
            "mem_gib": memory_gib(self.env.device),
        }
        if norm.mtp_tokens:
            rec["mtp_loss"] = sums[1] / norm.mtp_tokens
        if self.dims.pp > 1:
            rec.update(p2p_bytes=int(sums[2]), p2p_bytes_hidden=int(sums[3]), p2p_bytes_block_cache=int(sums[4]),
                       p2p_bytes_grad=int(sums[5]))
        rec.update(self._reduce_over_pp(moe_worst, dist.ReduceOp.MAX))
        rec.update({k: int(v) for k, v in zip(total_keys, sums[6:])})
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
        interval = cfg.checkpoint.interval
        stop = min(total, cfg.train.stop_at_step) if cfg.train.stop_at_step > 0 else total
        while self.step < stop:
            rec = self.train_step()
            if not torch.isfinite(torch.tensor(rec["loss"])):
                raise FloatingPointError(f"loss is {rec['loss']} at step {rec['step']}; last good checkpoint kept")
            self.metrics.log(rec)
            if self.step % cfg.logging.log_interval == 0 or self.step == total:
                self.metrics.progress(rec, total)
            if interval and self.step % interval == 0 and self.step < stop:
                self.save_checkpoint()
        if cfg.checkpoint.save_final or stop < total:
            self.save_checkpoint()

    def close(self) -> None:
        self.metrics.close() if hasattr(self, "metrics") else None
        shutdown()
