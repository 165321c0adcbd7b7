"""Bad input: one line naming the problem, exit code 2, before any work starts.

Every entry point (``k3train``, ``python -m k3train.train``, ``k3train plot``, ``import-hf`` / ``export-hf``, the
tools) reports a bad config, a bad file or a bad argument the same way, with what is here: the exit code, the
error types (:func:`is_bad_input`), the one printer of the ``k3train: error: ...`` line (:func:`report_bad_input`)
and the argument parser whose errors are that line (:class:`OneLineParser`).

Nothing here imports torch: the line for a bad config is printed before torch loads.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

EXIT_BAD_INPUT = 2

# Under torchrun the other ranks reach the same error as rank 0 (the checks are deterministic), but must not exit
# first: torchrun tears the job down at the first exit, which could kill rank 0 before it prints. They wait this
# long for that teardown (rank 0 exiting 2 triggers it) and then exit 2 themselves.
PEER_WAIT_S = 60.0

# the error classes bad input raises besides ConfigError (module, class): the entry points report exactly these
# (one line, exit 2); anything else is a bug
BAD_INPUT_CLASSES = (("k3train.data.corpus", "DataError"), ("parallel.dims", "ParallelConfigError"))


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and, when known, the file."""


def is_bad_input(e: BaseException) -> bool:
    """Whether ``e`` is one of the bad-input errors. The classes above are looked up through ``sys.modules``: a
    class whose module was never imported cannot have been raised, and importing it here would cost seconds
    (torch)."""
    return isinstance(e, ConfigError) or any(mod in sys.modules and isinstance(e, getattr(sys.modules[mod], name))
                                             for mod, name in BAD_INPUT_CLASSES)


def report_bad_input(message: object, *, rank_of_run: bool = False) -> int:
    """Print the one ``k3train: error: ...`` line for bad input (whitespace folded to one line) and return the
    exit code. A launcher or a one-process command prints it; in a rank of a run (``rank_of_run``: every rank
    reaches the same error) only global rank 0 prints it, also into torchrun's error file, and the other ranks
    wait for torchrun's teardown instead of exiting first."""
    line = f"k3train: error: {' '.join(str(message).split())}"
    if not rank_of_run:
        print(line, file=sys.stderr, flush=True)
    elif os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
        write_elastic_error_file(line)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(PEER_WAIT_S)
    return EXIT_BAD_INPUT


def write_elastic_error_file(line: str) -> None:
    """Under torchrun, put our line in the worker's error file (``TORCHELASTIC_ERROR_FILE``): torchrun's failure
    report then shows it as the root cause instead of a link to its docs. torchrun still prints that report (and
    its own traceback) and exits 1 whenever a worker exits non-zero; ``k3train train`` validates before starting
    torchrun, so bad input never gets that far there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the report only loses our line; the exit code and stderr line stand


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are the one bad-input line (exit 2) instead of usage + message. The line
    names the command (``prog``) unless ``name_command=False``; ``rank_of_run``: as :func:`report_bad_input`'s."""

    def __init__(self, *args, name_command: bool = True, rank_of_run: bool = False,  # noqa: ANN002
                 **kwargs) -> None:  # noqa: ANN003
        super().__init__(*args, **kwargs)
        self.name_command, self.rank_of_run = name_command, rank_of_run

    def error(self, message: str):  # type: ignore[override] - one line, like every other bad input
        line = f"{self.prog}: {message}" if self.name_command else message
        sys.exit(report_bad_input(line, rank_of_run=self.rank_of_run))
