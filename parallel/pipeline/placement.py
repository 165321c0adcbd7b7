"""Where the virtual pipeline stages live: the one definition of Megatron's interleaved placement.

``n = pp * vpp`` virtual stages ``v = 0..n-1``; stage ``v`` runs on pipeline rank ``v % pp`` as that rank's local
chunk ``v // pp``. So rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``, a micro-batch visits every rank ``vpp``
times, and the stage a rank ran *before* ``v`` for the same micro-batch is ``v - pp`` (its previous local chunk,
whose outputs the AttnRes block cache still holds).

Schedules, p2p programs, the runner, the partition and the AttnRes plan all ask a :class:`Placement` instead of
re-deriving these formulas, so a different placement (e.g. a V-shape) would change one class.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Virtual stage <-> (pipeline rank, local chunk) for ``pp`` ranks with ``vpp`` chunks each."""

    pp: int
    vpp: int

    def __post_init__(self) -> None:
        if self.pp < 1 or self.vpp < 1:
            raise ValueError(f"placement needs pp >= 1 and vpp >= 1, got pp={self.pp} vpp={self.vpp}")

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(pp: int, vpp: int) -> "Placement":
        """A shared instance (the schedule helpers ask for one per call)."""
        return Placement(pp, vpp)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def _check(self, v: int) -> int:
        if not 0 <= v < self.num_stages:
            raise ValueError(f"virtual stage {v} outside 0..{self.num_stages - 1} (pp={self.pp}, vpp={self.vpp})")
        return v

    # ---- stage -> where --------------------------------------------------------------------------------------
    def rank_of(self, v: int) -> int:
        """Pipeline rank hosting virtual stage ``v``."""
        return self._check(v) % self.pp

    def chunk_of(self, v: int) -> int:
        """Local chunk index of virtual stage ``v`` on its rank."""
        return self._check(v) // self.pp

    # ---- where -> stage --------------------------------------------------------------------------------------
    def stage(self, pp_rank: int, chunk: int) -> int:
        """Virtual stage of local chunk ``chunk`` on pipeline rank ``pp_rank``."""
        if not (0 <= pp_rank < self.pp and 0 <= chunk < self.vpp):
            raise ValueError(f"(rank {pp_rank}, chunk {chunk}) outside pp={self.pp} x vpp={self.vpp}")
        return chunk * self.pp + pp_rank

    def local_stages(self, pp_rank: int) -> list[int]:
        """The virtual stages of ``pp_rank``, in local chunk order."""
        return [self.stage(pp_rank, c) for c in range(self.vpp)]

    # ---- neighbours ------------------------------------------------------------------------------------------
    def prev_local(self, v: int) -> int | None:
        """The stage the same rank ran before ``v`` for a micro-batch (its previous local chunk), or None."""
        return self._check(v) - self.pp if v >= self.pp else None

    def next_local(self, v: int) -> int | None:
        """The stage the same rank runs after ``v`` for a micro-batch (its next local chunk), or None."""
        return self._check(v) + self.pp if v + self.pp < self.num_stages else None

    def is_first(self, v: int) -> bool:
        return self._check(v) == 0

    def is_last(self, v: int) -> bool:
        return self._check(v) == self.num_stages - 1

    @property
    def first_rank(self) -> int:
        """Rank of the first virtual stage (the embedding)."""
        return self.rank_of(0)

    @property
    def last_rank(self) -> int:
        """Rank of the last virtual stage (head, loss, MTP)."""
        return self.rank_of(self.num_stages - 1)

    def last_chunk(self) -> int:
        """Local chunk (on :attr:`last_rank`) of the last virtual stage."""
        return self.chunk_of(self.num_stages - 1)

    def boundary_ranks(self, b: int) -> tuple[int, int]:
        """``(rank of stage b, rank of stage b + 1)``: the two ends of boundary ``b``."""
        return self.rank_of(b), self.rank_of(b + 1)
