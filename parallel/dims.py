"""``ParallelDims``: the one object that knows the parallel layout and owns its process groups.

Rank layout (slowest to fastest): ``pp, dp, cp`` -- ``rank = (pp_rank * dp + dp_rank) * cp + cp_rank``, as
Megatron's default order ``tp-cp-ep-dp-pp`` without tp. Expert parallelism is carved out of the ``dp x cp``
ranks of one pipeline stage: flatten ``(dp_rank, cp_rank)`` to ``dpcp_rank = dp_rank * cp + cp_rank``; an EP group
is ``ep`` consecutive dpcp ranks, and the expert-data-parallel (EDP) group joins the ranks with the same EP index
across the ``dp*cp/ep`` EP groups.

Groups (all ``None`` when their size is 1 or torch.distributed is not initialised):
    ``pp``    ranks of one pipeline, same (dp, cp) -- point-to-point activations
    ``dp``    same (pp, cp) -- ZeRO ownership of dense parameters when cp == 1
    ``cp``    same (pp, dp) -- KCP / MLA context parallel
    ``dp_cp`` same pp -- gradient reduction of dense parameters, QB histogram all-reduce (every router rank)
    ``ep``    expert-parallel group inside dp_cp -- token all-to-all
    ``edp``   expert-data-parallel group -- gradient reduction of routed-expert parameters
    ``embd``  first + last pipeline rank of one pipeline (same dp, cp) -- sums the gradients of the embedding
              copies when the MTP on the last stage shares ``embed_tokens`` (added by the pipeline worker)
    ``ep_pair`` (only after :meth:`build_twin_groups`) a second EP group over the same ranks: side 1 of F/B
              pairing (``parallel.overlap_ep``, parallel/pairing.py), so the paired forward's all-to-alls and the
              backward's never share a group
    ``cp_pair`` (the same, for ``cp`` under F/B pairing): side 1's CP group; :meth:`sided` hands out both

No module-level globals: the object is built once and passed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallel.pairing import SidedGroup


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; raised before any process group is built."""


