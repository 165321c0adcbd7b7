"""The real trainer (torchrun, gloo) at cp = 3 and 4 on a corpus of short documents that used to hang KCP.

The corpus is a JSONL of documents whose token counts (EOS included) are multiples of 4, prepared with
``k3train.data.prepare.prepare`` as ``tools/prepare_data.py`` does. Megatron packs documents back to back and cuts
samples at multiples of ``seq_len`` = 48, so document boundaries fall on multiples of 4 inside every sample, and
segments of 16 (cp=3) and 12 (cp=4) tokens are often whole documents, half documents, several documents, or part
of one document spanning every rank. The test first checks, on the very global batches the runs read, that some
micro-batch has a segment that neither receives nor passes state while another segment carries it (the issue 10
hang), then that each CP run finishes and logs the single-process run's per-step loss and grad_norm.
Per-parameter gradients at cp = 3/4 are compared at the model level in ``test_model_cp.py``.
"""
from __future__ import annotations

import json
import random

import pytest
from test_kcp_no_hang import isolated_ranks
from train.train_helpers import ROOT, assert_ok, read_metrics, run_train

from k3train.config import load_config
from k3train.data.loader import GlobalBatchLoader
from k3train.data.prepare import prepare
from k3train.data.tokenizer import load_tokenizer
from kcp.fold import SegmentDocs, plan_fold

SEQ_LEN, GBS, STEPS = 48, 2, 2
# token counts (EOS included) of the documents, in file order (Megatron shuffles them)
DOC_TOKENS = [16, 32, 12, 24, 16, 48, 8, 4, 16, 100, 12, 36, 20, 16, 28, 12] * 4
WORDS = [" the", " and", " of", " to", " that", " in", " he", " shall", " unto", " for", " his", " LORD",
         " they", " be", " is", " him", " not", " them", " it", " with"]


def _args(prefix, out, *extra):
    return ["--config", "configs/tiny.yaml", f"--data.path={prefix}", f"--train.out_dir={out}",
            f"--train.steps={STEPS}", f"--train.seq_len={SEQ_LEN}", f"--train.global_batch_size={GBS}",
            "--train.micro_batch_size=1", "--data.split=100,0,0", "--logging.wandb=false",
            "--optim.warmup_steps=1", "--checkpoint.save_final=false", "--checkpoint.resume=none", *extra]


@pytest.fixture(scope="module")
def short_doc_corpus(tmp_path_factory):
    """JSONL of documents with exactly ``DOC_TOKENS`` tokens each -> indexed dataset prefix."""
    d = tmp_path_factory.mktemp("short_docs")
    tok = load_tokenizer()
    rng = random.Random(0)
    with open(d / "docs.jsonl", "w") as f:
        for n in DOC_TOKENS:
            text = "And" + "".join(rng.choice(WORDS) for _ in range(n - 3))
            assert len(tok.encode(text)) == n - 1, "each word must stay one token"  # + EOS = n
            f.write(json.dumps({"text": text}) + "\n")
    prefix = d / "short_text_document"
    prepare([d / "docs.jsonl"], tok, prefix)
    return prefix


def _hang_layout_steps(prefix, cp: int) -> list[int]:
    """Steps (1-based) of the run whose micro-batches include an isolated segment next to a carried state."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", _args(prefix, "unused")[2:])
    loader = GlobalBatchLoader(cfg)
    steps = []
    for s in range(STEPS):
        batch = loader.global_batch(s * GBS)
        for row in batch.doc_ids:  # micro_batch_size 1: each row is a micro-batch
            docs = SegmentDocs.from_doc_ids(row.view(cp, 1, SEQ_LEN // cp))
            if plan_fold(docs, 0).any_chain and isolated_ranks(docs):
                steps.append(s + 1)
    return steps


@pytest.fixture(scope="module")
def reference(short_doc_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cp1")
    assert_ok(run_train(_args(short_doc_corpus, out)))
    return read_metrics(out)


@pytest.mark.parametrize("cp", [3, 4])
def test_trainer_cp_on_hang_layouts_matches_one_process(short_doc_corpus, reference, tmp_path, cp):
    assert _hang_layout_steps(short_doc_corpus, cp), f"the corpus gives no hang layout at cp={cp}"
    out = tmp_path / f"cp{cp}"
    assert_ok(run_train(_args(short_doc_corpus, out, f"--parallel.cp={cp}"), nproc=cp, timeout=300))
    got = read_metrics(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
