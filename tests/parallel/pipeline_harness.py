"""Shared helpers for the pipeline tests: micro-batches, the single-process reference, and an in-process driver
that runs every pipeline rank's program in one process over an in-memory transport (the same runner code minus
gloo; the multi-process tests cover the gloo transport). Their tiny config: k3train/config/presets.py
(``tiny_pipeline_config``)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from k3train.config import Config
from k3train.data.batch import Batch
from k3train.model.model import K3Model
from parallel.comm_stats import ByteCounter
from parallel.dims import ParallelDims
from parallel.pipeline import LossNorm, build_step_runner
from parallel.pipeline.schedules import Message, deps_of
from reference_step import single_process_step

SEED = 7
EOS = 1


def make_batches(cfg: Config, n: int, seed: int = 0) -> list[Batch]:
    """``n`` micro-batches of random tokens with a few EOS (several documents per row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = torch.randint(3, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=g)
        s[torch.rand(s.shape, generator=g) < 0.12] = EOS
        out.append(Batch.from_samples(s, eos_id=EOS))
    return out


def full_model(cfg: Config, seed: int = SEED) -> K3Model:
    m = K3Model(cfg.model, cfg.vision)
    m.init_weights(seed)
    return m


def reference(cfg: Config, batches: list[Batch], seed: int = SEED) -> tuple[dict[str, torch.Tensor], dict]:
    """Single-process gradients (by FQN) and summed loss stats of the global batch ``batches``."""
    model = full_model(cfg, seed)
    norm = LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
    grads, stats = single_process_step(model, batches, norm)
    return grads, stats


def assert_grads_match(model: torch.nn.Module, ref: dict[str, torch.Tensor], atol: float = 1e-6,
                       rtol: float = 1e-5) -> int:
    """Every parameter of the (pruned) ``model`` has the reference gradient of the same FQN. Returns the count."""
    n = 0
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        assert name in ref, f"{name} not in the full model"
        torch.testing.assert_close(g, ref[name], atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")
        n += 1
    return n


class InProcessTransport:
    """Mailbox transport shared by the runners of one in-process pipeline (same interface as P2PTransport)."""

    def __init__(self, mailbox: dict[Message, list[torch.Tensor]], counter: ByteCounter) -> None:
        self.mailbox, self.counter = mailbox, counter
        self.generation = 0
        self.wait_s = 0.0  # nothing ever blocks in process

    def complete_sends(self, upto_generation: int) -> None:
        pass  # the mailbox copies on send

    def send(self, msg: Message, tensors: list[torch.Tensor], kinds: list[str]) -> None:
        assert msg not in self.mailbox, f"{msg} sent twice"
        self.mailbox[msg] = [t.detach().clone() for t in tensors]
        for t, k in zip(tensors, kinds):
            self.counter.add_sent(k, t)

    def post_recv(self, msg: Message, specs: list, kinds: list[str], device: torch.device) -> None:
        for (shape, dtype), k in zip(specs, kinds):
            self.counter.add_recv(k, torch.empty(shape, dtype=dtype, device="meta"))

    def wait(self, msg: Message) -> list[torch.Tensor]:
        return self.mailbox.pop(msg)

    def finish(self) -> None:
        pass


def in_process_pipeline(cfg: Config, batches: list[Batch], seed: int = SEED, norm: LossNorm | None = None,
                        hook: Callable[[int, list], None] | None = None,
                        forward_only: bool = False,
                        model_factory: Callable[[], Any] | None = None) -> tuple[list[Any], list[dict]]:
    """Build all ``pp`` runners in this process and run one step cooperatively. Returns (runners, stats).
    ``hook(pp_rank, params)`` is installed as every runner's ``on_chunk_backward_done``; ``forward_only``: the
    evaluation pass (``PipelineRunner.forward_only``'s program, under no_grad); ``model_factory``: builds the
    model each runner prunes (default ``K3Model(cfg.model, cfg.vision)``)."""
    if forward_only:
        with torch.no_grad():
            return _in_process(cfg, batches, seed, norm, hook, True, model_factory)
    return _in_process(cfg, batches, seed, norm, hook, False, model_factory)


def _in_process(cfg: Config, batches: list[Batch], seed: int, norm: LossNorm | None,
                hook: Callable[[int, list], None] | None, forward_only: bool,
                model_factory: Callable[[], Any] | None = None) -> tuple[list[Any], list[dict]]:
    pp = cfg.parallel.pp
    norm = norm or LossNorm.from_batches(batches, cfg.model.mtp_loss_weight)
    mailbox: dict[Message, list[torch.Tensor]] = {}
    runners = []
    for r in range(pp):
        dims = ParallelDims(pp=pp, dp=1, cp=1, world_size=pp, rank=r)  # no process groups: in-process
        run = build_step_runner(model_factory or (lambda: K3Model(cfg.model, cfg.vision)), cfg, dims, seed=seed,
                                on_chunk_backward_done=None if hook is None else (lambda ps, r=r: hook(r, ps)))
        run.p2p = InProcessTransport(mailbox, run.counter)
        runners.append(run)
    programs = [run.begin_step(batches, norm, forward_only) for run in runners]
    pos = [0] * pp
    vpp = cfg.parallel.vpp
    while any(pos[r] < len(programs[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(programs[r]):
                ins = programs[r][pos[r]]
                if ins.op == "compute" and any(d not in mailbox for d in deps_of(ins.action, r, pp, vpp)):
                    break
                runners[r].run_instr(ins)
                pos[r] += 1
                progressed = True
        assert progressed, f"in-process pipeline stuck at {pos}"
    stats = [run.end_step(sync_shared=False) for run in runners]
    if runners[0].shared_params and not forward_only:  # the embd all-reduce, done by hand
        first, last = runners[0].shared_params[0], runners[-1].shared_params[0]
        total = first.grad + last.grad
        first.grad, last.grad = total.clone(), total.clone()
        for run in (runners[0], runners[-1]):
            run.sync_shared_embedding(all_reduce=False)
    return runners, stats
