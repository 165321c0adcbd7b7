"""Print the bad-input table (input, exit code, message) by running every case of ``test_bad_input.BAD_INPUT``
through the real entry point: ``.venv/bin/python tests/train/bad_input_table.py`` (markdown on stdout)."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist_helpers, which train_helpers imports
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from test_bad_input import BAD_INPUT, _tiny_dataset, fill, make_inputs  # noqa: E402
from train_helpers import run_train  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        inputs = make_inputs(d, _tiny_dataset(d, 120))
        print("| input | exit | s | message |\n|---|---|---|---|")
        for i, (cid, args, _, opts) in enumerate(BAD_INPUT):
            run = d / f"run{i}"
            argv = fill(args, inputs, run) + ([] if "--train.out_dir={run}" in args else [f"--train.out_dir={run}"])
            t0 = time.perf_counter()
            res = run_train(argv, nproc=opts.get("nproc", 0), env_extra=opts.get("env"))
            lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train: error:")]
            msg = lines[0] if len(lines) == 1 else f"{len(lines)} error lines: {res.stderr[-300:]!r}"
            msg = msg.replace(tmp, "$TMP").replace("|", "\\|")
            print(f"| {cid} | {res.returncode} | {time.perf_counter() - t0:.1f} | `{msg}` |", flush=True)


if __name__ == "__main__":
    main()
