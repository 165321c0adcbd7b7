"""Entry point: ``torchrun --nproc_per_node=N -m k3train.train --config configs/X.yaml [--section.key=value ...]``
(or ``python -m k3train.train ...`` for one process).

Parse and validate everything that can be wrong (config, layout against the world size, machine, dataset files)
before any process group or model exists (:func:`k3train.preflight.validate_run`); a bad input is one
``k3train: error: ...`` line on stderr and exit code 2. Under torchrun every rank runs the same checks and exits 2;
only global rank 0 prints the line (the launcher then reports the failed ranks itself).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from k3train.preflight import validate_run
from k3train.runtime.bad_input import OneLineParser, is_bad_input, report_bad_input

EXIT_RUN_FAILED = 1  # a collective failed: a peer rank died or stalled (resume with the same command)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = OneLineParser(prog="k3train.train", description=__doc__, name_command=False, rank_of_run=True,
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
    # torchrun's WORLD_SIZE, read without importing torch (k3train.runtime.process_groups.env_world_size reads the
    # same), so that a config error is reported before torch, megatron and the data package load (in well under a
    # second)
    world_size = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("RANK", "0") != "0":  # preflight warnings once, from rank 0; the trainer sets levels later
        logging.getLogger().setLevel(logging.ERROR)
    try:
        cfg = validate_run(args.config, overrides, world_size)
    except Exception as e:  # only bad input and "nothing to do" are handled; anything else is a bug: re-raised
        if is_bad_input(e):
            return report_bad_input(e, rank_of_run=True)
        from k3train.checkpoint.resume import NothingToDo  # noqa: PLC0415 - lazy: it loads torch

        if not isinstance(e, NothingToDo):
            raise
        # the checkpoint already reached the end: one line, exit 0, nothing built
        if os.environ.get("RANK", "0") == "0":
            print(f"k3train: {e}", flush=True)
        return 0
    if args.check:
        print(f"k3train: {args.config}: config, layout (world size {world_size}) and data are valid", flush=True)
        return 0

    return run_training(cfg)


def run_training(cfg) -> int:  # noqa: ANN001 - a validated k3train.config.Config
    """Train; turn the two ways a healthy rank stops early into one line each instead of a traceback per rank.

    * Stop signal (SIGTERM / SIGINT, k3train/runtime/signals.py): every rank stopped after the same step and
      checkpointed it; rank 0 prints ``k3train: stopped by SIGTERM at step N; checkpoint step_0000000N written
      ...``; exit 128 + signal (143 / 130: stopped early and resumable, not finished -- see k3train/runtime/signals.py).
    * A peer died or stalled in a collective (k3train/runtime/collective_errors.py): this rank prints ``k3train: error:
      rank R: collective OP on group G (ranks [...]) failed: ...`` and exits 1 at once (``os._exit``: tearing down
      process groups whose peer is gone aborts or hangs). torchrun then stops the others and exits non-zero; the
      same command resumes from the last complete checkpoint.
    * ``train.max_skipped_steps`` non-finite steps in a row, or a checkpoint about to hold NaN/inf
      (k3train/runtime/nonfinite.py): rank 0 prints ``k3train: error: stopping at step N: ...``; exit 3."""
    # lazy: these load torch, which is not loaded before the config is checked (main: validate_run)
    from k3train.runtime.collective_errors import CollectiveWatch  # noqa: PLC0415 - lazy: torch, as above
    from k3train.runtime.nonfinite import EXIT_TRAINING_STOPPED, TrainingStopped  # noqa: PLC0415 - lazy: torch
    from k3train.runtime.signals import StopRun  # noqa: PLC0415 - lazy: torch, as above
    from k3train.trainer import Trainer  # noqa: PLC0415 - lazy: torch, as above

    watch = CollectiveWatch().install()  # for the life of the process
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except StopRun as stop:
        trainer.close()
        if trainer.env.is_main:
            print(stop.line(), file=sys.stderr, flush=True)
        return stop.exit_code
    except TrainingStopped as e:  # every rank stops at the same step (k3train/runtime/nonfinite.py)
        trainer.close()
        if trainer.env.is_main:
            print(f"k3train: error: {e}", file=sys.stderr, flush=True)
        return EXIT_TRAINING_STOPPED
    except BaseException as e:
        if is_bad_input(e):  # found while resuming (a damaged resume=PATH): every rank agreed on it (the
            # verification is collective); one line, exit 2
            from k3train.runtime.process_groups import shutdown  # noqa: PLC0415 - lazy: torch, as above

            shutdown()
            return report_bad_input(e, rank_of_run=True)
        rank = trainer.env.rank if trainer is not None else int(os.environ.get("RANK", "0"))
        line = watch.failure_line(e, rank)
        if line is None:
            if trainer is not None:
                trainer.close()
            raise
        print(line, file=sys.stderr, flush=True)
        if trainer is not None:
            trainer.close(destroy_groups=False)
        sys.stdout.flush()
        os._exit(EXIT_RUN_FAILED)
    trainer.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
