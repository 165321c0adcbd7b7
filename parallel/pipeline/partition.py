"""Pipeline partition: which layers run on which virtual stage, and a small cost model to choose it.

Layout: ``n = pp * vpp`` virtual stages ``v = 0..n-1`` each run a contiguous layer range; which rank and local
chunk host stage ``v`` is the :class:`~parallel.pipeline.placement.Placement` (Megatron interleaving: rank
``r`` holds stages ``r, r + pp, ...``), which :class:`PipelinePartition` exposes and delegates to.

The first virtual stage also runs the token embedding, the last one the final AttnRes aggregation, the final norm,
the LM head and the MTP layer. Layers per stage come from ``parallel.pp_layers`` (explicit, ``pp*vpp`` entries)
or from :func:`auto_layers_per_stage`, which minimises the most expensive stage under :func:`layer_cost`
(uneven splits are normal: K3 has 93 layers and a heavy last stage) and breaks ties towards cuts that send fewer
AttnRes tensors, i.e. on block boundaries (K3 at pp=8 vpp=4: 8624 instead of 9296 MiB per micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from k3train.config import ConfigError
from k3train.model.attnres import canonical_layout
from k3train.model.flops import kda_gate_params, moe_latent_params
from parallel.pipeline.placement import Placement


# --------------------------------------------------------------------------------------------------------------
# cost model (forward matmul FLOPs per token; the ratios are what matter for balancing)
# --------------------------------------------------------------------------------------------------------------
def _mixer_flops(m: Any, kind: str, seq_len: int) -> float:
    """Forward FLOPs per token of one token mixer (projections + the sequence-mixing core)."""
    d = m.hidden_size
    if kind == "kda":
        H, K, r = m.kda_num_heads, m.kda_head_dim, m.kda_decay_rank
        hk = H * K
        proj = 3 * d * hk + d * H + d * r + r * hk + kda_gate_params(m) + hk * d  # q,k,v; beta; decay; gate; out
        C = min(m.kda_chunk_size, seq_len)
        core = H * (C * 3 * K + 3 * K * K)  # intra-chunk (qk^T, kk^T, Av) + inter-chunk state work, per token
        return 2.0 * (proj + core)
    H = m.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = d * m.q_lora_rank + m.q_lora_rank * H * qk if m.q_lora_rank > 0 else d * H * qk
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    gate = d * H * m.v_head_dim if m.mla_use_output_gate else 0
    out = H * m.v_head_dim * d
    core = H * (qk + m.v_head_dim) * (seq_len + 1) / 2  # causal: half the keys on average
    return 2.0 * (q + kv + gate + out + core)


def _ffn_flops(m: Any, moe: bool) -> float:
    d = m.hidden_size
    if not moe:
        return 2.0 * 3 * d * m.intermediate_size
    routed = m.num_experts_per_token * 3 * m.expert_hidden_size * m.moe_intermediate_size
    shared = m.num_shared_experts * 3 * d * m.shared_expert_intermediate_size
    return 2.0 * (d * m.num_experts + moe_latent_params(m) + routed + shared)


def layer_cost(m: Any, i: int, seq_len: int) -> float:
    """Forward FLOPs per token of backbone layer ``i`` (0-based): mixer (KDA/MLA) + FFN (dense/MoE) + its two
    AttnRes aggregations (``sources x d`` multiply-adds each, sources = blocks so far + partial)."""
    sources = 2 + i // m.attn_res_block_size
    attnres = 2 * 2.0 * sources * m.hidden_size if m.residual == "attnres" else 0.0
    return _mixer_flops(m, m.layer_kind(i), seq_len) + _ffn_flops(m, m.is_moe_layer(i)) + attnres


def embed_cost(m: Any) -> float:
    """The embedding is a lookup (no matmul); counted as ``2 d`` per token (read + scatter-add in backward)."""
    return 2.0 * m.hidden_size


def head_cost(m: Any, seq_len: int) -> float:
    """Final AttnRes + norm + LM head, plus the MTP layer (an MLA + FFN block, its 2d->d projection and a second
    pass through the shared LM head) when ``num_nextn_predict_layers > 0``."""
    d, V = m.hidden_size, m.vocab_size
    n_sources = 1 + m.num_hidden_layers // m.attn_res_block_size + (m.num_hidden_layers % m.attn_res_block_size > 0)
    cost = 2.0 * d * V + (2.0 * n_sources * d if m.residual == "attnres" else 0.0)
    if m.num_nextn_predict_layers > 0:
        last = m.num_hidden_layers - 1
        cost += (_mixer_flops(m, "mla", seq_len) + _ffn_flops(m, m.is_moe_layer(last)) + 2.0 * 2 * d * d
                 + 2.0 * d * V)
    return cost


# --------------------------------------------------------------------------------------------------------------
# partition
# --------------------------------------------------------------------------------------------------------------
@dataclass
class PipelinePartition:
    """The layer plan. ``bounds[v] = (start, end)``: global layer range of virtual stage ``v``."""

    pp: int
    vpp: int
    bounds: list[tuple[int, int]]
    block_size: int
    stage_costs: list[float] = field(default_factory=list)  # forward FLOPs/token per virtual stage
    kinds: list[str] = field(default_factory=list)  # per layer: 'kda-dense', 'mla-moe', ...
    source: str = "explicit"  # 'explicit' (parallel.pp_layers) | 'auto' (cost model) | 'single'
    residual: str = "attnres"  # model.residual: what crosses a cut (see parallel/pipeline/attnres_comm.py)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def num_layers(self) -> int:
        return self.bounds[-1][1]

    @property
    def placement(self) -> Placement:
        """Virtual stage <-> (rank, local chunk); the methods below delegate to it."""
        return Placement.of(self.pp, self.vpp)

    def rank_of(self, v: int) -> int:
        """Pipeline rank hosting virtual stage ``v``."""
        return self.placement.rank_of(v)

    def chunk_of(self, v: int) -> int:
        """Local chunk index of virtual stage ``v`` on its rank."""
        return self.placement.chunk_of(v)

    def stage(self, pp_rank: int, chunk: int) -> int:
        """Virtual stage of ``(pp_rank, chunk)``."""
        return self.placement.stage(pp_rank, chunk)

    def local_stages(self, pp_rank: int) -> list[int]:
        return self.placement.local_stages(pp_rank)

    def local_chunks(self, pp_rank: int) -> list[tuple[int, int]]:
        """``(start, end)`` layer ranges of this rank's chunks, in chunk order."""
        return [self.bounds[v] for v in self.local_stages(pp_rank)]

    def layers_per_stage(self) -> list[int]:
        return [e - s for s, e in self.bounds]

    def stage_of_layer(self, layer: int) -> int:
        for v, (s, e) in enumerate(self.bounds):
            if s <= layer < e:
                return v
        raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")


