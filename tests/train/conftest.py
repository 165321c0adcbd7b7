"""Fixtures for end-to-end trainer tests: a small real dataset (the first 120 KJV chapters) built once, the
uninterrupted single-process reference run, and the runs stopped after step 2 that resumed tests continue."""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from k3train.data.corpus import DEFAULT_CORPUS, read_documents, write_text_corpus
from k3train.data.prepare import prepare
from k3train.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    docs = [x.text for x in itertools.islice(read_documents(DEFAULT_CORPUS), 120)]
    write_text_corpus(docs, d / "kjv120.txt")
    prefix = d / "kjv120_text_document"
    prepare([d / "kjv120.txt"], load_tokenizer(DEFAULT_TOKENIZER), prefix)
    return prefix


@pytest.fixture(scope="session")
def straight(corpus_prefix, tmp_path_factory) -> list[dict]:
    """One process, ``STRAIGHT_STEPS`` steps of the tiny config on ``FAST`` batches without interruption: the
    reference of test_train_e2e.py and test_resume_layouts.py (the same command in both, so it runs once)."""
    from train_helpers import FAST, STRAIGHT_STEPS, assert_ok, read_metrics, run_train_forked  # noqa: PLC0415

    out = tmp_path_factory.mktemp("straight")
    assert_ok(run_train_forked(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}",
                                f"--train.out_dir={out}", f"--train.steps={STRAIGHT_STEPS}", *FAST,
                                "--checkpoint.resume=none"]))
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, STRAIGHT_STEPS + 1))
    return got


@pytest.fixture(scope="session")
def stopped_at_2(corpus_prefix, tmp_path_factory):
    """``copy(name, dst)``: a copy at ``dst`` of the run directory of ``STRAIGHT_STEPS`` steps in layout ``name``
    (``STOP_LAYOUTS``) stopped after step 2 (``--train.stop_at_step=2``, checkpointed; resume=auto), made once on
    first use. test_train_e2e.py resumes it in the same layout, test_resume_layouts.py in another one: the same
    first command in both, so it runs once."""
    from train_helpers import (FAST, STOP_LAYOUTS, STRAIGHT_STEPS, assert_ok, read_metrics,  # noqa: PLC0415
                               run_train_forked)

    made: dict[str, Path] = {}

    def copy(name: str, dst: Path) -> Path:
        if name not in made:
            layout, nproc = STOP_LAYOUTS[name]
            out = tmp_path_factory.mktemp(f"stopped_{name}")
            assert_ok(run_train_forked(["--config", "configs/tiny.yaml", f"--data.path={corpus_prefix}",
                                        f"--train.out_dir={out}", f"--train.steps={STRAIGHT_STEPS}", *FAST,
                                        "--train.stop_at_step=2", "--checkpoint.resume=auto", *layout],
                                       nproc=nproc))
            assert [r["step"] for r in read_metrics(out)] == [1, 2]
            assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
            made[name] = out
        shutil.copytree(made[name], dst)
        return dst

    return copy
