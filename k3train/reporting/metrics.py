"""Per-step metrics: ``metrics.jsonl`` in the run directory, a compact live line on rank 0, optional wandb.

``metrics.jsonl`` holds one JSON object per optimizer step with at least ``step, loss, lr, grad_norm,
tokens_per_s, step_time_s, mfu, mem_gib`` plus whatever the parallel runtimes add (``p2p_bytes``, MoE load...).
"""
from __future__ import annotations

import json
import logging
import math
import os
import resource
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from k3train.reporting.device_peaks import published_bf16_peak
from k3train.runtime.cache_dir import cache_dir

log = logging.getLogger(__name__)


def measure_peak_flops(device: torch.device, seconds: float = 0.3, n: int = 1024) -> float:
    """Achieved fp32 matmul FLOP/s of this process on ``device`` -- the default MFU denominator when
    ``logging.peak_flops`` is 0 (a measured peak is honest on CPUs whose spec sheet we do not know)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def peak_flops_cache_path(device: torch.device) -> Path:
    """``<cache_dir>/peak_flops-<host>.json`` (:func:`k3train.runtime.cache_dir.cache_dir`): one file per machine."""
    return cache_dir() / f"peak_flops-{socket.gethostname()}.json"


def _device_key(device: torch.device) -> str:
    """What the measured peak depends on: the device model, and on CPU the intra-op threads of a rank."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{torch.get_num_threads()}threads"


def resolve_peak_flops(configured: float, device: torch.device) -> tuple[float, str]:
    """The MFU denominator (FLOP/s per rank) and where it came from: ``logging.peak_flops`` when set, on a GPU
    named in ``k3train.reporting.device_peaks.CUDA_BF16_PEAKS`` (H100 / H200 / B200 / GB200 / GB300) its published
    dense bf16 peak, else the BEST of every measurement (:func:`measure_peak_flops`, 0.3 s per start) on this host
    and device kind, kept in :func:`peak_flops_cache_path`. A peak is a maximum: a measurement taken while other work shares the cores
    comes out low (a run started beside a test suite once cached a fifth of the idle figure and every later run
    reported MFU above 100%), so a lower reading never replaces a higher one; the figure settles at the idle
    peak and then stays, so MFU compares between runs. Delete the file to start over (new hardware)."""
    if configured:
        return configured, "logging.peak_flops"
    if device.type == "cuda":  # a known GPU: its published dense bf16 peak, as MFU is quoted in the field
        name = torch.cuda.get_device_name(device)
        found = published_bf16_peak(name)
        if found is not None:
            return found[1], f"published dense bf16 peak of {found[0].upper()} ({name})"
    path, key = peak_flops_cache_path(device), _device_key(device)
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(key) if isinstance(cache, dict) else None
    flops = measure_peak_flops(device)
    if isinstance(entry, dict) and float(entry.get("flops", 0)) >= flops:
        return float(entry["flops"]), f"best measurement ({entry.get('when', '?')}) for {key}, cached in {path}"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = {"flops": flops, "when": when}
    try:  # atomic: ranks measuring at the same time each write a whole file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
        where = f"cached in {path}"
    except OSError as e:
        where = f"not cached: {e}"
    return flops, f"measured now (best so far) for {key}, {where}"


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident set
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


WANDB_ID_FILE = "wandb/k3train_run_id"  # inside the run's wandb dir: moved aside with it by checkpoint.overwrite


def wandb_run_id(out_dir: Path, resumed: bool) -> str:
    """One wandb run per training run: the id is kept in ``<out_dir>/wandb/k3train_run_id``; a resumed run
    continues that wandb run (``resume="allow"``), a new one gets a new id."""
    path = out_dir / WANDB_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if resumed and path.is_file() and path.read_text().strip():
        return path.read_text().strip()

    rid = secrets.token_hex(4)  # wandb ids: 8 lowercase letters/digits, like wandb's own
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(rid + "\n")
    os.replace(tmp, path)
    return rid


