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


def parse_args(argv: list[str] | None) -> tuple[str | None, list[str]]:
    ap = argparse.ArgumentParser(prog="k3train.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML run config (configs/tiny.yaml, configs/small.yaml, ...)")
    args, rest = ap.parse_known_args(argv)
    return args.config, rest


def main(argv: list[str] | None = None) -> int:
    config_path, overrides = parse_args(argv)
    from k3train.data import DataError  # noqa: PLC0415 - keep `--help` fast
    from k3train.preflight import preflight

    try:
        cfg = load_config(config_path, overrides, world_size=env_world_size())
        preflight(cfg)
    except (ConfigError, DataError, ValueError, FileNotFoundError) as e:
        print(f"k3train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT

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
