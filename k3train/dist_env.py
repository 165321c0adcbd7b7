"""Process-group initialisation from torchrun's environment (or a single process without torch.distributed)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    collective_timeout_s: float = 0.0  # what every process group of this run was created with (0: no group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """World size as torchrun announces it, readable before any process group exists (for config checks)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available here; use gloo or auto")
    return requested


# how long a collective waits for its peers before failing, when parallel.collective_timeout_s is 0: a few minutes on
# gloo (a CPU rank that is that late is dead or stuck), NCCL's own default on GPU
DEFAULT_COLLECTIVE_TIMEOUT_S = {"gloo": 300.0, "nccl": 600.0}


def collective_timeout_s(requested_s: float, backend: str) -> float:
    """``parallel.collective_timeout_s``, 0 meaning the backend's default above."""
    return float(requested_s) if requested_s > 0 else DEFAULT_COLLECTIVE_TIMEOUT_S.get(backend, 300.0)


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = 0.0) -> DistEnv:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE set) -- even for one process, so the
    same code path runs -- and pick the device. A plain ``python -m`` run stays without a process group.

    ``timeout_s`` (0: backend default) bounds every collective of the default group; groups built later take the
    same value from ``DistEnv.collective_timeout_s`` (``ParallelDims.build_groups``). On NCCL, asynchronous error
    handling is switched on before init (torchrun does the same; other launchers may not), so a collective that
    times out aborts the communicator and raises instead of leaving the GPU stream blocked forever."""
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    be = None
    timeout = 0.0
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        be = resolve_backend(backend)
        timeout = collective_timeout_s(timeout_s, be)
        if be == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if be == "gloo" and dev.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))))
        dist.init_process_group(be, timeout=timedelta(seconds=timeout),
                                device_id=dev if dev.type == "cuda" else None)
    elif dist.is_initialized():
        be = dist.get_backend()
        timeout = collective_timeout_s(timeout_s, be)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, backend=be, device=dev,
                   collective_timeout_s=timeout)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