def _stage_cost(costs: list[float], s: int, e: int, v: int, n: int, first: float, last: float) -> float:
    return sum(costs[s:e]) + (first if v == 0 else 0.0) + (last if v == n - 1 else 0.0)


def auto_layers_per_stage(costs: list[float], n_stages: int, first_extra: float, last_extra: float,
                          cut_weight: Callable[[int, int], float] | None = None,
                          placement: Placement | None = None) -> list[int]:
    """Contiguous split of ``len(costs)`` layers into ``n_stages`` non-empty stages minimising the most expensive
    stage (stage 0 also pays ``first_extra``, the last ``last_extra``). Exact dynamic programme, O(n L^2).

    ``cut_weight(b, end)`` with ``placement``: tie-break (e.g. the AttnRes tensors boundary ``b`` sends when it sits
    after layer ``end``, :func:`cut_weight`, which prefers block boundaries).
    Runs of cuts of the optimal split shift to positions of lower weight while the bottleneck stays the
    same (same tolerance) and no rank's load (the sum of its stages' costs) exceeds the heaviest rank's load
    before: equal cost, less traffic. A tie-break by weight alone would trade traffic for near-empty stages
    under a loose bottleneck (K3's head stage), unbalancing the ranks."""
    sizes = _min_bottleneck_split(costs, n_stages, first_extra, last_extra)
    if cut_weight is None or n_stages == 1:
        return sizes
    if placement is None:
        raise ValueError("auto_layers_per_stage: cut_weight needs the placement (rank loads)")
    return _shift_cuts(costs, sizes, first_extra, last_extra, cut_weight, placement)


def _split_costs(costs: list[float], sizes: list[int], first_extra: float, last_extra: float) -> list[float]:
    out, s, n = [], 0, len(sizes)
    for v, k in enumerate(sizes):
        out.append(_stage_cost(costs, s, s + k, v, n, first_extra, last_extra))
        s += k
    return out


