"""Process-group initialisation from torchrun's environment (or a single process without torch.distributed)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


# ``log.warning(..., extra=RANK_SPECIFIC)``: a warning only this rank can see; every other warning is logged by
# rank 0 alone (the trainer's logging set-up drops it on the other ranks, which reach the same one)
RANK_SPECIFIC = {"rank_specific": True}


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    collective_timeout_s: float = 0.0  # what every process group of this run was created with (0: no group)
    num_threads: int = 0  # torch intra-op threads of this rank (0: left as torch chose, e.g. on GPU)
    threads_reason: str = ""  # where num_threads came from, for the start-up log line

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """World size as torchrun announces it, readable before any process group exists (for config checks)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def child_pythonpath(root: object) -> str:
    """``PYTHONPATH`` for a child process of this checkout (torchrun workers, the tools' and tests' runs): the
    checkout first, then the caller's own ``PYTHONPATH`` (packages installed outside site-packages, e.g. with
    ``pip --target``, must reach the child too)."""
    return os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])


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


def cores_available() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s share, not the whole
    machine's ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def ranks_on_this_host(world_size: int) -> int:
    """How many ranks of the default process group run on this host, counted by hostname over the group.

    Collective (an ``all_gather_object`` every rank joins once, at start-up). ``LOCAL_WORLD_SIZE`` would count
    only this torchrun agent's ranks: two agents on one machine (a 2-"node" rehearsal) would each take every
    core."""
    if not dist.is_initialized() or world_size == 1:
        return 1
    names: list[str | None] = [None] * world_size
    dist.all_gather_object(names, socket.gethostname())
    return max(1, names.count(socket.gethostname()))


def choose_num_threads(configured: int, world_size: int) -> tuple[int, str]:
    """Torch intra-op threads for one CPU rank, and why (logged at start-up). In order: ``train.num_threads``
    when > 0; ``OMP_NUM_THREADS`` when exported (torch already read it; it is kept -- torchrun exports 1 itself
    when nproc_per_node > 1 and it is unset, ``k3train train`` does not); otherwise the cores this process may
    use shared among the ranks on this host (:func:`ranks_on_this_host`: collective, so it runs on every rank
    whatever the first two rules give)."""
    local = ranks_on_this_host(world_size)
    cores = cores_available()
    if configured > 0:
        return configured, f"train.num_threads={configured}"
    # K3TRAIN_THREADS_AUTO=1: `k3train train` set OMP_NUM_THREADS=1 only to stop torchrun exporting its own 1
    env = "" if os.environ.get("K3TRAIN_THREADS_AUTO") == "1" else os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env}"
    n = max(1, cores // local)
    return n, f"{cores} cores available / {local} rank(s) on host {socket.gethostname()}"


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = 0.0,
                     num_threads: int = 0) -> DistEnv:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE set) -- even for one process, so the
    same code path runs -- and pick the device. A plain ``python -m`` run stays without a process group.

    ``timeout_s`` (0: backend default) bounds every collective of the default group; groups built later take the
    same value from ``DistEnv.collective_timeout_s`` (``ParallelDims.build_groups``). On NCCL, asynchronous error
    handling is switched on before init (torchrun does the same; other launchers may not), so a collective that
    times out aborts the communicator and raises instead of leaving the GPU stream blocked forever.

    On CPU, ``num_threads`` (``train.num_threads``, 0 = automatic) and :func:`choose_num_threads` set torch's
    intra-op threads once the group exists."""
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
        dist.init_process_group(be, timeout=timedelta(seconds=timeout),
                                device_id=dev if dev.type == "cuda" else None)
    elif dist.is_initialized():
        be = dist.get_backend()
        timeout = collective_timeout_s(timeout_s, be)
    threads, why = 0, ""
    if dev.type == "cpu":
        threads, why = choose_num_threads(num_threads, dist.get_world_size() if dist.is_initialized() else 1)
        torch.set_num_threads(threads)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, backend=be, device=dev,
                   collective_timeout_s=timeout, num_threads=threads, threads_reason=why)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
