#!/usr/bin/env python
"""MXFP4 QAT benchmark: what quantization-aware training of the routed experts costs in loss and in time.

Two runs of the real trainer (``python -m k3train.train``, one process) from the same initialisation and the same
batches -- ``train.qat=none`` (the experts in the run's dtype) and ``train.qat=mxfp4`` (optionally with
``--activations`` for MXFP8 expert inputs) -- then prints, side by side:

    train loss    mean over the last ``--tail`` steps, and the gap QAT - baseline
    val loss      at the end of training (``train.eval_interval = steps``), and the gap
    step time     median ``step_time_s`` after the first 5 steps, and the overhead of the fake-quant

plus an isolated measurement: one tiny LatentMoE layer's forward + backward with and without QAT, interleaved
(best of ``--repeats``), so the fake-quant's own cost is visible apart from the rest of the step.

Example: ``python benchmarks/bench_qat.py --steps 60 [--train.seq_len=64 ...]`` (minutes on 2 cores). A tool, not a
test: timings on a shared machine are noisy; the loss gaps are deterministic for a given machine and config.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from k3train.config import load_config  # noqa: E402
from k3train.model.moe import LatentMoE  # noqa: E402
from k3train.quant.qat import apply_qat  # noqa: E402


def run_trainer(config: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    """One single-process training run; returns its metrics.jsonl records."""
    args = ["--config", config, f"--train.steps={steps}", f"--train.eval_interval={steps}", f"--train.out_dir={out}",
            "--checkpoint.resume=none", "--checkpoint.interval=0", "--logging.wandb=false", "--logging.log_interval=1",
            *extra]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run([sys.executable, "-m", "k3train.train", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise SystemExit(f"training run failed (exit {res.returncode}): {' '.join(args)}\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(recs: list[dict], tail: int) -> dict[str, float]:
    steps = [r for r in recs if "loss" in r]
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    times = [r["step_time_s"] for r in steps[5:]] or [r["step_time_s"] for r in steps]
    return {"train": statistics.fmean(r["loss"] for r in steps[-tail:]), "val": val[-1] if val else float("nan"),
            "step_s": statistics.median(times), "first": steps[0]["loss"]}


def layer_overhead(config: str, repeats: int, tokens: int, activations: str) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of one LatentMoE forward + backward without and with QAT (fp32, CPU)."""
    cfg = load_config(config, []).model
    torch.manual_seed(0)
    plain = LatentMoE(cfg)
    qat = copy.deepcopy(plain)
    apply_qat([qat], "mxfp4", activations)
    x = torch.randn(tokens, cfg.hidden_size)
    best = {id(plain): float("inf"), id(qat): float("inf")}
    for _ in range(repeats):
        for m in (plain, qat):  # interleaved: the machine's drift hits both
            xi = x.clone().requires_grad_(True)
            t0 = time.perf_counter()
            m(xi).square().mean().backward()
            best[id(m)] = min(best[id(m)], time.perf_counter() - t0)
            m.zero_grad(set_to_none=True)
    return best[id(plain)], best[id(qat)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tail", type=int, default=10, help="train loss: mean over the last N steps")
    ap.add_argument("--activations", choices=["none", "mxfp8"], default="none", help="train.qat_activations")
    ap.add_argument("--repeats", type=int, default=20, help="isolated layer timing: best of N")
    ap.add_argument("--tokens", type=int, default=512, help="isolated layer timing: tokens per call")
    a, overrides = ap.parse_known_args()  # the rest: --section.key=value overrides for both runs
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (overrides are --section.key=value)")

    common = ["--train.device=cpu", "--data.split=98,2,0", "--train.eval_iters=10", *overrides]
    res = {}
    with tempfile.TemporaryDirectory(prefix="k3train-bench-qat-") as tmp:
        for name, extra in (("baseline", ["--train.qat=none"]),
                            ("mxfp4-qat", ["--train.qat=mxfp4", f"--train.qat_activations={a.activations}"])):
            t0 = time.perf_counter()
            res[name] = summarize(run_trainer(a.config, a.steps, Path(tmp) / name, common + extra), a.tail)
            print(f"# {name}: {a.steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    b, q = res["baseline"], res["mxfp4-qat"]
    print(f"config {a.config}, {a.steps} steps, one process, {torch.get_num_threads()} thread(s); "
          f"experts mxfp4{' + mxfp8 inputs' if a.activations != 'none' else ''} vs the run's dtype")
    print(f"{'':12s} {'baseline':>10s} {'mxfp4-qat':>10s} {'gap':>10s}")
    print(f"{'step-1 loss':12s} {b['first']:10.4f} {q['first']:10.4f} {q['first'] - b['first']:+10.4f}")
    print(f"{'train loss':12s} {b['train']:10.4f} {q['train']:10.4f} {q['train'] - b['train']:+10.4f}"
          f"   (mean of the last {a.tail} steps)")
    print(f"{'val loss':12s} {b['val']:10.4f} {q['val']:10.4f} {q['val'] - b['val']:+10.4f}   (after step {a.steps})")
    print(f"{'step time s':12s} {b['step_s']:10.4f} {q['step_s']:10.4f} {q['step_s'] / b['step_s'] - 1:+10.1%}"
          f"   (median after step 5)")
    t_plain, t_qat = layer_overhead(a.config, a.repeats, a.tokens, a.activations)
    print(f"one LatentMoE layer fwd+bwd, {a.tokens} tokens: {t_plain * 1e3:.2f} ms -> {t_qat * 1e3:.2f} ms with QAT "
          f"({t_qat / t_plain - 1:+.1%}, best of {a.repeats})")


if __name__ == "__main__":
    main()