def _shift_cuts(costs: list[float], base: list[int], first_extra: float, last_extra: float,
                cut_weight: Callable[[int, int], float], placement: Placement, max_shift: int = 3) -> list[int]:
    """Hill climb from ``base``: shift a run of consecutive cuts by the same few layers (one cut, or e.g. every
    cut after a grown first stage) where that lowers the summed cut weight most, as long as every stage stays
    within the bottleneck and every rank's load (summed stage costs) within the heaviest rank of ``base``."""
    L, n = len(costs), len(base)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    cuts = [0]
    for k in base:
        cuts.append(cuts[-1] + k)  # stage v = layers [cuts[v], cuts[v+1]); boundary b sits at cuts[b+1]

    def stage_cost(v: int, s: int, e: int) -> float:
        return prefix[e] - prefix[s] + (first_extra if v == 0 else 0.0) + (last_extra if v == n - 1 else 0.0)

    def tol(x: float) -> float:
        return x + 1e-9 * max(1.0, abs(x))  # the bottleneck DP's tie tolerance

    stage = [stage_cost(v, cuts[v], cuts[v + 1]) for v in range(n)]
    load = [sum(stage[v] for v in placement.local_stages(r)) for r in range(placement.pp)]
    cap, rank_cap = tol(max(stage)), tol(max(load))
    while True:
        best = None
        for d in [x for k in range(1, max_shift + 1) for x in (k, -k)]:
            for b in range(n - 1):  # first shifted boundary
                if not cuts[b] < cuts[b + 1] + d < cuts[b + 2]:
                    continue  # a stage next to the first shifted cut would be empty
                gain, delta = 0.0, [0.0] * placement.pp
                new_first = stage_cost(b, cuts[b], cuts[b + 1] + d)
                if new_first > cap:
                    continue
                delta[placement.rank_of(b)] += new_first - stage[b]
                for b2 in range(b, n - 1):  # last shifted boundary
                    if cuts[b2 + 2] <= cuts[b2 + 1] + d:
                        break  # the stage after the run would be empty
                    gain += cut_weight(b2, cuts[b2 + 1]) - cut_weight(b2, cuts[b2 + 1] + d)
                    tail = stage_cost(b2 + 1, cuts[b2 + 1] + d, cuts[b2 + 2])  # the stage after the run
                    if gain > 0 and tail <= cap:
                        r = placement.rank_of(b2 + 1)
                        trial = list(delta)
                        trial[r] += tail - stage[b2 + 1]
                        if all(load[q] + trial[q] <= rank_cap for q in range(placement.pp)):
                            key = (-gain, b2 - b, abs(d), b)
                            if best is None or key < best[0]:
                                best = (key, b, b2, d)
                    if b2 + 1 == n - 1 or cuts[b2 + 3] <= cuts[b2 + 2] + d:
                        break  # no further boundary, or shifting it would empty the stage after it
                    inner = stage_cost(b2 + 1, cuts[b2 + 1] + d, cuts[b2 + 2] + d)  # shifted, inside the run
                    if inner > cap:
                        break
                    delta[placement.rank_of(b2 + 1)] += inner - stage[b2 + 1]
        if best is None:
            break
        _, b, b2, d = best
        for k in range(b + 1, b2 + 2):
            cuts[k] += d
        for v in range(b, b2 + 2):
            stage[v] = stage_cost(v, cuts[v], cuts[v + 1])
        load = [sum(stage[v] for v in placement.local_stages(r)) for r in range(placement.pp)]
    return [cuts[v + 1] - cuts[v] for v in range(n)]


