"""GlobalBatchLoader: packing and document boundaries, layout independence, resume, gloo ranks."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from k3train.data.batch import Batch
from k3train.data.corpus import DataError
from k3train.data.dataset import _file_lock, read_documents_back, split_document_ranges
from k3train.data.loader import GlobalBatchLoader
from data_helpers import copy_dataset, make_cfg
from dist_helpers import run_distributed

FIELDS = ("tokens", "labels", "loss_mask", "doc_ids", "positions", "mtp_labels", "mtp_loss_mask")


def assert_same(a: Batch, b: Batch) -> None:
    for k in FIELDS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def assemble(per_rank: dict[tuple[int, int], list[Batch]], dp: int, cp: int) -> Batch:
    """Global batch from every (dp_rank, cp_rank)'s micro-batches: CP slices along the sequence, then micro-
    batches and dp ranks along the rows."""
    rows = []
    for d in range(dp):
        n_mb = len(per_rank[(d, 0)])
        for m in range(n_mb):
            rows.append(Batch.cat([per_rank[(d, c)][m] for c in range(cp)], dim=1))
    return Batch.cat(rows, dim=0)


def test_samples_are_packed_documents(small_prefix, tok):
    """Rebuild every sample from the documents in Megatron's document order and check tokens and doc_ids."""
    cfg = make_cfg(small_prefix, gbs=8, mbs=8, seq_len=32, steps=5)
    loader = GlobalBatchLoader(cfg, tokenizer=tok)
    ds = loader.dataset
    docs = list(read_documents_back(small_prefix))
    train_rng = split_document_ranges(len(docs), cfg.data.split)[0]
    assert set(np.asarray(ds.document_index).tolist()) == set(range(*train_rng))  # train documents only
    order = [int(d) for d in ds.document_index]
    stream = np.concatenate([docs[d] for d in order])
    stream_doc = np.concatenate([np.full(len(docs[d]), k) for k, d in enumerate(order)])
    starts = np.concatenate([[0], np.cumsum([len(docs[d]) for d in order])])
    assert all(docs[d][-1] == tok.eos_id and (docs[d][:-1] != tok.eos_id).all() for d in order)
    T = cfg.train.seq_len
    for step in range(3):
        batch = loader.global_batch(step * 8)
        for r, i in enumerate(loader.global_sample_indices(step * 8)):
            j = int(ds.shuffle_index[i])
            doc_pos, offset = (int(v) for v in ds.sample_index[j])
            s = starts[doc_pos] + offset
            assert batch.tokens[r].tolist() == stream[s:s + T].tolist()
            assert batch.labels[r].tolist() == stream[s + 1:s + T + 1].tolist()
            true_doc = stream_doc[s:s + T]
            assert batch.doc_ids[r].tolist() == (true_doc - true_doc[0]).tolist()
            # the loss never asks for the next document's first token
            crosses = stream_doc[s + 1:s + T + 1] != true_doc
            assert batch.loss_mask[r].tolist() == (~crosses).astype(float).tolist()


@pytest.mark.parametrize("cp", [1, 2])
def test_global_batch_independent_of_layout(small_prefix, tok, cp):
    layouts = [(1, 4), (2, 2), (4, 1)]
    ref = None
    for dp, mbs in layouts:
        cfg = make_cfg(small_prefix, gbs=8, mbs=mbs, seq_len=32, steps=6)
        loaders = {(d, c): GlobalBatchLoader(cfg, d, dp, c, cp, tokenizer=tok) for d in range(dp) for c in range(cp)}
        steps = []
        for _ in range(3):
            per_rank = {k: ld.next_step() for k, ld in loaders.items()}
            for k, mbl in per_rank.items():
                assert len(mbl) == 8 // (dp * mbs) and all(mb.shape == (mbs, 32 // cp) for mb in mbl)
            counts = {ld.global_token_counts() for ld in loaders.values()}
            assert len(counts) == 1  # every rank agrees without communication
            full = assemble(per_rank, dp, cp)
            assert counts.pop() == (full.num_lm_tokens(), full.num_mtp_tokens())
            steps.append(full)
        if ref is None:
            ref = steps
            # a different sample per row, and consecutive steps differ
            assert len({tuple(r) for s in steps for r in s.tokens.tolist()}) == 24
        else:
            for a, b in zip(ref, steps):
                assert_same(a, b)  # same samples, same order, same per-sample content
                assert sorted(map(tuple, a.tokens.tolist())) == sorted(map(tuple, b.tokens.tolist()))


