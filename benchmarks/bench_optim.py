#!/usr/bin/env python
"""Optimizer benchmark: memory per rank under ZeRO-0/1/2, and Newton-Schulz time per-head vs whole-matrix.

Memory (``--world`` gloo ranks on CPU, data parallel): for each ``zero`` level the script builds the model on every
rank, runs one forward/backward on a small batch with a post-accumulate-grad hook per "chunk" (one per layer, plus
the rest) that calls ``optimizer.reduce_chunk_grads`` as the pipeline runner does, then ``step``. It reports, per
rank, bytes MEASURED from the live tensors:
    params        parameter storage
    grads peak    the largest gradient memory seen at any chunk boundary during backward (incl. in-flight buckets)
    grads held    gradient memory held after the step's reductions (before ``zero_grad``)
    optim state   momenta, Adam moments, fp32 masters (``optimizer.state_bytes()``)
Model: ``--model standin`` (a stack of layers with K3-like parameter kinds and ratios: per-head q/k/v, output
projection, router, latent down/up, stacked experts ``[E, l, f]``; sizes from the flags) or ``--model k3`` with
``--config`` (``k3train.model.K3Model``; needs the model package).

Newton-Schulz: for each ``--ns-shapes`` entry ``H,dh,in`` times the batched per-head call on ``[H, dh, in]`` against
the whole-matrix call on ``[H*dh, in]`` (best of ``--repeats``), with the nominal FLOP ratio next to it.

Example: ``python benchmarks/bench_optim.py --world 2 --ns-shapes 16,128,2048 32,128,4096``.
A tool, not a test: timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3train.config import OptimConfig  # noqa: E402
from k3train.data.batch import Batch  # noqa: E402
from k3train.model.model import K3Model  # noqa: E402
from k3train.preflight import validate_run  # noqa: E402
from k3train.optim import build_optimizer  # noqa: E402
from k3train.optim.newton_schulz import newton_schulz, ns_flops  # noqa: E402
from k3train.optim.param_groups import mark_per_head  # noqa: E402
from k3train.runtime.local_workers import WorkerFailure, run_ranks  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402

MiB = 2 ** 20


# --------------------------------------------------------------------------------------------------------------
# stand-in model
class StandInLayer(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int, experts: int, latent: int, ffn: int):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, heads * head_dim, bias=False)
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            mark_per_head(lin.weight, heads)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.router = nn.Linear(d, experts, bias=False)
        self.latent_down = nn.Linear(d, latent, bias=False)
        self.latent_up = nn.Linear(latent, d, bias=False)
        self.w_gate = nn.Parameter(torch.randn(experts, latent, ffn) * latent ** -0.5)
        self.w_up = nn.Parameter(torch.randn(experts, latent, ffn) * latent ** -0.5)
        self.w_down = nn.Parameter(torch.randn(experts, ffn, latent) * ffn ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.attn_norm
        x = x + self.o_proj(torch.sigmoid(self.q_proj(h)) * self.k_proj(h) * self.v_proj(h))  # token-local
        gates = self.router(x).softmax(-1)                                                     # [N, E]
        z = self.latent_down(x)
        a = torch.einsum("nl,elf->nef", z, self.w_gate)
        b = torch.einsum("nl,elf->nef", z, self.w_up)
        y = torch.einsum("nef,efl,ne->nl", nn.functional.silu(a) * b, self.w_down, gates)
        return x + self.latent_up(y)


class StandIn(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, head_dim: int, experts: int, latent: int,
                 ffn: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(StandInLayer(d, heads, head_dim, experts, latent, ffn) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens[:-1])
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.lm_head(x * self.norm), tokens[1:], reduction="sum")


def standin_factory(a: argparse.Namespace) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor], Any]:
    torch.manual_seed(0)
    m = StandIn(a.vocab, a.hidden, a.layers, a.heads, a.head_dim, a.experts, a.latent, a.ffn)

    def loss_fn(model: nn.Module, seed: int) -> torch.Tensor:
        toks = torch.randint(0, a.vocab, (a.tokens + 1,), generator=torch.Generator().manual_seed(seed))
        return model.loss(toks)
    return m, loss_fn, OptimConfig()


def k3_factory(a: argparse.Namespace) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor], Any]:
    cfg = validate_run(a.config, [], world_size=a.world, for_training=False)  # the run-config checks; no data read
    m = K3Model(cfg.model, cfg.vision)
    m.init_weights(cfg.train.seed)

    def loss_fn(model: nn.Module, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        samples = torch.randint(3, cfg.model.vocab_size, (1, a.tokens + 1), generator=g)
        return model(Batch.from_samples(samples, eos_id=cfg.model.eos_token_id, pad_id=cfg.model.pad_token_id))["loss"]
    return m, loss_fn, cfg.optim


# --------------------------------------------------------------------------------------------------------------
# memory on gloo ranks
def _chunks(model: nn.Module) -> list[list[nn.Parameter]]:
    """One chunk per layer, plus one per remaining top-level child or parameter (embedding, head, norms): each is
    reduced as soon as its own gradients are final, as a pipeline runner would for its chunks."""
    out = []
    for name, child in model.named_children():
        if name == "layers":
            out += [[p for p in layer.parameters() if p.requires_grad] for layer in child.children()]
        else:
            out.append([p for p in child.parameters() if p.requires_grad])
    out += [[p] for _, p in model.named_parameters(recurse=False) if p.requires_grad]
    return [c for c in out if c]


def _measure(rank: int, world: int, a: argparse.Namespace) -> list | None:
    """One gloo rank of :func:`bench_memory`: every rank's bytes per zero level, gathered on rank 0 (which returns
    them)."""
    dims = ParallelDims(dp=world, world_size=world, rank=rank).build_groups()
    factory = k3_factory if a.model == "k3" else standin_factory
    rows = []
    for zero in (0, 1, 2):
        model, loss_fn, ocfg = factory(a)
        ocfg.qk_clip_threshold = 0.0
        opt = build_optimizer(model, ocfg, dims, zero=zero, grad_clip=1.0, log_table=False)
        peak = [0]
        hooks = []
        for chunk in _chunks(model):
            left = {"n": len(chunk)}

            def on_grad(p: torch.Tensor, chunk=chunk, left=left, opt=opt) -> None:
                left["n"] -= 1
                peak[0] = max(peak[0], opt.grad_bytes())
                if left["n"] == 0:  # the chunk's gradients are final: what the pipeline runner signals
                    opt.reduce_chunk_grads(chunk)
                    peak[0] = max(peak[0], opt.grad_bytes())
            for p in chunk:
                hooks.append(p.register_post_accumulate_grad_hook(on_grad))
        loss_fn(model, 1000 + rank).backward()
        opt.step(1e-3)
        held = opt.grad_bytes()
        pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append((zero, pbytes, peak[0], held, opt.state_bytes()))
        for h in hooks:
            h.remove()
        opt.zero_grad()
        del model, opt
    out = [None] * world
    dist.all_gather_object(out, rows)
    return out if rank == 0 else None


def bench_memory(a: argparse.Namespace) -> None:
    try:
        per_rank = run_ranks(_measure, a.world, a, timeout=1800)[0]
    except WorkerFailure as e:
        raise SystemExit(str(e)) from None
    print(f"\nmemory per rank, {a.world} gloo ranks, model={a.model} (MiB, measured from tensors)")
    print(f"{'zero':>4} {'rank':>4} {'params':>9} {'grads peak':>11} {'grads held':>11} {'optim state':>12}"
          f" {'state/zero0':>12}")
    base = {r: per_rank[r][0][4] for r in range(a.world)}
    for zi in range(3):
        for r in range(a.world):
            zero, pb, gp, gh, sb = per_rank[r][zi]
            print(f"{zero:>4} {r:>4} {pb / MiB:>9.1f} {gp / MiB:>11.1f} {gh / MiB:>11.1f} {sb / MiB:>12.1f}"
                  f" {sb / max(1, base[r]):>12.3f}")


# --------------------------------------------------------------------------------------------------------------
def _time(fn: Callable[[], Any], repeats: int, device: str) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # first run warms up
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def bench_ns(a: argparse.Namespace) -> None:
    dev = a.device
    print(f"\nNewton-Schulz, {a.ns_steps} steps, {a.ns_dtype}, device={dev} (best of {a.repeats})")
    print(f"{'H,dh,in':>16} {'per-head ms':>12} {'whole ms':>10} {'time ratio':>11} {'FLOP ratio':>11}")
    for spec in a.ns_shapes:
        h, dh, n_in = (int(x) for x in spec.split(","))
        g = torch.randn(h * dh, n_in, device=dev)
        t_head = _time(lambda: newton_schulz(g.view(h, dh, n_in), a.ns_steps, a.ns_dtype), a.repeats, dev)
        t_whole = _time(lambda: newton_schulz(g, a.ns_steps, a.ns_dtype), a.repeats, dev)
        fr = ns_flops((h * dh, n_in), a.ns_steps) / ns_flops((h, dh, n_in), a.ns_steps)
        print(f"{spec:>16} {t_head * 1e3:>12.2f} {t_whole * 1e3:>10.2f} {t_whole / t_head:>10.1f}x {fr:>10.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("standin", "k3"), default="standin")
    ap.add_argument("--config", default="configs/tiny.yaml", help="for --model k3")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank for the forward/backward")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--ns-shapes", nargs="*", default=["16,128,2048"], help="H,head_dim,in per entry")
    ap.add_argument("--ns-steps", type=int, default=5)
    ap.add_argument("--ns-dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-ns", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if not a.skip_memory:
        bench_memory(a)
    if not a.skip_ns:
        bench_ns(a)


if __name__ == "__main__":
    main()
