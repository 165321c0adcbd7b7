"""RNG state capture/restore for exact resume (python, numpy, torch CPU and CUDA).

The captured state holds only tensors and plain values (dicts, ints, floats, strings, None), so that a checkpoint
stores it in a file ``torch.load(..., weights_only=True)`` reads without unpickling any object (see
k3train/checkpoint/safe_load.py). Python's ``random.getstate()`` is ``(version, 625 ints, gauss_next)``: the 625
ints (624 Mersenne Twister words < 2**32 and the position) become one int64 tensor; numpy's legacy state
``("MT19937", uint32[624] key, pos, has_gauss, cached_gaussian)`` keeps its key as an int64 tensor. Both convert
back losslessly, so a resumed run draws the same numbers as an uninterrupted one.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _python_plain(state: tuple) -> dict[str, Any]:
    version, internal, gauss = state
    return {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": None if gauss is None else float(gauss)}


def _numpy_plain(state: tuple) -> dict[str, Any]:
    name, key, pos, has_gauss, gauss = state
    return {"bit_generator": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}


def plain_rng_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with python's and numpy's states as tensors and plain values (a no-op on a plain state): also
    converts the tuples / numpy arrays that checkpoints written before safe loading hold."""
    out = dict(state)
    if isinstance(out.get("python"), tuple):
        out["python"] = _python_plain(out["python"])
    if isinstance(out.get("numpy"), tuple):
        out["numpy"] = _numpy_plain(out["numpy"])
    return out


def get_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": _python_plain(random.getstate()),
        "numpy": _numpy_plain(np.random.get_state(legacy=True)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured (or :func:`plain_rng_state` converted)."""
    state = plain_rng_state(state)
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["key"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
