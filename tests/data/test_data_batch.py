"""Batch construction on hand-built samples, against a per-token loop reference."""
from __future__ import annotations

import torch

from k3train.data.batch import Batch

E = 1  # EOS id in these tests
P = 2  # PAD id


def reference_batch(samples: torch.Tensor, eos: int, pad: int | None = None) -> dict[str, torch.Tensor]:
    """Per-token reading of the rules in k3train/data/batch.py (slow, obvious)."""
    B, T = samples.shape[0], samples.shape[1] - 1
    out = {k: torch.zeros(B, T, dtype=torch.long) for k in ("tokens", "labels", "doc_ids", "positions", "mtp_labels")}
    out["loss_mask"] = torch.zeros(B, T)
    out["mtp_loss_mask"] = torch.zeros(B, T)
    for b in range(B):
        x = [int(v) for v in samples[b]]
        doc = [0] * (T + 1)  # document of every sample token
        for i in range(1, T + 1):
            doc[i] = doc[i - 1] + (1 if x[i - 1] == eos else 0)
        for t in range(T):
            out["tokens"][b, t] = x[t]
            out["labels"][b, t] = x[t + 1]
            out["doc_ids"][b, t] = doc[t]
            out["positions"][b, t] = t
            ok = doc[t + 1] == doc[t] and not (pad is not None and pad in (x[t], x[t + 1]))
            out["loss_mask"][b, t] = float(ok)
            if t + 2 <= T:
                out["mtp_labels"][b, t] = x[t + 2]
                out["mtp_loss_mask"][b, t] = float(doc[t + 2] == doc[t] and not (
                    pad is not None and pad in (x[t], x[t + 1], x[t + 2])))
    return out


def test_hand_built_example():
    # row: doc A = [5 6 E], doc B = [7 E], doc C = [8 9 ...]
    x = torch.tensor([[5, 6, E, 7, E, 8, 9, 10, 11]])  # T = 8
    b = Batch.from_samples(x, eos_id=E)
    assert b.tokens.tolist() == [[5, 6, E, 7, E, 8, 9, 10]]
    assert b.labels.tolist() == [[6, E, 7, E, 8, 9, 10, 11]]
    assert b.doc_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # predicting EOS is trained; predicting the next document's first token from an EOS is not
    assert b.loss_mask.tolist() == [[1, 1, 0, 1, 0, 1, 1, 1]]
    assert b.mtp_labels.tolist() == [[E, 7, E, 8, 9, 10, 11, 0]]
    # t=0: 5 -> E (same doc A) ok; t=1: 6 -> 7 crosses; t=2 EOS; t=3: 7 -> 8 crosses; t=4 EOS;
    # t=5: 8 -> 10 ok; t=6: 9 -> 11 ok; t=7: outside the sample
    assert b.mtp_loss_mask.tolist() == [[1, 0, 0, 0, 0, 1, 1, 0]]
    assert b.num_lm_tokens() == 6 and b.num_mtp_tokens() == 3
    assert b.loss_mask.dtype == torch.float32 and b.doc_ids.dtype == torch.long


def test_matches_reference_random():
    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 3, 16):
        x = torch.randint(0, 6, (5, T + 1), generator=g)  # ids 1 (EOS) and 2 (PAD) appear often
        for pad in (None, P):
            b = Batch.from_samples(x, eos_id=E, pad_id=pad)
            ref = reference_batch(x, E, pad)
            for k, v in ref.items():
                assert torch.equal(getattr(b, k), v), (T, pad, k)


def test_slice_cp_and_micro_batches_reassemble():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 8, (4, 13), generator=g)
    b = Batch.from_samples(x, eos_id=E)
    parts = [b.slice_cp(r, 3) for r in range(3)]
    assert all(p.shape == (4, 4) for p in parts)
    # global meaning is kept: positions and doc_ids are the full-row values
    assert parts[2].positions[0].tolist() == [8, 9, 10, 11]
    assert torch.equal(parts[1].doc_ids, b.doc_ids[:, 4:8])
    again = Batch.cat(parts, dim=1)
    mbs = b.micro_batches(2)
    assert len(mbs) == 2 and mbs[1].shape == (2, 12)
    for k in ("tokens", "labels", "loss_mask", "doc_ids", "positions", "mtp_labels", "mtp_loss_mask"):
        assert torch.equal(getattr(again, k), getattr(b, k))
        assert torch.equal(getattr(Batch.cat(mbs), k), getattr(b, k))
    assert torch.equal(b.to("cpu").mtp_loss_mask, b.mtp_loss_mask)


def test_bad_slices_raise():
    b = Batch.from_samples(torch.zeros(2, 9, dtype=torch.long), eos_id=E)
    for args in ((0, 3), (2, 2)):
        try:
            b.slice_cp(*args)
        except ValueError:
            pass
        else:
            raise AssertionError(f"slice_cp{args} should fail")
    try:
        b.micro_batches(3)
    except ValueError:
        pass
    else:
        raise AssertionError("micro_batches(3) of 2 rows should fail")