class MetricsLogger:
    def __init__(self, out_dir: Path, enabled: bool, wandb_cfg: Any | None, run_config: dict[str, Any],
                 resume_step: int | None = None) -> None:
        """``resume_step``: the step a resumed run continues from; records after it (written before a crash
        that happened after the checkpoint) are dropped so every step appears once."""
        self.enabled = enabled
        self.wandb = None
        self.path = out_dir / "metrics.jsonl"
        self._f = None
        self.tty = sys.stdout.isatty()
        if not enabled:
            return
        if self.path.is_file() and self.path.stat().st_size:
            if resume_step is None:  # resume_preflight refuses such a start; overwrite=true moves the file aside
                raise RuntimeError(f"{self.path} holds another run's records: a new run never truncates them")
            self._keep_until(resume_step)
        self._f = open(self.path, "a")
        if wandb_cfg is not None and wandb_cfg.wandb:
            mode = os.environ.get("WANDB_MODE", wandb_cfg.wandb_mode)
            if mode != "disabled":
                # lazy: wandb takes a second to import; only when wandb logging is on
                import wandb  # imported lazily: it is slow to import and optional at run time

                self.wandb = wandb.init(project=wandb_cfg.wandb_project, mode=mode, dir=str(out_dir),
                                        config=run_config, resume="allow",
                                        id=wandb_run_id(out_dir, resume_step is not None))

    def _keep_until(self, resume_step: int) -> None:
        """Drop the records after ``resume_step`` (logged after the checkpoint by a run that then crashed, and
        a torn last line), replacing the file atomically: a crash here leaves the old file, never a cut one."""
        kept, dropped = [], 0
        for ln in self.path.read_text().splitlines():
            try:
                ok = bool(ln.strip()) and json.loads(ln).get("step", 0) <= resume_step
            except ValueError:
                ok = False
            if ok:
                kept.append(ln)
            elif ln.strip():
                dropped += 1
        if dropped:
            log.info("metrics.jsonl: dropped %d record(s) after the resumed step %d", dropped, resume_step)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(ln + "\n" for ln in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # strict JSON: a skipped step's NaN/inf loss is written as null (json.dumps would write NaN), also inside a
        # list (an EAGLE-3 run's per-step draft_accept)
        def finite(v: Any) -> Any:
            if isinstance(v, list):
                return [finite(x) for x in v]
            return None if isinstance(v, float) and not math.isfinite(v) else v

        strict = {k: finite(v) for k, v in rec.items()}
        self._f.write(json.dumps(strict, allow_nan=False) + "\n")
        self._f.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=rec["step"])

    def progress(self, rec: dict[str, Any], total_steps: int) -> None:
        if not self.enabled:
            return
        line = (f"step {rec['step']:>5}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                f"gnorm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
                f"{rec['step_time_s'] * 1000:.0f} ms | mfu {rec['mfu'] * 100:.1f}% | mem {rec['mem_gib']:.2f} GiB")
        if "p2p_bytes" in rec:
            line += f" | p2p {rec['p2p_bytes'] / 2**20:.1f} MiB"
        if "moe_maxvio" in rec:
            line += f" | maxvio {rec['moe_maxvio']:.2f}"
        if "ep_load_max_over_mean_before" in rec:
            line += (f" | ep load {rec['ep_load_max_over_mean_before']:.2f}->"
                     f"{rec['ep_load_max_over_mean_after']:.2f}")
        if "val_loss" in rec:
            line += f" | val_loss {rec['val_loss']:.4f}"
        for k, name in (("draft_accept_len", "accept len"), ("val_draft_accept_len", "val accept len")):
            if k in rec:  # an EAGLE-3 draft run (k3train/draft/objective.py)
                line += f" | {name} {rec[k]:.3f}"
        if rec.get("skipped"):
            line += " | SKIPPED (non-finite)"
        print(line, flush=True)

    def close(self) -> None:
        """Idempotent (the trainer closes before its run summary, so wandb's own report comes first)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