def _min_bottleneck_split(costs: list[float], n_stages: int, first_extra: float, last_extra: float) -> list[int]:
    L = len(costs)
    if L < n_stages:
        raise ValueError(f"{L} layers cannot fill {n_stages} virtual stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: min over splits of the first j layers into k stages of the max stage cost; arg[k][j] = cut
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]
    arg = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        # stage k-1 covers layers [i, j); every earlier stage needs >= 1 layer, every later one too
        for j in range(k, L - (n_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                c = prefix[j] - prefix[i] + (first_extra if k == 1 else 0.0) + (last_extra if k == n_stages else 0.0)
                val = max(best[k - 1][i], c)
                if val < best[k][j] - 1e-9 * max(1.0, abs(val)):
                    best[k][j], arg[k][j] = val, i
    sizes, j = [], L
    for k in range(n_stages, 0, -1):
        i = arg[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def cut_weight(b: int, end: int, placement: Placement, block_size: int, residual: str = "attnres",
               mode: str = "cached") -> int:
    """What boundary ``b`` placed after layer ``end`` adds to the number of tensors crossing ALL boundaries (one
    direction; gradients mirror it), so that a partitioner can minimise the traffic cut by cut.

    A boundary's own payload (the partial sum if ``end`` is inside a block, plus blocks ``known(b+1) ..
    blocks(end)-1``) depends on the cut ``pp`` stages earlier, but summed over all boundaries the cached
    ``known`` terms telescope: the total is ``sum_b partial(e_b) + sum_{b >= n - pp} blocks(e_b)`` (every
    block reaches every rank once), and ``full`` resends ``blocks(e_b)`` at every boundary. tests/parallel checks
    the sum against :meth:`AttnResCommPlan.payload`."""
    blocks, partial = canonical_layout(end, block_size, residual)
    counted = mode == "full" or b >= placement.num_stages - placement.pp
    return int(partial) + (blocks if counted else 0)


def build_partition(mcfg: Any, pcfg: Any, seq_len: int = 4096) -> PipelinePartition:
    """The partition for ``ModelConfig`` ``mcfg`` and ``ParallelConfig`` ``pcfg`` (explicit ``pp_layers`` if set,
    otherwise :func:`auto_layers_per_stage` under the cost model at ``seq_len`` tokens per sequence).

    Raises :class:`ConfigError` naming ``parallel.pp_layers`` / ``parallel.pp`` / ``parallel.vpp``.
    """
    pp, vpp, L = pcfg.pp, pcfg.vpp, mcfg.num_hidden_layers
    for key, val in (("parallel.pp", pp), ("parallel.vpp", vpp)):
        if not isinstance(val, int) or val < 1:
            raise ConfigError(f"{key}: must be a positive integer, got {val!r}")
    n = pp * vpp
    costs = [layer_cost(mcfg, i, seq_len) for i in range(L)]
    first, last = embed_cost(mcfg), head_cost(mcfg, seq_len)
    if pp == 1:
        # no pipeline: one chunk holds everything (vpp and pp_layers have no meaning without a pipeline)
        sizes, n, vpp, source = [L], 1, 1, "single"
    elif pcfg.pp_layers:
        sizes, source = list(pcfg.pp_layers), "explicit"
        if len(sizes) != n:
            raise ConfigError(f"parallel.pp_layers: has {len(sizes)} entries but pp*vpp = {pp}*{vpp} = {n} "
                              "virtual stages")
        if any((not isinstance(s, int)) or s < 1 for s in sizes):
            raise ConfigError(f"parallel.pp_layers: every virtual stage needs >= 1 layer, got {sizes}")
        if sum(sizes) != L:
            raise ConfigError(f"parallel.pp_layers: sums to {sum(sizes)} layers but model.num_hidden_layers = {L}")
    else:
        if L < n:
            raise ConfigError(f"parallel.vpp: {L} layers cannot fill pp*vpp = {pp}*{vpp} = {n} virtual stages "
                              "(every virtual stage needs at least one layer)")

        residual, mode = getattr(mcfg, "residual", "attnres"), getattr(pcfg, "attnres_comm", "cached")
        placement = Placement.of(pp, vpp)
        sizes = auto_layers_per_stage(costs, n, first, last, lambda b, end: cut_weight(
            b, end, placement, mcfg.attn_res_block_size, residual, mode), placement)
        source = "auto"
    bounds, s = [], 0
    for k in sizes:
        bounds.append((s, s + k))
        s += k
    stage_costs = [_stage_cost(costs, a, b, v, n, first, last) for v, (a, b) in enumerate(bounds)]
    kinds = [f"{mcfg.layer_kind(i)}-{'moe' if mcfg.is_moe_layer(i) else 'dense'}" for i in range(L)]
    return PipelinePartition(pp=pp, vpp=vpp, bounds=bounds,
                             block_size=mcfg.attn_res_block_size, stage_costs=stage_costs, kinds=kinds,
                             source=source, residual=mcfg.residual)


def describe_partition(part: PipelinePartition) -> str:
    """A table (one line per virtual stage): rank, chunk, layer range, layer kinds, extras, estimated cost."""
    total = sum(part.stage_costs) or 1.0
    n = part.num_stages
    lines = [f"pipeline partition ({part.source}): pp={part.pp} vpp={part.vpp} -> {n} virtual stages, "
             f"{part.num_layers} layers, " + (f"AttnRes blocks of {part.block_size}" if part.residual == "attnres"
                                               else "standard residual"),
             f"{'vstage':>6} {'rank':>4} {'chunk':>5} {'layers':>10} {'n':>3}  {'kinds':<28} {'extras':<14} "
             f"{'MFLOP/tok':>10} {'share':>6}"]
    for v, (s, e) in enumerate(part.bounds):
        ks = part.kinds[s:e]
        mix = {k: sum(1 for x in ks if x.startswith(k)) for k in ("kda", "mla")}
        ffn = {k: sum(1 for x in ks if x.endswith(k)) for k in ("dense", "moe")}
        kinds = " ".join(f"{c}{k}" for k, c in (*mix.items(), *ffn.items()) if c)
        extras = ",".join(x for x, on in (("embed", v == 0), ("head+mtp", v == n - 1)) if on) or "-"
        cut = "" if s % part.block_size == 0 or part.residual != "attnres" else "*"  # '*': starts inside a block
        lines.append(f"{v:>6} {part.rank_of(v):>4} {part.chunk_of(v):>5} {f'[{s},{e}){cut}':>10} {e - s:>3}  "
                     f"{kinds:<28} {extras:<14} {part.stage_costs[v] / 1e6:>10.2f} "
                     f"{100 * part.stage_costs[v] / total:>5.1f}%")
    imb = max(part.stage_costs) / (total / n)
    lines.append(f"max/mean stage cost = {imb:.3f}  ('*' = stage starts mid-block: a partial sum crosses the cut)")
    return "\n".join(lines)