@dataclass
class ParallelDims:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    world_size: int = 1
    rank: int = 0
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    group_ranks: dict[str, list[int]] = field(default_factory=dict, repr=False)
    # collective timeout of every group built here (set by build_groups: given, else the default group's)
    timeout_s: float | None = field(default=None, repr=False)
    backend: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        for name in ("pp", "dp", "cp", "ep", "vpp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"parallel.{name} must be a positive integer, got {v!r}")
        if self.pp * self.dp * self.cp != self.world_size:
            raise ParallelConfigError(
                f"pp*dp*cp = {self.pp}*{self.dp}*{self.cp} = {self.pp * self.dp * self.cp} "
                f"does not match world size {self.world_size}")
        if (self.dp * self.cp) % self.ep != 0:
            raise ParallelConfigError(f"parallel.ep={self.ep} must divide dp*cp = {self.dp * self.cp}")
        if not 0 <= self.rank < self.world_size:
            raise ParallelConfigError(f"rank {self.rank} outside world size {self.world_size}")

    @classmethod
    def from_config(cls, pcfg: Any, world_size: int, rank: int) -> "ParallelDims":
        dp = pcfg.dp if pcfg.dp != -1 else world_size // max(1, pcfg.pp * pcfg.cp)
        return cls(pp=pcfg.pp, dp=dp, cp=pcfg.cp, ep=pcfg.ep, vpp=pcfg.vpp, world_size=world_size, rank=rank)

    # ------------------------------------------------------------------------------------------------------
    # coordinates
    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.cp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.cp) % self.dp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def dpcp_rank(self) -> int:
        return self.rank % (self.dp * self.cp)

    @property
    def ep_rank(self) -> int:
        return self.dpcp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dpcp_rank // self.ep

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def rank_of(self, pp_rank: int, dp_rank: int, cp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.cp + cp_rank

    # ------------------------------------------------------------------------------------------------------
    def _enumerate_groups(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, as global-rank lists, in a fixed order (all ranks must agree)."""
        P, D, C, E = self.pp, self.dp, self.cp, self.ep
        out: dict[str, list[list[int]]] = {"pp": [], "dp": [], "cp": [], "dp_cp": [], "ep": [], "edp": [],
                                           "embd": []}
        for d in range(D):
            for c in range(C):
                out["pp"].append([self.rank_of(p, d, c) for p in range(P)])
                # embd: first + last pipeline rank of one pipeline (the MTP's copy of the shared embedding)
                out["embd"].append([self.rank_of(0, d, c)] + ([self.rank_of(P - 1, d, c)] if P > 1 else []))
        for p in range(P):
            for c in range(C):
                out["dp"].append([self.rank_of(p, d, c) for d in range(D)])
            for d in range(D):
                out["cp"].append([self.rank_of(p, d, c) for c in range(C)])
            base = p * D * C
            out["dp_cp"].append([base + i for i in range(D * C)])
            for g in range(D * C // E):
                out["ep"].append([base + g * E + e for e in range(E)])
            for e in range(E):
                out["edp"].append([base + g * E + e for g in range(D * C // E)])
        return out

    def all_group_ranks(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` ('pp', 'dp', 'cp', 'dp_cp', 'ep', 'edp', ...) as global-rank lists, in the order
        all ranks create them (for building companion groups, e.g. MoonEP's weight-traffic groups)."""
        groups = self._enumerate_groups()
        if kind not in groups:
            raise KeyError(f"unknown group kind {kind!r} (known: {', '.join(groups)})")
        return groups[kind]

    def build_groups(self, backend: str | None = None, timeout_s: float | None = None) -> "ParallelDims":
        """Create the process groups (collective call: every rank must call it). Size-1 groups stay ``None``.

        ``timeout_s``: how long any collective of these groups (and of :meth:`new_group` groups) may wait for its
        peers; pass the world's (``DistEnv.collective_timeout_s``) -- ``dist.new_group`` does NOT inherit it from
        the default group, and its own default (30 min on gloo) would let a dead peer hang the job that long.
        Without ``timeout_s`` the default group's own timeout is used."""
        self.timeout_s = timeout_s if timeout_s is not None else _world_timeout_s()
        self.backend = backend
        all_groups = self._enumerate_groups()
        for name, lists in all_groups.items():
            for ranks in lists:
                if self.rank in ranks:
                    self.group_ranks[name] = ranks
            if not dist.is_initialized() or len(lists[0]) == 1:
                self.groups[name] = None
                continue
            for ranks in lists:
                g = self.new_group(ranks, name)
                if self.rank in ranks:
                    self.groups[name] = g
        return self

    def build_twin_groups(self, kind: str, name: str) -> Any:
        """A second set of groups with the ranks of every ``kind`` group, stored as ``name`` (e.g. ``ep_pair``);
        returns this rank's (None for size-1 groups or without torch.distributed). Collective over the world:
        every rank calls it, in the same order; a second call returns the groups already built."""
        if name in self.groups:
            return self.groups[name]
        lists = self.all_group_ranks(kind)
        for ranks in lists:
            if self.rank in ranks:
                self.group_ranks[name] = ranks
        self.groups[name] = None
        if dist.is_initialized() and len(lists[0]) > 1:
            for ranks in lists:
                g = self.new_group(ranks, name)
                if self.rank in ranks:
                    self.groups[name] = g
        return self.groups[name]

    def sided(self, kind: str) -> Any:
        """``kind``'s group for collectives that may run on either F/B-pairing side: a
        :class:`parallel.pairing.SidedGroup` of ``kind`` and ``kind + '_pair'`` once :meth:`build_twin_groups`
        built the twin, else ``group(kind)`` (None for a size-1 group)."""
        g, twin = self.groups.get(kind), self.groups.get(f"{kind}_pair")
        if g is None or twin is None:
            return g

        return SidedGroup((g, twin))

    def new_group(self, ranks: list[int], desc: str) -> Any:
        """:func:`new_group` with this layout's backend and timeout. Collective over the world."""
        return new_group(ranks, desc, backend=self.backend, timeout_s=self.timeout_s)

    def group(self, name: str) -> Any:
        return self.groups.get(name)

    def ranks(self, name: str) -> list[int]:
        return self.group_ranks.get(name, [self.rank])

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def describe(self) -> str:
        return (f"world={self.world_size} pp={self.pp} (vpp={self.vpp}) dp={self.dp} cp={self.cp} ep={self.ep}; "
                f"rank {self.rank} = pp{self.pp_rank} dp{self.dp_rank} cp{self.cp_rank} ep{self.ep_rank}")


def new_group(ranks: list[int] | None, desc: str, backend: str | None = None, timeout_s: float | None = None) -> Any:
    """``dist.new_group`` for every group of the run (collective over the world): named ``desc`` (torch's
    ``group_desc``, shown in NCCL's errors and in k3train's one-line collective-failure message), with the
    collective timeout ``timeout_s`` or else the default group's -- ``dist.new_group`` alone would not inherit it
    and would wait 30 min (gloo) on a dead peer."""
    t = timeout_s if timeout_s is not None else _world_timeout_s()
    return dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=t) if t else None, group_desc=desc)


def _world_timeout_s() -> float | None:
    """The default process group's collective timeout, so that groups built without an explicit one match it.
    torch has no public getter: read the backend's options, and fall back to torch's default if that changes."""
    if not dist.is_initialized():
        return None
    try:
        dev = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(dev).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def single_process_dims() -> ParallelDims:
    return ParallelDims().build_groups()


def all_reduce_(t: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In-place all-reduce over ``group``; a no-op for ``None`` (size-1) groups."""
    if group is not None:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t
