"""Entry point: ``torchrun --nproc_per_node=N -m k3train.train --config configs/X.yaml [--section.key=value ...]``
(or ``python -m k3train.train ...`` for one process).

Parse and validate everything that can be wrong (config, layout against the world size, dataset files) before any
process group or model exists; a bad input is one ``k3train: error: ...`` line and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import sys

from k3train.config import ConfigError, load_config
from k3train.dist_env import env_world_size

EXIT_BAD_INPUT = 2


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="k3train.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML run config (configs/tiny.yaml, configs/small.yaml, ...)")
    ap.add_argument("--check", action="store_true",
                    help="only validate config, layout and data (for --world-size processes), then exit")
    ap.add_argument("--world-size", type=int, default=None,
                    help="with --check: the number of processes the run will have (default: $WORLD_SIZE or 1)")
    args, rest = ap.parse_known_args(argv)
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    world_size = args.world_size if args.world_size is not None else env_world_size()
    from k3train.data import DataError  # noqa: PLC0415 - keep `--help` fast
    from k3train.preflight import preflight

    try:
        cfg = load_config(args.config, overrides, world_size=world_size)
        preflight(cfg)
    except (ConfigError, DataError, ValueError, FileNotFoundError) as e:
        print(f"k3train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if args.check:
        print(f"k3train: {args.config}: config, layout (world size {world_size}) and data are valid", flush=True)
        return 0

    from k3train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
