"""Prove k3train's CUDA path on a lent GPU in one command (designed for at most 8 minutes on one H200):

    .venv/bin/python tools/gpu_check.py [--out gpu_check.json] [--total-s 490]

Each section runs in its own process with a time budget, so a Triton compile that stalls, a CUDA error or a crash
is recorded (error text, or "timed out after N s", with the cases it finished) and the other sections still run.
In this order:

  train    a few steps of configs/tiny.yaml and configs/small.yaml through the real Trainer in one process:
           CUDA bf16 vs CPU fp32 (the same init and data) -- losses, tokens/s, MFU, the kernels chosen (KDA through
           k3train's torch op, so the CUDA training path is proven apart from fla)
  mla      FlexAttention (k3train/ops/mla_flex.py) and the blockwise op vs the dense reference, bf16 and fp32;
           fwd+bwd speed at T = 4K
  experts  ``torch._grouped_mm`` experts (bf16) vs the per-expert loop (fp32)
  memory   tools/memory.py's estimate for small (1 GPU, bf16) vs ``torch.cuda.max_memory_allocated`` of real steps
  kda      the first-call cost of fla ``chunk_kda`` (compilation + autotuning) beside k3train's op; fla vs k3train's
           ``chunk_kda`` (k3train/ops/kda_fla.py): bf16 and fp32 outputs, final states and gradients (max abs /
           max rel / rel rms), fwd+bwd speed ratio at T = 4K and 16K
  tests    ``pytest -m cuda tests/gpu`` (the CUDA-marked tests; fla's entry-point training run among them)

Runs so far (docs/gpu.md; the numbers in benchmarks/results/gpu_check.md): 2026-12-04, H200, torch 2.11 +
triton 3.6 + fla 0.6.0.

The JSON report (``--out``, also printed) holds the device, versions, every section's result or error and time,
and the list of what one GPU cannot check. On a machine without CUDA it prints one line and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from gpu_cases import (experts_compare, kda_compare, kda_first_call, kda_speed, mla_compare,  # noqa: E402
                       mla_speed, small_corpus)
from k3train.model.kernels import Installed, Target, choose_kernels, describe_kernels  # noqa: E402
from k3train.preflight import validate_run  # noqa: E402
from k3train.trainer import Trainer  # noqa: E402

# seconds per section (its process, start-up included; first calls compile: fla's Triton autotuning, FlexAttention
# through torch.compile -- on-disk caches, autotuning results included (TRITON_CACHE_AUTOTUNING), make later
# sections' compiles faster); the sum is --total-s (490), under the 8 minutes with the driver's start-up. Sections
# run in this order, the most informative first; fla's KDA last but the tests, since on the first H200 runs its
# first call did not end within 130 s (the kda section, the fla training steps and the fla test all timed out).
BUDGET_S = {"train": 100, "mla": 75, "experts": 10, "memory": 75, "kda": 150, "tests": 60}
NOT_CHECKABLE_ON_ONE_GPU = [
    "NCCL collectives across GPUs (process groups, collective timeout, async error handling): needs >= 2 GPUs",
    "multi-rank parallelism on CUDA: data parallel / ZeRO, pipeline (p2p over NCCL), expert parallel "
    "(MoonEP all-to-all), KDA context parallel (KCP) and MLA context parallel (latent all-gather)",
    "inter-node bandwidth and the planner's multi-GPU cost model",
]


# ----------------------------------------------------------------------------------------------------------------
# Sections (each runs in a child process: `gpu_check.py --section NAME --section-out FILE`)
# ----------------------------------------------------------------------------------------------------------------
_SECTION_OUT: list[str] = []  # the child's --section-out; a section saves what it has after every case


def _save(out: dict[str, Any]) -> dict[str, Any]:
    """Write a section's results so far to its --section-out (a section killed at its budget keeps them)."""
    if _SECTION_OUT:
        Path(_SECTION_OUT[0]).write_text(json.dumps(out, default=str))
    return out