def test_resume(small_prefix, tok):
    cfg = make_cfg(small_prefix, gbs=4, mbs=1, seq_len=32, steps=10)
    a = GlobalBatchLoader(cfg, 1, 2, tokenizer=tok)
    for _ in range(3):
        a.next_step()
    state = a.state_dict()
    assert state["consumed_samples"] == 12
    expected = [a.next_step() for _ in range(2)]
    b = GlobalBatchLoader(cfg, 1, 2, tokenizer=tok)
    b.load_state_dict(state)
    for want in expected:
        for x, y in zip(want, b.next_step()):
            assert_same(x, y)
    c = GlobalBatchLoader(cfg, 1, 2, consumed_samples=12, tokenizer=tok)
    assert_same(c.next_step()[0], expected[0][0])


def test_micro_batches_go_to_the_loaders_device(small_prefix, tok):
    """The loader hands its batches to the run's device (on a GPU: the model's; a first H200 run failed at the
    embedding with CPU token ids). 'meta' stands in for a device here: every field moves, nothing else changes."""
    cfg = make_cfg(small_prefix, gbs=4, mbs=1, seq_len=32, steps=10)
    host = GlobalBatchLoader(cfg, 0, 2, tokenizer=tok).next_step()
    moved = GlobalBatchLoader(cfg, 0, 2, tokenizer=tok, device="meta").next_step()
    assert len(moved) == len(host)
    for a, b in zip(host, moved):
        for name in ("tokens", "labels", "loss_mask", "doc_ids", "positions"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.device.type == "cpu" and y.device.type == "meta", name
            assert (x.shape, x.dtype) == (y.shape, y.dtype), name


def test_exhaustion_valid_split_and_bad_layouts(small_prefix, tok):
    cfg = make_cfg(small_prefix, gbs=4, mbs=2, seq_len=32, steps=2)
    ld = GlobalBatchLoader(cfg, tokenizer=tok, consumed_samples=0)
    n = ld.num_samples
    ld.load_state_dict({"consumed_samples": n - 2})
    with pytest.raises(DataError, match="train data exhausted"):
        ld.next_step()
    v = GlobalBatchLoader(cfg, split="valid", tokenizer=tok)
    assert 0 < v.num_samples < n
    v.load_state_dict({"consumed_samples": v.num_samples - 1})  # evaluation wraps around
    assert v.next_step()[0].tokens.shape == (2, 32)
    with pytest.raises(DataError, match="global_batch_size=4 must be a positive multiple"):
        GlobalBatchLoader(make_cfg(small_prefix, gbs=4, mbs=3), tokenizer=tok)
    with pytest.raises(DataError, match="not divisible by cp=3"):
        GlobalBatchLoader(cfg, cp_rank=0, cp=3, tokenizer=tok)
    cfg.model.vocab_size = 1000
    with pytest.raises(DataError, match="model.vocab_size=1000"):
        GlobalBatchLoader(cfg, tokenizer=tok)


def test_file_lock_excludes(tmp_path):
    events = []

    def hold():
        with _file_lock(tmp_path / "l"):
            events.append("a-in")
            time.sleep(0.3)
            events.append("a-out")

    th = threading.Thread(target=hold)
    th.start()
    while not events:
        time.sleep(0.01)
    with _file_lock(tmp_path / "l"):
        events.append("b-in")
    th.join()
    assert events == ["a-in", "a-out", "b-in"]


def _dist_body(rank: int, world_size: int, prefix: str) -> None:
    """Both gloo ranks build the loader on a fresh index cache (rank 0 builds it, rank 1 waits on Megatron's
    barrier) and their micro-batches form the global batch that a single process computes."""
    cfg = make_cfg(Path(prefix), gbs=4, mbs=1, seq_len=32, steps=4)
    ld = GlobalBatchLoader(cfg, dp_rank=rank, dp=world_size)
    for _ in range(2):
        mine = Batch.cat(ld.next_step())
        gathered = [torch.zeros_like(mine.tokens) for _ in range(world_size)]
        dist.all_gather(gathered, mine.tokens)
        full = ld.global_batch(ld.consumed_samples - 4)
        assert torch.equal(torch.cat(gathered), full.tokens)
    cache = Path(prefix + ".cache")
    assert len(list(cache.glob("*/*-GPTDataset-train-shuffle_index.npy"))) == 1


def test_distributed_gloo_build(small_prefix, tmp_path):
    # forked from this process, not from the fork server: the ranks inherit the already imported megatron (its
    # import takes seconds per process on a loaded machine); nothing here uses threads that fork could break.
    p = copy_dataset(small_prefix, tmp_path / "dist")
    run_distributed(_dist_body, 2, str(p), timeout=120, start_method="fork")
