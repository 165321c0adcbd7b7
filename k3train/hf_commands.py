"""``k3train import-hf`` and ``k3train export-hf`` (the command-line verbs of k3train/cli.py).

    k3train import-hf HF_DIR -o RUN.yaml
        a run config whose model (and vision) section is HF_DIR/config.json's, with checkpoint.load_hf=HF_DIR (and
        data.tokenizer=HF_DIR/tokenizer.json when there is one); the checkpoint is checked against it (every
        tensor, shape and shard header) before the file is written
    k3train export-hf --config C --checkpoint CKPT_DIR -o OUT_DIR [--experts auto|bf16|mxfp4]
                      [--dtype bfloat16|float32] [--max-shard-size 5GB] [--nproc N] [--section.key=value ...]
        a k3train DCP checkpoint in the published layout (k3train/hf/export.py); with --nproc N every rank builds
        its part of the model in the config's layout (--parallel.* overrides may change it), loads it from the
        checkpoint (DCP reshards) and writes its own tensors

Bad input (a missing or mismatched checkpoint, an unmappable config, an output that exists) is one
``k3train: error:`` line and exit 2, before anything is built or written.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from k3train.config import ConfigError, load_config
from k3train.data.corpus import DataError
from k3train.data.tiktoken_tokenizer import RANKS_NAME
from k3train.data.tokenizer_config import read_tokenizer_config
from k3train.hf.config_map import read_config_json, sections_from_config_json, text_config_from_model
from k3train.hf.export import check_output_dir, write_hf_shards
from k3train.hf.load import check_hf_checkpoint
from k3train.parallelize import parallelize
from k3train.preflight import validate_run
from k3train.runtime.bad_input import OneLineParser, is_bad_input, report_bad_input
from k3train.runtime.process_groups import init_distributed, shutdown
from parallel.dims import ParallelDims


# ------------------------------------------------------------------------------------------------------------------
# import-hf
# ------------------------------------------------------------------------------------------------------------------
def tokenizer_section(hf_dir: Path) -> dict[str, Any]:
    """``data`` values for the checkpoint's own tokenizer: ``data.tokenizer`` at its ``tokenizer.json``, else at its
    tiktoken ranks file ``tiktoken.model`` (k3train/data/tiktoken_tokenizer.py), and the special-token names its
    ``tokenizer_config.json`` gives (``data.bos_token`` / ``eos_token`` / ``pad_token``)."""
    for name in ("tokenizer.json", RANKS_NAME):
        if (hf_dir / name).is_file():
            out: dict[str, Any] = {"tokenizer": str(hf_dir / name)}
            try:
                named = read_tokenizer_config(hf_dir / name).named_tokens
            except DataError as e:
                raise ConfigError(f"import-hf: {e}") from None
            out.update({key: named[key] for key in ("bos_token", "eos_token", "pad_token") if key in named})
            return out
    return {}


def import_config_text(hf_dir: Path) -> str:
    """The run config ``import-hf`` writes (YAML text) for checkpoint ``hf_dir``."""
    cj = read_config_json(hf_dir, "import-hf")
    fmt, model, vision = sections_from_config_json(cj, f"import-hf: {hf_dir / 'config.json'}")
    if fmt == "kimi_linear":  # trained with the aux-loss-free sign update of e_score_correction_bias
        model["router_balance"] = "sign"
    doc: dict[str, Any] = {"model": model}
    if vision:
        doc["vision"] = vision
    doc["checkpoint"] = {"load_hf": str(hf_dir)}
    data = tokenizer_section(hf_dir)
    if data:
        doc["data"] = data
    head = (f"# k3train run config written by `k3train import-hf {hf_dir}` from its config.json ({fmt}).\n"
            f"# model / vision: the checkpoint's (a run must keep them); checkpoint.load_hf: a fresh run starts from\n"
            f"# its weights in any parallel layout. Set data.path (prepared with the checkpoint's tokenizer),\n"
            f"# data.bos_token / eos_token / pad_token and the train / parallel sections for your run.\n")
    return head + yaml.safe_dump(doc, sort_keys=False)


def import_hf_main(argv: list[str]) -> int:
    ap = OneLineParser(prog="k3train import-hf", description=__doc__.split("\n\n")[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="Hugging Face checkpoint directory (config.json + safetensors)")
    ap.add_argument("-o", "--output", required=True, help="run config to write (YAML; must not exist)")
    a = ap.parse_args(argv)
    hf_dir, out = Path(a.hf_dir).resolve(), Path(a.output)
    try:
        if out.exists():
            raise ConfigError(f"import-hf: -o {out} exists (import-hf never overwrites a file)")
        text = import_config_text(hf_dir)
        tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        try:
            cfg = load_config(tmp)
            plan = check_hf_checkpoint(cfg)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out)
    except ConfigError as e:
        return report_bad_input(e)
    experts = sorted({type(s).__name__ for s in plan.values() if s.name.startswith(("per_expert", "fused"))})
    print(f"k3train: wrote {out}: {cfg.model.num_hidden_layers} layers, {len(plan)} tensors from {hf_dir}"
          + (f" (routed experts: {', '.join(experts)})" if experts else ""), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------------------
# export-hf
# ------------------------------------------------------------------------------------------------------------------
def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(text)
    unit = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}[m.group(2).upper()]
    if m.group(3) and m.group(3).lower() == "ib":
        unit = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def _export_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="k3train export-hf", allow_abbrev=False,
                       description="write a k3train checkpoint in the published Hugging Face layout; every other "
                                   "--section.key=value argument overrides the config (e.g. the layout)")
    ap.add_argument("--config", required=True, help="the run's config (e.g. RUN_DIR/config.yaml)")
    ap.add_argument("--checkpoint", required=True, help="a complete k3train checkpoint directory (step_XXXXXXXX)")
    ap.add_argument("-o", "--output", required=True, help="output directory (new or empty)")
    ap.add_argument("--experts", default="auto", choices=("auto", "bf16", "mxfp4"),
                    help="routed experts: as the imported checkpoint (auto; else bf16), bf16, or MXFP4")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="dtype of tensors the imported checkpoint does not decide (default bfloat16)")
    ap.add_argument("--max-shard-size", default="5GB", help="largest shard file (e.g. 5GB, 500MiB)")
    ap.add_argument("--nproc", type=int, default=1, help="processes (torchrun --nproc_per_node); one per GPU")
    return ap


def _validate_export(a: argparse.Namespace, overrides: list[str]):
    # lazy: k3train.checkpoint.manager loads torch.distributed.checkpoint (a second), which import-hf never needs
    from k3train.checkpoint.manager import verify  # noqa: PLC0415

    if a.nproc < 1:
        raise ConfigError(f"export-hf: --nproc must be >= 1, got {a.nproc}")
    try:
        a.max_shard_bytes = _size(a.max_shard_size)
    except ValueError:
        raise ConfigError(f"export-hf: --max-shard-size {a.max_shard_size!r}: expected a size like 5GB") from None
    cfg = validate_run(a.config, overrides, a.nproc, for_training=False)
    text_config_from_model(cfg)  # a model the published config cannot describe: refused before any work
    ckpt = Path(a.checkpoint)
    if not ckpt.is_dir():
        raise ConfigError(f"export-hf: --checkpoint {ckpt} does not exist")
    why = verify(ckpt, checksum=False)
    if why:
        raise ConfigError(f"export-hf: --checkpoint {ckpt} is not a complete checkpoint: {why}")
    check_output_dir(a.output)
    return cfg


def export_hf_main(argv: list[str]) -> int:
    """The launcher: validate once, then export in this process (``--nproc 1``) or replace this process with
    torchrun running :func:`export_rank_main` on every rank."""
    a, overrides = _export_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _validate_export(a, overrides)
    except Exception as e:
        if is_bad_input(e):
            return report_bad_input(e)
        raise
    if a.nproc == 1:
        return run_export(cfg, a)
    # every rank gets the arguments without --nproc (torchrun's own parser would take it for --nproc-per-node)
    rank_argv = [x for i, x in enumerate(argv) if not (x.startswith("--nproc=") or x == "--nproc"
                                                      or (i and argv[i - 1] == "--nproc"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}", "--standalone",
           "-m", "k3train.hf_commands", *rank_argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def run_export(cfg: Any, a: argparse.Namespace) -> int:
    """One rank of the export (or the only process): build this rank's part, load the checkpoint, write."""
    # lazy: torch.distributed.checkpoint (a second), which import-hf never needs
    from k3train.checkpoint.safe_load import dcp_load  # noqa: PLC0415

    env = init_distributed(cfg.parallel.backend, cfg.train.device, cfg.parallel.collective_timeout_s,
                           cfg.train.num_threads)
    try:
        dims = ParallelDims.from_config(cfg.parallel, env.world_size, env.rank).build_groups(
            timeout_s=env.collective_timeout_s or None)
        pm = parallelize(cfg, dims, env.device)
        state = {"model": pm.state_dict()}
        dcp_load(state, a.checkpoint)
        pm.load_state_dict(state["model"])
        out = Path(a.output)
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        stats = write_hf_shards(pm.modules, cfg, out, dims=dims, skip=pm.runner.replica_params, experts=a.experts,
                                dtype=getattr(torch, a.dtype), max_shard_bytes=a.max_shard_bytes)
        every = [stats]
        if dist.is_initialized() and env.world_size > 1:
            every = [None] * env.world_size
            dist.all_gather_object(every, stats)
        if env.is_main:
            total = sum(s["bytes_written"] for s in every)
            per = ", ".join(f"r{r} {s['bytes_written'] / 2 ** 20:.1f}MiB {s['seconds']:.2f}s rss "
                            f"{s['peak_rss_gib']:.2f}GiB" for r, s in enumerate(every))
            print(f"k3train: exported {a.checkpoint} to {out}: {total / 2 ** 20:.1f} MiB in "
                  f"{sum(s['files'] for s in every)} shards; per rank {per}", flush=True)
    finally:
        shutdown()
    return 0


def export_rank_main() -> int:
    """``python -m k3train.hf_commands ...`` under torchrun: one rank of ``export-hf`` (validated by the launcher;
    every rank validates again, cheaply, so a direct torchrun call is safe too)."""
    a, overrides = _export_parser().parse_known_args(sys.argv[1:])
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(a.config, overrides, int(os.environ.get("WORLD_SIZE", "1")))
        a.max_shard_bytes = _size(a.max_shard_size)
    except Exception as e:
        if is_bad_input(e) and os.environ.get("RANK", "0") == "0":
            return report_bad_input(e)  # as a launcher would: the other ranks raise (and torchrun reports them)
        raise
    return run_export(cfg, a)


if __name__ == "__main__":
    sys.exit(export_rank_main())
