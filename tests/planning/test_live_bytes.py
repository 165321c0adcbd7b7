"""LiveBytes books exactly the storages alive (real and fake); KnownData keeps integer data real and routes
balanced."""
from __future__ import annotations

import gc

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from k3train.planning.fakerun.known_data import KnownData, balanced_topk_indices
from k3train.planning.fakerun.live_bytes import LiveBytes


def test_live_bytes_real_alloc_free_and_views():
    lb = LiveBytes()
    with lb:
        a = torch.empty(1000, 250)          # 1,000,000 bytes
        v = a[:10]                          # a view: no new storage
        b = a * 2
        assert lb.live == 2_000_000
        del b
        gc.collect()
        assert lb.live == 1_000_000 and lb.peak == 2_000_000
        del a, v
        gc.collect()
        assert lb.live == 0


def _sin_matmul_step(lb: LiveBytes) -> tuple[int, int]:
    x = torch.empty(100, 100).requires_grad_()     # 40,000 bytes
    y = (x @ x).sin().sum()
    after_forward = lb.live
    y.backward()
    return after_forward, lb.peak


def test_live_bytes_fake_equals_real():
    """Fake tensors are booked exactly like real ones: y = sin(x @ x).sum() keeps x and x@x for backward (sin's
    output is freed: sum's backward needs only its shape); the backward's peak adds the gradients."""
    lb_real = LiveBytes()
    with lb_real:
        real = _sin_matmul_step(lb_real)
    fm, lb_fake = FakeTensorMode(), LiveBytes()
    with fm, lb_fake:
        fake = _sin_matmul_step(lb_fake)
    assert real[0] == 80_004
    assert fake == real and real[1] >= 4 * 40_000


def test_known_data_keeps_indices_real_and_routing_balanced():
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    with fm, KnownData():
        scores = torch.empty(12, 8)                      # fake router scores
        _, idx = torch.topk(scores, 3, dim=-1)
        counts = torch.bincount(idx.reshape(-1), minlength=8)
        change = (doc_ids[:, 1:] != doc_ids[:, :-1]).sum()
    assert not isinstance(idx, FakeTensor) and not isinstance(counts, FakeTensor)
    assert counts.tolist() == [36 // 8 + (1 if e < 36 % 8 else 0) for e in range(8)]
    assert int(change) == 2
    idx = balanced_topk_indices(5, 3, 7, torch.device("cpu"))
    assert all(len(set(r)) == 3 for r in idx.tolist())


def test_another_thread_is_booked_inside_on_this_thread():
    """The mode is thread-local (F/B pairing's worker thread allocates outside it): ``on_this_thread`` books what
    another thread creates, in the same counts (k3train.planning.calibration.measure_memory wraps the pair worker with it)."""
    import threading

    lb = LiveBytes()
    held: dict[str, torch.Tensor] = {}

    def work(key: str, booked: bool) -> None:
        if booked:
            with lb.on_this_thread():
                held[key] = torch.ones(1000, dtype=torch.float32)
        else:
            held[key] = torch.ones(1000, dtype=torch.float32)

    with lb:
        base = lb.live
        for key, booked in (("outside", False), ("inside", True)):
            th = threading.Thread(target=work, args=(key, booked))
            th.start()
            th.join()
        assert lb.live - base == 4000  # the booked thread's tensor only
        del held["inside"]
        assert lb.live == base and lb.peak >= base + 4000
