"""MoonEP redundant-expert planner: pure, deterministic, no torch.distributed (spec "MoonEP").

Setting. ``E`` routed experts on ``R`` expert-parallel ranks; rank ``h`` owns the *home group*
``[h*n, (h+1)*n)``, ``n = E / R``. For one micro-batch and one layer the EP group's routes give per-expert counts
``c[E]`` (tokens x top-k entries, summed over the group; ``T = sum c``). Without redundancy rank ``h`` computes
``L_h = sum_{e in home h} c_e`` entries, which is as skewed as the routing. MoonEP lets a rank additionally host
up to ``n`` *replicas* of foreign experts (weights prefetched from the owner for this layer only) so that every
rank computes exactly its *capacity* ``cap_r`` (``floor(T/R)``, plus one for the first ``T mod R`` ranks; with
the same tokens on every rank, ``T = R*N*k`` and ``cap_r = N*k``).

Algorithm (:func:`plan_redundant_experts`):

1. *Receivers.* ``balance_h = L_h - cap_h``. While some rank is over capacity: take the most overloaded home group
   ``h`` and the rank ``u`` with the most room (lowest index on ties) and move ``u``'s whole deficit ``-balance_u``
   from ``h`` to ``u``: ``balance_h -= deficit, balance_u = 0``. ``h`` may overshoot below zero and then becomes
   a receiver itself (a chain). A filled rank is never touched again, so every rank is filled by **one home
   group at most** and hosts at most ``n`` replicas; at most ``R - 1`` moves.
2. *Experts.* Inside each home group, repeatedly serve the largest remaining quota from the expert with the most
   remaining tokens (``take = min(quota, remaining)``).

Guarantees (all tested in ``tests/moonep/test_planner.py``, property-based):
- every entry is assigned exactly once: ``alloc.sum(1) == c``, ``alloc >= 0``;
- perfect balance: ``alloc.sum(0) == cap`` (max load = ``ceil(T/R)``, so the receive buffer is ``N*k`` rows);
- replicas per rank ``<= n = E/R``, all from one home group; no replica when the routing is already balanced;
- feasibility: a move of ``deficit_u <= cap_u <= cap_h + balance_h`` never asks a group for more tokens than it
  still holds, so step 2 always finds them.
- worst-case lower bound: the instance "one rank's experts cold, the other ``E(R-1)/R`` experts equally hot"
  forces ANY planner that balances perfectly to host ``ceil(E(R-1)/R^2)`` replicas on the cold rank (each foreign
  expert carries ``c = cap*R/(n(R-1))`` entries, the cold rank needs ``cap``); :func:`replica_lower_bound`
  computes that per-instance certificate and no input with ``R | T`` pushes it past ``ceil(E(R-1)/R^2)``.
- this planner MEETS that bound: with ``R | T`` (equal tokens per rank) no rank hosts more than
  ``ceil(E(R-1)/R^2) = ceil(n(R-1)/R)`` replicas, so it is worst-case optimal. Proof: deficits only shrink, so a
  group's quotas are created (and served) in non-increasing order. When ``h`` hands quota ``q`` to ``u``, ``u``
  has the largest deficit ``q <= cap`` and ``h`` the largest excess, which is ``>= q/(R-1)`` (the positive
  balances, on at most ``R-1`` ranks, sum to ``>= q``); so ``h``'s experts still hold ``S >= cap + q/(R-1) >=
  qR/(R-1)`` entries. Largest-first serving uses ``j`` experts with ``(j-1)`` largest summing below ``q``, and
  the ``j-1`` largest of ``n`` hold ``>= (j-1)S/n``: ``j-1 < qn/S <= n(R-1)/R``. For K3 (E=896, R=64) the bound
  is 14 = E/R. With unequal tokens per rank the guarantee is ``E/R``.

Token split (:func:`split_tokens`): the entries of expert ``e`` are ordered globally by (source rank, local
order) and cut into consecutive segments for destination ranks ``0, 1, ..., R-1`` of sizes ``alloc[e, :]``;
every rank can compute the whole ``[src, dst, e]`` matrix from the all-gathered ``[R, E]`` counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Plan:
    """Where each expert's entries are computed for one (micro-batch, layer).

    ``alloc[e, d]`` entries of expert ``e`` computed on rank ``d``; ``replicas[d]`` the foreign experts rank ``d``
    hosts, in slot order (ascending expert id); ``home[d]`` the home group they come from (-1: none);
    ``capacity[d]`` the target load.
    """

    num_experts: int
    num_ranks: int
    counts: np.ndarray  # [E] int64
    capacity: np.ndarray  # [R] int64
    alloc: np.ndarray  # [E, R] int64
    replicas: tuple[tuple[int, ...], ...]
    home: np.ndarray  # [R] int64

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def owner(self, e: int) -> int:
        return e // self.experts_per_rank

    @property
    def loads_before(self) -> np.ndarray:
        """``[R]`` entries each rank would compute without redundancy (its home group's counts)."""
        return self.counts.reshape(self.num_ranks, -1).sum(1)

    @property
    def loads_after(self) -> np.ndarray:
        """``[R]`` entries each rank computes under this plan."""
        return self.alloc.sum(0)

    @property
    def num_replicas(self) -> np.ndarray:
        return np.array([len(r) for r in self.replicas], dtype=np.int64)

    @property
    def moved_entries(self) -> int:
        """Entries computed away from their expert's owner."""
        owners = np.arange(self.num_experts) // self.experts_per_rank
        return int(self.counts.sum() - self.alloc[np.arange(self.num_experts), owners].sum())

    def slot_table(self) -> np.ndarray:
        """``[R, E]`` int64: the compute group of expert ``e`` on rank ``d`` (``0..n-1`` own experts by local index,
        ``n + s`` replica slot ``s``) or -1 where ``d`` computes nothing of ``e``'s."""
        n = self.experts_per_rank
        table = np.full((self.num_ranks, self.num_experts), -1, dtype=np.int64)
        for d in range(self.num_ranks):
            table[d, d * n:(d + 1) * n] = np.arange(n)
            for s, e in enumerate(self.replicas[d]):
                table[d, e] = n + s
        return table


def check_counts(counts: Sequence[int] | np.ndarray, num_ranks: int) -> np.ndarray:
    c = np.asarray(counts, dtype=np.int64).reshape(-1)
    if num_ranks < 1 or c.size % num_ranks != 0:
        raise ValueError(f"planner: num_experts={c.size} must be a positive multiple of num_ranks={num_ranks}")
    if (c < 0).any():
        raise ValueError("planner: negative expert count")
    return c


def balanced_capacity(total: int, num_ranks: int) -> np.ndarray:
    """``[R]``: ``floor(T/R)`` each, one more for the first ``T mod R`` ranks (sums to ``T``)."""
    cap = np.full(num_ranks, total // num_ranks, dtype=np.int64)
    cap[: total % num_ranks] += 1
    return cap


def plan_static(counts: Sequence[int] | np.ndarray, num_ranks: int) -> Plan:
    """Plain EP: every expert computed on its owner (no replicas). Same fields as the MoonEP plan."""
    c = check_counts(counts, num_ranks)
    n = c.size // num_ranks
    alloc = np.zeros((c.size, num_ranks), dtype=np.int64)
    alloc[np.arange(c.size), np.arange(c.size) // n] = c
    return Plan(c.size, num_ranks, c, balanced_capacity(int(c.sum()), num_ranks), alloc,
                tuple(() for _ in range(num_ranks)), np.full(num_ranks, -1, dtype=np.int64))


def plan_redundant_experts(counts: Sequence[int] | np.ndarray, num_ranks: int) -> Plan:
    """MoonEP plan for global per-expert entry counts ``counts[E]`` on ``num_ranks`` ranks (module docstring).

    Pure and deterministic: every rank computes the identical plan from the same counts.
    """
    c = check_counts(counts, num_ranks)
    R, E = num_ranks, c.size
    n = E // R
    cap = balanced_capacity(int(c.sum()), R)
    balance = c.reshape(R, n).sum(1) - cap
    quota = np.zeros((R, R), dtype=np.int64)  # quota[h, u]: entries home group h hands to rank u
    home = np.full(R, -1, dtype=np.int64)
    while True:
        h = int(np.argmax(balance))  # argmax/argmin return the lowest index on ties: deterministic
        if balance[h] <= 0:
            break
        u = int(np.argmin(balance))
        quota[h, u] = -balance[u]
        balance[h] += balance[u]
        balance[u] = 0
        home[u] = h
    alloc = np.zeros((E, R), dtype=np.int64)
    alloc[np.arange(E), np.arange(E) // n] = c
    for h in range(R):
        q = quota[h].copy()
        remaining = c[h * n:(h + 1) * n].copy()
        while q.max() > 0:
            u = int(np.argmax(q))
            j = int(np.argmax(remaining))
            take = min(int(q[u]), int(remaining[j]))
            if take <= 0:  # unreachable by the feasibility argument; guard against silent loops
                raise AssertionError("planner: home group ran out of tokens")
            alloc[h * n + j, u] += take
            alloc[h * n + j, h] -= take
            remaining[j] -= take
            q[u] -= take
    replicas = []
    for d in range(R):
        mask = alloc[:, d] > 0
        mask[d * n:(d + 1) * n] = False
        replicas.append(tuple(int(e) for e in np.flatnonzero(mask)))
    return Plan(E, R, c, cap, alloc, tuple(replicas), home)


def make_plan(counts: Sequence[int] | np.ndarray, num_ranks: int, moonep: bool) -> Plan:
    return plan_redundant_experts(counts, num_ranks) if moonep else plan_static(counts, num_ranks)


def split_tokens(plan: Plan, counts_by_src: np.ndarray) -> np.ndarray:
    """``[R_src, R_dst, E]`` int64: entries of expert ``e`` that source rank ``s`` sends to rank ``d``.

    ``counts_by_src[s, e]`` are the per-source counts (their column sums are ``plan.counts``). Expert ``e``'s
    entries in (source, local order) form the global sequence ``0..c_e-1``; destination ``d`` takes the
    ``[A[e, d-1], A[e, d])`` part, ``A = cumsum(alloc, 1)``; source ``s`` holds ``[P[s-1, e], P[s, e])``,
    ``P = cumsum(counts_by_src, 0)``. The overlap of the two intervals is the answer.
    """
    cbs = np.asarray(counts_by_src, dtype=np.int64)
    if cbs.shape != (plan.num_ranks, plan.num_experts) or not np.array_equal(cbs.sum(0), plan.counts):
        raise ValueError("split_tokens: counts_by_src must be [R, E] and sum to the plan's counts")
    src_hi = np.cumsum(cbs, 0)  # [S, E]
    src_lo = src_hi - cbs
    dst_hi = np.cumsum(plan.alloc, 1).T  # [D, E]
    dst_lo = dst_hi - plan.alloc.T
    lo = np.maximum(src_lo[:, None, :], dst_lo[None, :, :])
    hi = np.minimum(src_hi[:, None, :], dst_hi[None, :, :])
    return np.clip(hi - lo, 0, None)


# ----------------------------------------------------------------------------------------------------------------
# Bounds
# ----------------------------------------------------------------------------------------------------------------
def redundancy_upper_bound(num_experts: int, num_ranks: int) -> int:
    """``E/R``: replicas per rank this planner may use (one foreign home group)."""
    return num_experts // num_ranks


def redundancy_lower_bound(num_experts: int, num_ranks: int) -> int:
    """``ceil(E(R-1)/R^2)``: replica slots per rank that perfect balance needs in the worst case."""
    return -(-num_experts * (num_ranks - 1) // (num_ranks * num_ranks))


def replica_lower_bound(counts: Sequence[int] | np.ndarray, num_ranks: int) -> int:
    """Certificate: replicas that ANY perfectly balancing plan must put on some rank for these counts.

    A rank ``r`` below capacity must take ``cap_r - L_r`` entries from foreign experts, one replica per expert,
    each replica carrying at most that expert's count; so it needs at least the smallest ``j`` whose ``j``
    largest foreign counts reach the deficit.
    """
    c = check_counts(counts, num_ranks)
    n = c.size // num_ranks
    cap = balanced_capacity(int(c.sum()), num_ranks)
    best = 0
    for r in range(num_ranks):
        deficit = int(cap[r] - c[r * n:(r + 1) * n].sum())
        if deficit <= 0:
            continue
        foreign = np.sort(np.delete(c, np.arange(r * n, (r + 1) * n)))[::-1]
        best = max(best, int(np.searchsorted(np.cumsum(foreign), deficit)) + 1)
    return best


def worst_case_counts(num_experts: int, num_ranks: int, scale: int = 1) -> np.ndarray:
    """The instance attaining :func:`redundancy_lower_bound`: rank 0's experts receive nothing, every other
    expert ``R^2 * scale`` entries (so ``T`` and ``cap = R*scale*n*(R-1)`` are integers)."""
    n = num_experts // num_ranks
    c = np.full(num_experts, num_ranks * num_ranks * scale, dtype=np.int64)
    c[:n] = 0
    return c


def zipf_counts(num_experts: int, tokens: int, k: int, alpha: float, rng: np.random.Generator,
                permute: bool = True) -> np.ndarray:
    """Per-expert entry counts of ``tokens`` tokens routed top-``k`` (distinct experts per token) with Zipf(alpha)
    expert popularity (benchmarks and tests; popularity ranks randomly placed over experts if ``permute``)."""
    pop = 1.0 / np.arange(1, num_experts + 1) ** alpha
    if permute:
        pop = pop[rng.permutation(num_experts)]
    logp = np.log(pop).astype(np.float32)[None, :]
    counts = np.zeros(num_experts, dtype=np.int64)
    for start in range(0, tokens, 4096):  # Gumbel top-k = k distinct experts, P ~ popularity; chunked for memory
        rows = min(4096, tokens - start)
        g = logp + rng.gumbel(size=(rows, num_experts)).astype(np.float32)
        top = np.argpartition(-g, k - 1, axis=1)[:, :k]
        counts += np.bincount(top.reshape(-1), minlength=num_experts)
    return counts


def max_over_mean(loads: np.ndarray) -> float:
    """max/mean of per-rank loads (1.0 = perfectly balanced; 0 when empty)."""
    loads = np.asarray(loads, dtype=np.float64)
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 0.0


__all__ = [
    "Plan", "balanced_capacity", "plan_static", "plan_redundant_experts", "make_plan", "split_tokens",
    "redundancy_upper_bound", "redundancy_lower_bound", "replica_lower_bound", "worst_case_counts",
    "zipf_counts", "max_over_mean",
]

