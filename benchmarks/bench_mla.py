#!/usr/bin/env python
"""Benchmark one Gated MLA layer's forward + backward: blockwise (k3train/ops/mla_blockwise.py, the default) vs
the dense reference (``MLA.attention_op = attention_core``: SDPA on fully expanded K/V with a dense mask).

Per T (one document per row, the causal worst case): wall time of forward + backward (one thread, the best of
``--repeats``) and the peak live tensor bytes above the start (:class:`k3train.planning.fakerun.live_bytes.LiveBytes`,
a separate run: the dispatch mode slows ops down). Dense runs while its estimated peak (``16 H T^2`` bytes:
scores, probabilities and their gradients in fp32, the mask) stays under ``--dense-limit-gib``.

Then the share of (row, query block, key block) pairs the blockwise path skips on the shipped corpus's packing
(``--data``, default data_cache/corpus_text_document): the documents' lengths from the ``.idx`` (no cache is
written), concatenated in a seeded shuffled order as the GPT dataset does and cut into rows of ``--seq-len``
tokens; doc ids and positions as :meth:`k3train.data.batch.Batch.from_samples` makes them. The causal-only share
(one document per row) is printed beside it.

Shapes: K3's MLA head dims (qk 128 + 64, v 128, kv_lora_rank 512, q_lora_rank 1536) with ``--heads`` heads
(K3: 96) and ``--hidden`` width, fp32. This is a tool, not a test::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_mla.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3train.config.presets import tiny_model_config  # noqa: E402
from k3train.data.dataset import validate_indexed_dataset  # noqa: E402
from k3train.model.mla import MLA  # noqa: E402
from k3train.ops.mla_dense import MaskInfo, attention_core  # noqa: E402
from k3train.model.seq import SeqInfo  # noqa: E402
from k3train.ops.mla_blockwise import block_plan  # noqa: E402
from k3train.planning.fakerun.live_bytes import LiveBytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def build_layer(heads: int, hidden: int, block: int) -> MLA:
    cfg = tiny_model_config(f"hidden_size={hidden}", f"num_attention_heads={heads}", "q_lora_rank=1536",
                            "kv_lora_rank=512", "qk_nope_head_dim=128", "qk_rope_head_dim=64", "v_head_dim=128",
                            f"mla_block_size={block}", f"kda_num_heads={heads}")
    torch.manual_seed(0)
    m = MLA(cfg)
    m.train()
    return m


def step(m: MLA, T: int) -> None:
    x = torch.randn(1, T, m.q_a_proj.in_features, requires_grad=True)
    seq = SeqInfo.from_doc_ids(torch.zeros(1, T, dtype=torch.long))
    m(x, seq).sum().backward()
    m.zero_grad(set_to_none=True)


def time_step(m: MLA, T: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(m, T)
        best = min(best, time.perf_counter() - t0)
    return best


def peak_bytes(m: MLA, T: int) -> int:
    with LiveBytes() as lb:
        base = lb.live
        step(m, T)
    return lb.peak - base


def corpus_doc_lengths(prefix: Path) -> np.ndarray:
    info = validate_indexed_dataset(prefix)
    seq_lens = info.sequence_lengths.astype(np.int64)
    csum = np.concatenate([[0], np.cumsum(seq_lens)])
    return csum[info.document_indices[1:]] - csum[info.document_indices[:-1]]


def packed_masks(lengths: np.ndarray, seq_len: int, rows: int, seed: int) -> MaskInfo:
    """``rows`` packed rows of ``seq_len`` tokens: documents in a shuffled order, concatenated, cut."""
    rng = np.random.default_rng(seed)
    need = rows * seq_len
    ids: list[np.ndarray] = []
    have, n = 0, 0
    while have < need:
        for j in rng.permutation(len(lengths)):
            ids.append(np.full(int(lengths[j]), n, dtype=np.int64))
            have, n = have + int(lengths[j]), n + 1
            if have >= need:
                break
    doc = torch.from_numpy(np.concatenate(ids)[:need].reshape(rows, seq_len))
    doc = doc - doc[:, :1]  # per-row numbering from 0 (as Batch.from_samples)
    pos = torch.arange(seq_len).expand(rows, seq_len)
    return MaskInfo(doc, pos, doc, pos)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dense-limit-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=str(ROOT / "data_cache/corpus_text_document"))
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--blocks", default="256,512,1024", help="block sizes for the skipped-share table")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    Ts = [int(t) for t in a.lengths.split(",")]
    print(f"# one MLA layer fwd+bwd, fp32, {a.threads} thread(s), H={a.heads}, hidden={a.hidden}, qk 192 / v 128, "
          f"kv_lora 512, block {a.block}, one document per row; torch {torch.__version__}")
    print(f"{'T':>6} {'blockwise s':>12} {'dense s':>9} {'blockwise MiB':>14} {'dense MiB':>10} {'bytes ratio':>12}")
    bw, dn = build_layer(a.heads, a.hidden, a.block), build_layer(a.heads, a.hidden, a.block)
    dn.attention_op = attention_core
    step(bw, 256)
    step(dn, 256)  # warm-up
    for T in Ts:
        tb, pb = time_step(bw, T, a.repeats), peak_bytes(bw, T)
        if 16 * a.heads * T * T <= a.dense_limit_gib * 2**30:
            td, pd = time_step(dn, T, a.repeats), peak_bytes(dn, T)
            print(f"{T:>6} {tb:12.2f} {td:9.2f} {pb / 2**20:14.1f} {pd / 2**20:10.1f} {pd / pb:12.1f}")
        else:
            print(f"{T:>6} {tb:12.2f} {'-':>9} {pb / 2**20:14.1f} {'(>limit)':>10} {'':>12}")

    prefix = Path(a.data)
    if not Path(str(prefix) + ".idx").exists():
        print(f"# {prefix}.idx not found: no corpus packing table")
        return
    lengths = corpus_doc_lengths(prefix)
    mask = packed_masks(lengths, a.seq_len, a.rows, seed=1234)
    docs_per_row = float((mask.q_doc[:, -1] + 1).float().mean())
    print(f"\n# corpus {prefix.name}: {len(lengths)} documents, mean {lengths.mean():.0f} / median "
          f"{np.median(lengths):.0f} tokens; {a.rows} rows of {a.seq_len}: {docs_per_row:.1f} documents per row")
    print(f"{'block':>6} {'pairs':>8} {'computed':>9} {'skipped':>8} {'causal-only skipped':>20}")
    for blk in (int(b) for b in a.blocks.split(",")):
        plan = block_plan(mask, blk)
        n = -(-a.seq_len // blk)
        causal = 1 - (n * (n + 1) / 2) / (n * n)
        print(f"{blk:>6} {plan.total:>8} {plan.computed:>9} {1 - plan.computed / plan.total:8.1%} {causal:20.1%}")


if __name__ == "__main__":
    main()
