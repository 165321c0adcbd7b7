"""``k3train``: one command-line entry point over what exists (installed as a console script by ``pip install -e .``).

    k3train train --config C [--nproc N] [--nnodes M --rdzv-endpoint HOST:PORT ...] [--section.key=value ...]
    k3train check --config C [--world-size N] [overrides]      validate config, layout and data; start nothing
    k3train count --config C [--json]                          parameters by component (tools/count_params.py)
    k3train memory --config C --world-size N [...]             memory per stage and rank (tools/memory.py)
    k3train plan ...                                           parallel layout planner (tools/plan.py)
    k3train prepare-data ...                                   text/JSONL -> indexed dataset (tools/prepare_data.py)
    k3train plot RUN_DIR [RUN_DIR ...] -o FILE.png             curves of runs' metrics.jsonl (k3train/reporting/plot.py)
    k3train import-hf HF_DIR -o RUN.yaml                       a run config from a HF checkpoint (k3train/hf)
    k3train export-hf --config C --checkpoint CKPT -o OUT [--experts auto|bf16|mxfp4] [--nproc N]
                                                               a checkpoint in the published HF layout

``k3train train`` validates the run ONCE here (:func:`k3train.preflight.validate_run` for the whole world size:
``--nproc`` x ``--nnodes``) -- bad input is one ``k3train: error: ...`` line and exit 2 before any process starts --
then runs one rank in this process, or replaces this process with torchrun (``python -m torch.distributed.run``
of this interpreter, so the same virtualenv) running ``-m k3train.train`` on every rank. The older forms
(``python -m k3train.train``, ``torchrun ... -m k3train.train``, ``python tools/X.py``) keep working.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import os
import sys
from pathlib import Path

from k3train.preflight import validate_run
from k3train.reporting.plot import main as plot_main
from k3train.runtime.bad_input import EXIT_BAD_INPUT, OneLineParser, is_bad_input, report_bad_input
from k3train.train import main as train_main
from k3train.train import run_training

ROOT = Path(__file__).resolve().parent.parent  # the repository (an editable install runs from it)

# subcommand -> the tool script whose main(argv) it runs
TOOLS = {"count": "count_params.py", "memory": "memory.py", "plan": "plan.py", "prepare-data": "prepare_data.py"}
USAGE = __doc__.split("\n\n")[1]


def _launcher_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="k3train train", allow_abbrev=False,
                       description="validate once, then train on --nproc x --nnodes processes; every other "
                                   "--section.key=value argument overrides the config")
    ap.add_argument("--config", help="YAML run config (configs/tiny.yaml, ...)")
    ap.add_argument("--nproc", type=int, default=1, help="processes on this node (torchrun --nproc_per_node)")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes (one torchrun agent each)")
    ap.add_argument("--node-rank", type=int, default=None, help="torchrun --node_rank")
    ap.add_argument("--rdzv-backend", default=None, help="torchrun --rdzv_backend (c10d with --rdzv-endpoint)")
    ap.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (node 0)")
    ap.add_argument("--rdzv-id", default=None, help="torchrun --rdzv_id (the same on every node)")
    ap.add_argument("--master-port", type=int, default=None, help="torchrun --master_port (one node, fixed port)")
    ap.add_argument("--max-restarts", type=int, default=None, help="torchrun --max_restarts")
    return ap


def torchrun_command(a: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The torchrun invocation of a validated multi-process run (``-m k3train.train`` on every rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}", f"--nnodes={a.nnodes}"]
    if a.nnodes == 1 and a.rdzv_endpoint is None and a.master_port is None:
        cmd.append("--standalone")
    for flag, v in (("node_rank", a.node_rank), ("rdzv_backend", a.rdzv_backend), ("rdzv_id", a.rdzv_id),
                    ("rdzv_endpoint", a.rdzv_endpoint), ("master_port", a.master_port),
                    ("max_restarts", a.max_restarts)):
        if v is not None:
            cmd.append(f"--{flag}={v}")
    if a.rdzv_endpoint is not None and a.rdzv_backend is None:
        cmd.append("--rdzv_backend=c10d")
    return cmd + ["-m", "k3train.train", "--config", a.config, *overrides]


def gpus_short(cfg, nproc: int) -> str:  # noqa: ANN001 - a validated k3train.config.Config
    """Each rank checks its own GPU (preflight.check_devices); the launcher sees the whole node: one process per
    GPU, so ``--nproc`` may not exceed the visible GPUs. "" when fine (or on CPU)."""
    import torch  # noqa: PLC0415 - lazy: torch is not loaded before the config is checked (validate_run loaded it)

    on_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    n = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and nproc > n:
        return (f"k3train train: --nproc {nproc} processes need {nproc} GPUs (one each) but {n} are visible on "
                f"this node")
    return ""


def cmd_train(argv: list[str]) -> int:
    a, overrides = _launcher_parser().parse_known_args(argv)
    if a.nproc < 1 or a.nnodes < 1:
        return report_bad_input(f"k3train train: --nproc and --nnodes must be >= 1, got {a.nproc} and {a.nnodes}")
    if a.nnodes > 1 and a.rdzv_endpoint is None:
        return report_bad_input("k3train train: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address), "
                                "the same on every node")
    world = a.nproc * a.nnodes
    # warnings of the checks: from this process for one rank; else rank 0 of the run repeats the checks and logs
    # them (once), so here they would appear twice
    logging.basicConfig(level=logging.INFO if world == 1 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # once, for the whole world; every rank checks again (cheap), so direct torchrun use stays safe
        cfg = validate_run(a.config, overrides, world)
    except Exception as e:
        if is_bad_input(e):
            return report_bad_input(e)
        from k3train.checkpoint.resume import NothingToDo  # noqa: PLC0415 - lazy: it loads torch

        if not isinstance(e, NothingToDo):
            raise
        print(f"k3train: {e}", flush=True)
        return 0
    on_gpu_error = gpus_short(cfg, a.nproc)
    if on_gpu_error:
        return report_bad_input(on_gpu_error)
    if world == 1:
        return run_training(cfg)
    cmd = torchrun_command(a, overrides)
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        # torchrun would export OMP_NUM_THREADS=1 (with a banner) for nproc > 1; mark it as ours so that the ranks
        # share this host's cores by the k3train rule instead (k3train/runtime/process_groups.py: choose_num_threads)
        env.update(OMP_NUM_THREADS="1", K3TRAIN_THREADS_AUTO="1")
    print(f"k3train: launching {Path(sys.executable).name} {' '.join(cmd[1:])}", flush=True)
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)  # torchrun gets our pid: signals (SIGTERM, Ctrl-C) reach it directly
    return 0  # not reached


def cmd_check(argv: list[str]) -> int:
    return train_main(["--check", *argv])


def run_tool(script: str, argv: list[str]) -> int:
    """Run ``tools/<script>``'s ``main(argv)`` in this process (the tools are scripts, not a package)."""
    path = ROOT / "tools" / script
    if not path.is_file():
        return report_bad_input(f"this command is not available in this installation ({path} is missing)")
    spec = importlib.util.spec_from_file_location(f"k3train_tool_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if inspect.signature(mod.main).parameters:
        rc = mod.main(argv)
    else:  # a tool whose main() reads sys.argv
        sys.argv = [str(path), *argv]
        rc = mod.main()
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"usage: {USAGE}\n", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_BAD_INPUT
    sub, rest = argv[0], argv[1:]
    if sub == "train":
        if rest and rest[0] in ("-h", "--help"):
            _launcher_parser().print_help()
            return 0
        return cmd_train(rest)
    if sub == "check":
        return cmd_check(rest)
    if sub == "plot":
        return plot_main(rest)
    if sub in TOOLS:
        return run_tool(TOOLS[sub], rest)
    if sub == "import-hf":
        from k3train.hf_commands import import_hf_main  # noqa: PLC0415 - lazy: k3train.hf loads torch

        return import_hf_main(rest)
    if sub == "export-hf":
        from k3train.hf_commands import export_hf_main  # noqa: PLC0415 - lazy: k3train.hf loads torch

        return export_hf_main(rest)
    return report_bad_input(f"unknown command {sub!r}; one of: train, check, {', '.join(TOOLS)}, plot, import-hf, "
                            f"export-hf (k3train --help)")


if __name__ == "__main__":
    sys.exit(main())
