#!/usr/bin/env python
"""Time and peak memory per rank of the Hugging Face export and import (k3train/hf), and the estimate for K3.

    python benchmarks/bench_hf.py [--config configs/small.yaml] [--nproc 2] [--layout "--parallel.pp=2"]
                             [--k3-config configs/k3.yaml] [--k3-layout "--parallel.pp=16 ..."] [--json]

1. export: ``--nproc`` ranks (torchrun) build the config's model in ``--layout`` (name-seeded init) and write it in
   the published layout (k3train/hf/export.py: every rank its own tensors) -- per rank: seconds, bytes written,
   RSS before (the built model) and peak RSS;
2. import: the same ranks build the model again and load that checkpoint (k3train/hf/load.py: each rank its own
   tensors, expert rows by slice) -- per rank: seconds, bytes read, RSS before and peak;
3. K3 on its planned layout (the planner's reference recipe, docs/huggingface.md): from the model's tensor plan and
   the pipeline partition, the bytes each pipeline rank reads (published dtypes: bf16, fp32 for A_log / dt_bias /
   convs / router, MXFP4 routed experts) and writes, the largest transient one tensor's conversion needs, and the
   time at the import throughput measured in step 2 (a page-cache rate on this machine: a lower bound where the
   checkpoint sits on a network file system).

``configs/small.yaml``'s shared expert (1024 wide, one of them) has no published form (the published shared MLP is
``num_shared_experts x moe_intermediate_size`` = 384): the tool overrides it to 384 unless told otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3train.config import load_config  # noqa: E402
from k3train.hf.export import FP32_KEYS, write_hf_shards  # noqa: E402
from k3train.hf.load import load_hf_weights  # noqa: E402
from k3train.hf.names import PerExpert, PerExpertMXFP4, model_slots  # noqa: E402
from k3train.parallelize import parallelize  # noqa: E402
from k3train.runtime.process_groups import child_pythonpath, init_distributed, shutdown  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.pipeline.partition import build_partition  # noqa: E402

K3_LAYOUT = ("--parallel.pp=16 --parallel.vpp=2 --parallel.dp=128 --parallel.ep=64 --parallel.moonep=true "
             "--parallel.zero=2 --train.seq_len=4096 --train.global_batch_size=4096 --train.micro_batch_size=1")
SMALL_FIX = ["--model.shared_expert_intermediate_size=384"]


def _rss_now_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def rank_phase(a: argparse.Namespace) -> int:
    """One rank of the export or import phase (under torchrun): prints rank 0's JSON of every rank's stats."""
    over = shlex.split(a.layout) + a.overrides + ["--train.device=cpu", "--logging.wandb=false"]
    if a.phase == "import":
        over.append(f"--checkpoint.load_hf={a.hf_dir}")
    cfg = load_config(a.config, over, int(os.environ["WORLD_SIZE"]))
    env = init_distributed("gloo", "cpu", 0.0, 1)
    dims = ParallelDims.from_config(cfg.parallel, env.world_size, env.rank).build_groups()
    pm = parallelize(cfg, dims, env.device)
    dist.barrier()
    before = _rss_now_gib()
    if a.phase == "export":
        stats = write_hf_shards(pm.modules, cfg, a.hf_dir, dims=dims, skip=pm.runner.replica_params,
                                experts="bf16", dtype=torch.bfloat16)
    else:
        stats = load_hf_weights(pm.modules, cfg)
    stats["rss_before_gib"] = before
    every = [None] * env.world_size
    dist.all_gather_object(every, stats)
    if env.rank == 0:
        print("BENCH_HF " + json.dumps(every), flush=True)
    shutdown()
    return 0


def run_phase(phase: str, a: argparse.Namespace, hf_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           str(Path(__file__).resolve()), "--phase", phase, "--config", a.config, f"--layout={a.layout}",
           "--hf-dir", str(hf_dir), *a.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(ROOT)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("BENCH_HF ")), None)
    if res.returncode != 0 or line is None:
        raise SystemExit(f"bench_hf: the {phase} phase failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(line[len("BENCH_HF "):])


def k3_estimate(config: str, layout: str, import_bytes_per_s: float, max_shard_bytes: int = 5 * 2 ** 30) -> dict:
    """Per pipeline rank of ``config`` in ``layout``: bytes read at import and written at export, the largest
    one-tensor transient, and the import time at ``import_bytes_per_s`` (no model is built: meta shapes only)."""
    over = shlex.split(layout)
    world = 1
    for k in ("pp", "dp", "cp"):
        v = next((x.split("=")[1] for x in over if x.startswith(f"--parallel.{k}=")), "1")
        world *= int(v)
    cfg = load_config(config, over, world)
    p = cfg.parallel
    part = build_partition(cfg.model, p, cfg.train.seq_len)
    owner_of_layer = {}
    for v, (s, e) in enumerate(part.bounds):
        for i in range(s, e):
            owner_of_layer[i] = part.rank_of(v)
    rows = {r: {"read": 0, "dense": 0, "experts": 0, "transient": 0} for r in range(p.pp)}
    for slot in model_slots(cfg):
        head = slot.fqn.split(".")[0]
        if head == "layers":
            ranks = [owner_of_layer[int(slot.fqn.split(".")[1])]]
        elif head in ("embed_tokens", "vision"):
            ranks = [0] + ([p.pp - 1] if head == "embed_tokens" and cfg.model.num_nextn_predict_layers else [])
        else:
            ranks = [p.pp - 1]
        if slot.expert:
            src = next(s for s in slot.sources if isinstance(s, PerExpertMXFP4)) if \
                any(isinstance(s, PerExpertMXFP4) for s in slot.sources) else \
                next(s for s in slot.sources if isinstance(s, PerExpert))
            stored = sum(_numel(q.shape) for q in src.parts) * (1 if isinstance(src, PerExpertMXFP4) else 2)
            local = stored // p.ep
            fp32 = _numel(slot.shape) * 4 // p.ep
        else:
            src = slot.sources[0]
            local = sum(_numel(q.shape) * (4 if FP32_KEYS.search(q.key) else 2) for q in src.parts)
            fp32 = _numel(slot.shape) * 4
        for r in ranks:
            row = rows[r]
            row["read"] += local
            row["experts" if slot.expert else "dense"] += local
            row["transient"] = max(row["transient"], local + fp32)
    dpcp = p.dp * p.cp
    edp = dpcp // p.ep
    out = []
    for r, row in rows.items():
        written = row["dense"] / dpcp + row["experts"] / edp  # the replicas of a stage share the writing
        out.append({"pp_rank": r, "read_gib": row["read"] / 2 ** 30, "written_gib": written / 2 ** 30,
                    "transient_gib": row["transient"] / 2 ** 30,
                    "export_peak_extra_gib": (min(max_shard_bytes, written) + row["transient"]) / 2 ** 30,
                    "import_s": row["read"] / import_bytes_per_s})
    return {"layout": layout, "world": world, "per_pp_rank": out}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "small.yaml"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layout", default="--parallel.pp=2")
    ap.add_argument("--k3-config", default=str(ROOT / "configs" / "k3.yaml"))
    ap.add_argument("--k3-layout", default=K3_LAYOUT)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--phase", choices=("export", "import"), help=argparse.SUPPRESS)
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args(argv)
    a.overrides = rest or (SMALL_FIX if a.config.endswith("small.yaml") else [])
    if a.phase:
        return rank_phase(a)
    with tempfile.TemporaryDirectory(prefix="k3train-bench-hf-") as tmp:
        hf_dir = Path(tmp) / "hf"
        hf_dir.mkdir()
        exp = run_phase("export", a, hf_dir)
        imp = run_phase("import", a, hf_dir)
    rate = min(s["bytes_read"] / s["seconds"] for s in imp)
    k3 = k3_estimate(a.k3_config, a.k3_layout, rate)
    res = {"config": a.config, "layout": a.layout, "nproc": a.nproc, "export": exp, "import": imp, "k3": k3,
           "load_average": os.getloadavg()[0]}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{Path(a.config).name} {a.overrides} in {a.layout} on {a.nproc} ranks (1-min load average "
          f"{res['load_average']:.1f} on {os.cpu_count()} cores)")
    for phase, rows, key in (("export", exp, "bytes_written"), ("import", imp, "bytes_read")):
        for r, s in enumerate(rows):
            print(f"  {phase} rank {r}: {s['seconds']:.2f} s, {s[key] / 2 ** 20:.1f} MiB "
                  f"{'written' if phase == 'export' else 'read'}, RSS {s['rss_before_gib']:.2f} GiB before, peak "
                  f"{s['peak_rss_gib']:.2f} GiB")
    print(f"K3 ({Path(a.k3_config).name}) on {k3['world']} ranks: {a.k3_layout}")
    print(f"  import at the measured {rate / 2 ** 20:.0f} MiB/s per rank; per pipeline rank (every dp/ep rank of "
          f"a stage alike):")
    for row in k3["per_pp_rank"]:
        print(f"  pp rank {row['pp_rank']:2d}: reads {row['read_gib']:6.1f} GiB (~{row['import_s']:5.0f} s), "
              f"largest one-tensor transient {row['transient_gib']:5.2f} GiB; export writes "
              f"{row['written_gib'] * 1024:6.0f} MiB, extra peak <= {row['export_peak_extra_gib']:5.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