def _timed(fn: Callable[..., dict[str, Any]], *args: Any, **kw: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = fn(*args, **kw)
    res["seconds"] = round(time.perf_counter() - t0, 1)  # first calls include compilation and autotuning
    return res


def _add(out: dict[str, Any], key: str, fn: Callable[..., dict[str, Any]], *args: Any, **kw: Any) -> None:
    """Run one case, append its (timed) result to ``out[key]`` and save the section's results so far."""
    out[key].append(_timed(fn, *args, **kw))
    _save(out)


def section_kda() -> dict[str, Any]:
    if importlib.util.find_spec("fla") is None:
        return {"skipped": "flash-linear-attention is not installed (pip install k3train[gpu])"}
    # each case saved as it finishes. The first H200 run (torch 2.11, triton 3.6, fla 0.6.0) never finished fla's
    # first bf16 call in 130 s (nor did the fla training steps or test), so its cost comes first, timed alone
    # beside the torch op's: the first call compiles and autotunes every fla kernel
    out: dict[str, Any] = {"first_calls": [], "compare": [], "speed": []}
    _add(out, "first_calls", kda_first_call, "torch", torch.bfloat16)
    _add(out, "first_calls", kda_first_call, "fla", torch.bfloat16)
    _add(out, "compare", kda_compare, torch.bfloat16, T=2048, H=4, K=128)
    _add(out, "speed", kda_speed, 4096, H=16, K=128)
    _add(out, "compare", kda_compare, torch.float32, T=2048, H=4, K=128)
    _add(out, "speed", kda_speed, 16384, H=16, K=128)
    out["ok"] = all(c["ok"] for c in out["compare"])
    return out


def section_mla() -> dict[str, Any]:
    out: dict[str, Any] = {"compare": [], "speed": []}
    for dt in (torch.bfloat16, torch.float32):
        _add(out, "compare", mla_compare, dt, T=2048, H=8)
    _add(out, "speed", mla_speed, 4096, H=16)
    out["ok"] = all(c["flex"]["ok"] and (c.get("blockwise", {}).get("ok", True)
                                         if isinstance(c.get("blockwise"), dict) else True) for c in out["compare"])
    return out


def section_experts() -> dict[str, Any]:
    if torch.cuda.get_device_capability() < (9, 0):
        return {"skipped": f"torch._grouped_mm's CUDA kernel needs sm90+, this GPU is sm"
                           f"{''.join(map(str, torch.cuda.get_device_capability()))}"}
    return experts_compare(E=16, N=4096, l_dim=256, f_dim=512)


def _train_steps(config: str, device: str, dtype: str, steps: int, data: str, out_dir: str,
                 extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``steps`` optimizer steps of ``config`` through the real Trainer in this process (``extra``: overrides)."""
    overrides = [f"--train.device={device}", f"--train.dtype={dtype}", f"--train.steps={steps}",
                 f"--train.out_dir={out_dir}", f"--data.path={data}", "--data.split=100,0,0", "--logging.wandb=false",
                 "--train.eval_interval=0", "--checkpoint.resume=none", *extra]
    if device == "cpu":
        overrides.append(f"--train.num_threads={os.cpu_count() or 1}")
    cfg = validate_run(str(ROOT / config), overrides, 1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg)
    try:
        recs = [trainer.train_step() for _ in range(steps)]
        kernels = describe_kernels(trainer.kernels)
    finally:
        trainer.close()
    keep = ("step", "loss", "grad_norm", "tokens_per_s", "mfu", "mem_gib", "step_time_s")
    later = recs[1:] or recs  # step 1 includes compilation and autotuning
    return {"device": device, "dtype": dtype, "steps": [{k: r.get(k) for k in keep} for r in recs],
            "tokens_per_s": sorted(r["tokens_per_s"] for r in later)[len(later) // 2],
            "mfu": sorted(r["mfu"] for r in later)[len(later) // 2], "peak_flops": trainer.peak_flops,
            "kernels": kernels}


def section_train() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="k3_gpu_check_") as tmp:
        data = small_corpus(os.path.join(tmp, "data"))
        for name, steps in (("tiny", 4), ("small", 3)):
            res: dict[str, Any] = {}
            out[name] = res
            try:
                # KDA through k3train's torch op here: this section proves the CUDA training path (batches on the
                # device, flex MLA, grouped_mm experts, Muon, the loss) apart from fla's first-call cost, which the
                # kda section times and the tests section's entry-point run pays
                res["cuda_bf16"] = _timed(_train_steps, f"configs/{name}.yaml", "cuda", "bfloat16", steps, data,
                                          os.path.join(tmp, f"{name}_cuda"), ("--train.kda_kernel=torch",))
                _save(out)
                res["cpu_fp32"] = _timed(_train_steps, f"configs/{name}.yaml", "cpu", "float32", steps, data,
                                         os.path.join(tmp, f"{name}_cpu"))
                g, c = res["cuda_bf16"]["steps"], res["cpu_fp32"]["steps"]
                rel = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(g, c)]
                # step 1 is the same model on the same batch: only bf16 rounding differs; later steps add the
                # updates' divergence, bounded loosely
                res["loss_rel_diff"] = rel
                res["ok"] = rel[0] <= 2e-2 and max(rel) <= 5e-2
            except Exception:  # noqa: BLE001 - recorded; the next config still runs
                res["error"] = traceback.format_exc(limit=8)
                res["ok"] = False
            _save(out)
    out["ok"] = all(out[n]["ok"] for n in ("tiny", "small"))
    return out


def section_memory(timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="k3_gpu_check_mem_") as tmp:
        data = small_corpus(os.path.join(tmp, "data"))
        cmd = [sys.executable, str(ROOT / "tools/memory.py"), "--config", str(ROOT / "configs/small.yaml"),
               "--world-size", "1", "--train.device=cuda", "--train.dtype=bfloat16", f"--data.path={data}",
               "--data.split=100,0,0", "--train.kda_kernel=torch", "--measure", "--steps", "3", "--json"]
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:  # what it printed so far says which phase was still running
            err_out = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            return {"error": f"tools/memory.py timed out after {timeout_s:.0f} s", "stderr_tail": err_out[-3000:],
                    "ok": False}
    if p.returncode != 0:
        return {"error": f"tools/memory.py exited {p.returncode}: {p.stderr[-3000:]}", "ok": False}
    rep = json.loads(p.stdout[p.stdout.index("{"):])
    rank = rep["ranks"][0]
    est, meas = rank.get("peak"), rank.get("measured_peak")
    out = {"estimated_peak_gib": est / 2**30 if est else None, "measured_max_allocated_gib": meas / 2**30 if meas
           else None, "command": " ".join(cmd[1:])}
    if est and meas:
        out["estimate_over_measured"] = est / meas
        out["ok"] = 0.8 <= est / meas <= 1.25
    return out


def section_tests(timeout_s: float) -> dict[str, Any]:
    # -v: one line per test as it ends, into a file, so a run stopped at its budget still says which tests passed
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/gpu", "-v", "-p", "no:cacheprovider",
           "-o", "addopts=", "-rs", f"--timeout={int(timeout_s)}"]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        try:
            rc: int | str = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout_s:.0f} s"
        log.seek(0)
        text = log.read()
    results = [f"{m.group(1)} {m.group(2)}" for m in re.finditer(r"^\S*::(\S+) (PASSED|FAILED|SKIPPED|ERROR)", text,
                                                                   re.MULTILINE)]
    summary = next((ln for ln in reversed(text.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln
                                                                                  or "skipped" in ln)), "")
    return {"returncode": rc, "summary": summary.strip("= "), "tests": results, "output_tail": text[-4000:],
            "ok": rc == 0}


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "train": section_train, "mla": section_mla, "experts": section_experts, "memory": section_memory,
    "kda": section_kda, "tests": section_tests,
}
TAKES_TIMEOUT = ("memory", "tests")


# ----------------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("flash-linear-attention", "triton"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _run_child(name: str, budget_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--section-out", path,
           "--section-timeout", str(max(1.0, budget_s - 15))]
    # its own process group, so a timeout also ends what it started (pytest's training runs, torchrun)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=budget_s)
        text = Path(path).read_text() if Path(path).stat().st_size else ""
        if text:
            res = json.loads(text)
        else:
            res = {"error": f"section process exited {proc.returncode} without a result: {stderr[-3000:]}"}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        text = Path(path).read_text() if Path(path).stat().st_size else ""
        res = json.loads(text) if text else {}  # the cases it finished (sections save as they go)
        res.update(error=f"timed out after {budget_s:.0f} s (its budget); results of the cases it finished kept",
                   stderr_tail=(stderr or "")[-2000:])
    finally:
        Path(path).unlink(missing_ok=True)
    res.setdefault("ok", False if "error" in res else None)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["budget_s"] = budget_s
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json", help="the JSON report (default: gpu_check.json)")
    ap.add_argument("--total-s", type=float, default=490.0, help="wall-clock limit of the whole check")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--section-out", help=argparse.SUPPRESS)
    ap.add_argument("--section-timeout", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check, no report "
              "written")
        return 0

    if args.section:  # child: one section, its result (or the error) to --section-out
        os.environ.setdefault("WANDB_MODE", "disabled")
        _SECTION_OUT.append(args.section_out)
        try:
            fn = SECTIONS[args.section]
            res = fn(args.section_timeout) if args.section in TAKES_TIMEOUT else fn()
        except Exception:  # noqa: BLE001 - the report carries the error text
            res = {"error": traceback.format_exc(limit=12), "ok": False}
        Path(args.section_out).write_text(json.dumps(res, default=str))
        return 0

    t_start = time.perf_counter()
    # the sections' CPU reference runs measure a CPU peak for MFU: into a cache of this check's own, never the
    # user's ~/.cache/k3train (a reading taken beside the GPU work would be low)
    os.environ["K3TRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="k3_gpu_check_cache_")
    # Triton keeps autotuning results on disk beside the compiled kernels: a later section (and the tests) reuse
    # what an earlier one tuned instead of benchmarking every config again
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
        "device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "cpu_cores": os.cpu_count(), "versions": _versions(), "sections": {},
        "not_checkable_on_one_gpu": NOT_CHECKABLE_ON_ONE_GPU,
    }
    cap = tuple(torch.cuda.get_device_capability(0))
    report["kernels_bf16"] = describe_kernels(choose_kernels({}, Target("cuda", "bfloat16", cap), Installed.probe()))
    only = [s for s in args.only.split(",") if s] or list(SECTIONS)
    for name in SECTIONS:
        if name not in only:
            continue
        left = args.total_s - (time.perf_counter() - t_start)
        budget = min(BUDGET_S[name], left)
        if budget < 10:
            report["sections"][name] = {"error": "not run: the check's total time was used up", "ok": False}
            continue
        print(f"gpu_check: {name} (budget {budget:.0f} s) ...", file=sys.stderr, flush=True)
        report["sections"][name] = _run_child(name, budget)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")  # so far, if the call is cut
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["ok"] = all(s.get("ok") is not False for s in report["sections"].values())
    text = json.dumps(report, indent=1, default=str)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
