"""The training step and the metrics of EAGLE-3 draft training (``train.objective: eagle3``).

The model (k3train/model/eagle3.py) is the target K3Model plus ``eagle3`` (W_E3); :func:`freeze_target` leaves
trainable only the draft (``mtp`` and ``eagle3``): every other parameter has ``requires_grad=False`` (so the
optimizer holds no state for it), and every module but the draft's is in eval mode (routers collect no
Quantile-Balancing statistics, MLA no QK-Clip maxima); ``ParallelModel.sync_router_balance`` balances only the
draft's router.

One step (:meth:`DraftObjective.forward_backward`): the runner's FORWARD-ONLY pass over the micro-batches
(parallel/pipeline/runner.py ``forward_only(head=...)``: pp = 1 a plain loop; pp > 1 the schedule's forward actions,
activation p2p only, no gradient messages), whose last stage runs, per micro-batch, the draft's forward and
backward on the target's final state (:func:`k3train.model.eagle3.draft_loss_sums`). The loss backpropagated is

    sum_j  (sum over the step's valid positions of the LK / KL loss) / N_j

with ``N_j`` the GLOBAL count of valid positions of step ``j`` (:class:`DraftNorm`, all micro-batches and
data-parallel ranks), so summed draft gradients are the gradient of the global per-step means, whatever the layout.

Metrics (logged as ``loss``, ``draft_accept``, ``draft_accept_len``; ``val_*`` on the validation split):

* ``loss``: the objective above, ``sum_j mean_j(loss)``;
* ``draft_accept``: the ``S`` per-step means of ``alpha^j_t = sum_x min(p^j_t(x), q^j_t(x))`` over the step's
  valid positions -- the probability that lossless speculative sampling accepts the draft's token at step ``j``,
  given the chain before it was the data's (teacher-forced, as in training);
* ``draft_accept_len``: the expected number of accepted draft tokens of an ``S``-token chain, per position
  ``sum_{k=1..S} prod_{j<k} alpha^j_t`` (token ``k`` is accepted only if tokens ``1..k-1`` were), averaged over
  the positions whose whole chain is valid (step ``S - 1``'s positions). It does not count the token the target
  itself adds at each verification (tokens per target forward = 1 + draft_accept_len), and uses the teacher-forced
  per-step probabilities (an accepted token is the data's only in expectation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from k3train.model.eagle3 import chain_masks, draft_loss_sums

DRAFT_PARTS = ("mtp", "eagle3")  # the model's top-level parts the draft trains; everything else is the target
SUM_KEYS = ("draft_loss_sum", "draft_accept_sum", "draft_tokens")  # per-step vectors of the head's sums


def freeze_target(model: nn.Module) -> None:
    """Only the draft trains: ``requires_grad`` off and eval mode for everything but :data:`DRAFT_PARTS`."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.split(".", 1)[0] in DRAFT_PARTS)
    model.eval()
    for part in DRAFT_PARTS:
        m = getattr(model, part, None)
        if m is not None:
            m.train()


def draft_modules(model: nn.Module) -> list[nn.Module]:
    """The draft's modules this rank holds (none off the last pipeline stage)."""
    return [m for m in (getattr(model, p, None) for p in DRAFT_PARTS) if m is not None]


@dataclass
class DraftNorm:
    """Global count of valid positions per draft step (``tokens[j]``, see the module docstring)."""

    tokens: list[float]

    def __call__(self, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar to backpropagate for one micro-batch from :func:`draft_loss_sums` output."""
        denom = torch.tensor(self.tokens, dtype=sums["draft_loss_sum"].dtype,
                             device=sums["draft_loss_sum"].device).clamp_min(1.0)
        return (sums["draft_loss_sum"] / denom).sum()

    @classmethod
    def from_batches(cls, micro_batches: Sequence[Any], steps: int, group: Any = None,
                     device: torch.device | str = "cpu") -> "DraftNorm":
        """Count every step's valid positions over ``micro_batches`` and sum the counts over ``group`` (the
        data x context parallel group, as :meth:`parallel.pipeline.LossNorm.from_batches`; every rank of it calls)."""
        counts = torch.zeros(steps, dtype=torch.float64, device=device)
        for b in micro_batches:
            for j, m in enumerate(chain_masks(b.loss_mask, steps)):
                counts[j] += float(m.sum())
        if group is not None and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        return cls(tokens=counts.tolist())


class DraftObjective:
    """Built by :func:`k3train.parallelize.parallelize` for ``train.objective=eagle3``; ``runner``: this rank's
    step runner (its model is the pruned stage)."""

    def __init__(self, cfg: Any, runner: Any) -> None:
        t = cfg.train
        self.steps, self.kind, self.blocks = t.draft_steps, t.draft_loss, tuple(t.draft_feature_blocks)
        self.runner = runner

    def norm(self, micro_batches: Sequence[Any], group: Any = None, device: torch.device | str = "cpu") -> DraftNorm:
        return DraftNorm.from_batches(micro_batches, self.steps, group, device)

    def head(self, norm: DraftNorm | None) -> Callable[[Any, Any, Any], dict[str, torch.Tensor]]:
        """The last stage's computation per micro-batch: the draft's sums from the target's final state; with a
        ``norm`` (training) also the draft's backward of ``norm(sums)``, run right there (the target needs none)."""
        model = self.runner.model

        def run(state: Any, batch: Any, seq: Any) -> dict[str, torch.Tensor]:
            kw = dict(steps=self.steps, kind=self.kind, blocks=self.blocks)
            if norm is None:
                return draft_loss_sums(model, state, batch, seq, **kw)
            with torch.enable_grad():  # the runner's forward-only pass runs under no_grad
                sums = draft_loss_sums(model, state, batch, seq, **kw)
                norm(sums).backward()
            return {k: v.detach() for k, v in sums.items()}

        return run

    def forward_backward(self, micro_batches: list[Any], norm: DraftNorm) -> dict[str, Any]:
        """One training step's forward (target) + forward/backward (draft); gradients accumulate into the draft's
        ``.grad``. Same collectives as an evaluation pass."""
        return self.runner.forward_only(micro_batches, norm, head=self.head(norm))

    def forward_only(self, micro_batches: list[Any]) -> dict[str, Any]:
        """The draft's sums without any gradient (evaluation)."""
        return self.runner.forward_only(micro_batches, DraftNorm([1.0] * self.steps), head=self.head(None))

    # ------------------------------------------------------------------------------------------------------
    def flat(self, stats: dict[str, Any]) -> list[float]:
        """This rank's sums as one list (zeros off the last stage), to be summed over every rank."""
        out: list[float] = []
        for k in SUM_KEYS:
            v = stats.get(k)
            out += [float(x) for x in v] if v is not None else [0.0] * self.steps
        return out + [float(stats.get("draft_accept_len_sum", 0.0))]

    def metrics(self, flat: list[float], prefix: str = "") -> dict[str, Any]:
        """``loss``, ``draft_accept``, ``draft_accept_len`` (module docstring) from :meth:`flat` summed over ranks."""
        S = self.steps
        loss, accept, tokens = flat[:S], flat[S:2 * S], flat[2 * S:3 * S]
        return {f"{prefix}loss": sum(x / max(n, 1.0) for x, n in zip(loss, tokens)),
                f"{prefix}draft_accept": [a / max(n, 1.0) for a, n in zip(accept, tokens)],
                f"{prefix}draft_accept_len": flat[3 * S] / max(tokens[-1], 1.0)}
