"""Step-by-step parity of a parallel layout with the single-process run, through the real ``Trainer``.

Both sides are a :class:`k3train.trainer.Trainer` (``parallelize`` -> ``build_optimizer`` -> the chunk-backward
ZeRO-2 hook -> ``GlobalBatchLoader.from_dims``) driven by ``Trainer.train_step`` -- the exact step the training
loop runs (``LossNorm.from_batches`` over ``dp_cp``, pipeline schedule, Quantile-Balancing sync, lr schedule,
``optimizer.step``). The reference runs in the pytest process without ``torch.distributed``; after every step it
records every parameter and every optimizer-state entry by name (``{fqn}.momentum_buffer``, ``.exp_avg``,
``.exp_avg_sq``, ``.step``), which a parallel rank compares with what it holds: all its parameters (pruned stage,
full FQNs) and the state entries it OWNS under ZeRO (``optimizer.state_dict()`` holds only those).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from k3train.config import Config
from k3train.config.presets import tiny_config
from shipped_data import shipped_view

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN, GBS, MBS = 32, 4, 1


def parity_cfg(out_dir: Path, steps: int, world: int, layout: list[str]) -> Config:
    """configs/tiny.yaml at test size on the shipped corpus; ``layout``: ``--parallel.*`` overrides.

    ``warmup_steps=1``: the first step already runs at the peak lr, so a wrong gradient moves the parameters
    (Muon's update RMS is 0.2 * lr = 6e-4 per step) far beyond the comparison tolerance."""
    over = [f"--data.path={shipped_view('corpus_text_document')}", "--data.split=100,0,0",
            f"--train.seq_len={SEQ_LEN}", f"--train.global_batch_size={GBS}", f"--train.micro_batch_size={MBS}",
            f"--train.steps={steps}", "--train.device=cpu", "--train.dtype=float32", f"--train.out_dir={out_dir}",
            "--optim.warmup_steps=1", "--logging.wandb=false", "--logging.peak_flops=1e9",
            "--logging.level=WARNING", "--checkpoint.resume=none", "--checkpoint.interval=0", *layout]
    return tiny_config(*over, world_size=world)


def snapshot(trainer: Any, rec: dict[str, Any]) -> dict[str, Any]:
    """Everything a step leaves behind that the next step depends on (single-process trainer: all of it)."""
    return {"params": {n: p.detach().clone() for n, p in trainer.pm.model.named_parameters()},
            "optim": {k: v.detach().clone() for k, v in trainer.optimizer.state_dict().items()},
            "grads": owned_grads(trainer),
            "loss": rec["loss"], "grad_norm": rec["grad_norm"]}


def owned_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """The gradients the optimizer stepped with, on the ranks that stepped them (reduced, clipped; ZeRO owners)."""
    opt = trainer.optimizer
    return {i.fqn: i.param.grad.detach().clone() for i in opt.infos
            if i.owner == opt.rank and i.param.grad is not None}


def reference_run(out_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The uninterrupted single-process run: one snapshot after every step."""
    from k3train.trainer import Trainer

    tr = Trainer(parity_cfg(out_dir, steps, 1, []))
    try:
        return [snapshot(tr, tr.train_step()) for _ in range(steps)]
    finally:
        tr.metrics.close()


def max_diffs(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(max |mine - ref|, max of |mine - ref|.max() / |ref|.max() per tensor)`` over the entries of ``mine``
    (each must exist in ``ref`` with its shape): absolute, and relative to each tensor's scale."""
    worst, worst_rel = 0.0, 0.0
    for k, v in mine.items():
        assert k in ref and ref[k].shape == v.shape, f"{k}: not in the reference (or another shape)"
        if not v.numel():
            continue
        d = float((v.float() - ref[k].float()).abs().max())
        worst = max(worst, d)
        worst_rel = max(worst_rel, d / max(float(ref[k].abs().max()), 1e-30))
    return worst, worst_rel


def assert_close_all(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float, rtol: float,
                     what: str, scale_atol: float = 0.0) -> None:
    """Element-wise ``|mine - ref| <= atol + scale_atol * max|ref| + rtol * |ref|`` for every entry of ``mine``.
    ``scale_atol`` makes the absolute slack relative to the tensor's own scale (gradients and Adam moments are
    far below 1e-5 in absolute terms, so a fixed atol would not test them)."""
    for k, v in mine.items():
        a = atol + scale_atol * float(ref[k].abs().max()) if ref[k].numel() else atol
        torch.testing.assert_close(v, ref[k], atol=a, rtol=rtol, msg=lambda m, k=k: f"{what} {k}: {m}")
