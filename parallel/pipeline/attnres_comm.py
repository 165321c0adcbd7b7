"""Cache-based AttnRes communication between virtual pipeline stages.

Under Block AttnRes the state between layers is not one hidden tensor but the completed block sums
``b_0..b_{n-1}`` (``b_0`` = embedding) plus the current block's partial sum. Every later layer attends over all
blocks, so every stage needs every block produced before it. With interleaving (vpp > 1) a rank hosts virtual
stages ``r, r + pp, ...`` and sees each micro-batch ``vpp`` times; when stage ``v`` arrives, the rank still holds
every block that was in the output of its previous chunk ``v - pp`` for that micro-batch. So the sender of
boundary ``v-1 -> v`` transmits (``mode='cached'``):

* the partial sum, when the cut is inside a block (``start_v % block_size != 0``), and
* only the blocks with index ``>= known(v)``, ``known(v) = #blocks after stage v - pp`` (0 for ``v < pp``).

``mode='full'`` (the reference) resends every block at every boundary.

Under ``model.residual: standard`` the state is one running tensor carried as the "partial sum" with no blocks
(:func:`k3train.model.attnres.canonical_layout`), so every boundary sends exactly that hidden state (and its
gradient back) and the cache stays empty: both modes are the plain pipeline.

Gradient path (exact; both modes give identical gradients):

* Forward of stage ``v`` builds its input from *leaves*: received tensors (``requires_grad``) and detached
  copies of the cached blocks (``cache.detach().requires_grad_()``, sharing storage). Its output blocks
  ``0..known(v)-1`` are those leaves passed through unchanged, so autograd routes their downstream gradients
  into the same leaves.
* Backward of stage ``v``: the gradient of each output tensor is the p2p gradient from stage ``v+1`` (for the
  tensors that went over the wire) PLUS, for output block ``j``, the gradient that the rank's next chunk
  (stage ``v + pp``) accumulated into its cached copy of block ``j`` (every output block of ``v`` is reused from
  the cache by ``v + pp``). The backward of ``v + pp`` always precedes that of ``v`` for the same micro-batch
  (backward runs in reverse virtual-stage order), so the accumulator is complete when ``v`` reads it.
* After the backward of ``v``: received leaves' ``.grad`` go back over p2p to ``v-1``; cached leaves' ``.grad``
  become the accumulator of this rank's previous chunk (stage ``v - pp``) for that micro-batch.

Each block value is thus consumed along a tree (producer -> pass-through by later stages, each stage getting it
from exactly one place: the wire or the cache), and every edge carries the gradient of its subtree exactly once.
Cache entries are freed as soon as they can no longer be read (after the rank's last forward chunk of a
micro-batch, resp. after the backward that consumes an accumulator).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3train.model.attnres import canonical_layout
from parallel.pipeline.partition import PipelinePartition

MODES = ("cached", "full")


@dataclass(frozen=True)
class Payload:
    """What crosses one boundary: the partial sum (if any) then block indices, in this order on the wire."""

    partial: bool
    blocks: tuple[int, ...]

    def items(self) -> list[str | int]:
        return (["partial"] if self.partial else []) + list(self.blocks)

    def __len__(self) -> int:
        return int(self.partial) + len(self.blocks)


class AttnResCommPlan:
    """Static (config-only) plan of what each boundary sends. Boundary ``b`` joins virtual stages ``b, b+1``."""

    def __init__(self, partition: PipelinePartition, mode: str = "cached") -> None:
        if mode not in MODES:
            raise ValueError(f"parallel.attnres_comm: must be 'cached' or 'full', got {mode!r}")
        self.part, self.mode, self.bs = partition, mode, partition.block_size

    def blocks_at(self, layer: int) -> int:
        """Number of completed blocks (incl. the embedding) in the canonical state before ``layer`` (0 under the
        standard residual, whose one running tensor travels as the partial sum)."""
        return canonical_layout(layer, self.bs, self.part.residual)[0]

    def partial_at(self, layer: int) -> bool:
        return canonical_layout(layer, self.bs, self.part.residual)[1]

    def known_blocks(self, v: int) -> int:
        """Blocks the rank of stage ``v`` already holds for the micro-batch when ``v`` starts."""
        prev = self.part.placement.prev_local(v)  # the same rank's previous chunk for this micro-batch
        if self.mode == "full" or prev is None:
            return 0
        return self.blocks_at(self.part.bounds[prev][1])

    def payload(self, b: int) -> Payload:
        """Tensors sent from stage ``b`` to ``b + 1`` (activations) and their gradients back."""
        end = self.part.bounds[b][1]
        return Payload(self.partial_at(end), tuple(range(self.known_blocks(b + 1), self.blocks_at(end))))

    def boundary_numbers(self, b: int) -> dict[str, int]:
        """``{'hidden': #partial tensors, 'block_cache': #block tensors}`` sent forward across boundary ``b``."""
        p = self.payload(b)
        return {"hidden": int(p.partial), "block_cache": len(p.blocks)}

    def step_bytes(self, num_microbatches: int, tokens: int, hidden: int, elem_bytes: int) -> dict[str, int]:
        """Analytic bytes sent in one step over all ranks of ONE pipeline (forward payload + equal-sized gradients):
        ``{'hidden', 'block_cache', 'grad', 'total'}``. ``tokens`` = tokens per micro-batch (B*T)."""
        per = tokens * hidden * elem_bytes
        h = sum(self.boundary_numbers(b)["hidden"] for b in range(self.part.num_stages - 1))
        k = sum(self.boundary_numbers(b)["block_cache"] for b in range(self.part.num_stages - 1))
        out = {"hidden": h * per * num_microbatches, "block_cache": k * per * num_microbatches}
        out["grad"] = out["hidden"] + out["block_cache"]
        out["total"] = 2 * out["grad"]
        return out


@dataclass
class StageInput:
    """The leaves a stage's forward started from (kept until its backward)."""

    cached: list[torch.Tensor]  # blocks 0..known-1, detached copies of this rank's earlier chunk's outputs
    received: list[torch.Tensor]  # in wire order (Payload.items()); all require grad
    blocks: list[torch.Tensor]  # cached + received blocks, in block order
    partial: torch.Tensor | None


@dataclass
class BlockCache:
    """Per-rank runtime state of the cached communication for one training step.

    ``fwd[mb]``: the blocks this rank holds for micro-batch ``mb`` (the output blocks of its latest forward chunk).
    ``grads[(chunk, mb)]``: gradient contributions to the output blocks of local chunk ``chunk`` from the next
    local chunk's use of the cache.
    """

    plan: AttnResCommPlan
    pp_rank: int
    fwd: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor | None]] = field(default_factory=dict)

    def _stage(self, chunk: int) -> int:
        return self.plan.part.stage(self.pp_rank, chunk)

    # ---------------------------------------------------------------------------------------------------------
    # forward
    def build_input(self, chunk: int, mb: int, received: list[torch.Tensor]) -> StageInput:
        """Input leaves of local chunk ``chunk`` (stage v > 0) from the received payload and the cache."""
        v = self._stage(chunk)
        known = self.plan.known_blocks(v)
        payload = self.plan.payload(v - 1)
        if len(received) != len(payload):
            raise RuntimeError(f"stage {v} mb {mb}: received {len(received)} tensors, expected {len(payload)}")
        cached: list[torch.Tensor] = []
        if known:
            held = self.fwd.get(mb)
            if held is None or len(held) != known:
                raise RuntimeError(f"stage {v} mb {mb}: block cache holds {None if held is None else len(held)} "
                                   f"blocks, expected {known} (did the earlier chunk's forward run?)")
            cached = [t.detach().requires_grad_() for t in held]
        for t in received:
            t.requires_grad_()
        partial = received[0] if payload.partial else None
        recv_blocks = received[1:] if payload.partial else received
        return StageInput(cached=cached, received=list(received), blocks=cached + list(recv_blocks),
                          partial=partial)

    def after_forward(self, chunk: int, mb: int, out_blocks: list[torch.Tensor]) -> None:
        """Remember the output blocks for this rank's next chunk of ``mb``; free them after the last chunk."""
        if self.plan.mode == "full" or self.plan.part.placement.next_local(self._stage(chunk)) is None:
            self.fwd.pop(mb, None)
        else:
            self.fwd[mb] = list(out_blocks)

    def outgoing(self, v: int, out_blocks: list[torch.Tensor], out_partial: torch.Tensor | None) -> list[torch.Tensor]:
        """The tensors stage ``v`` sends to ``v + 1``, in wire order (graph-connected; the caller detaches)."""
        p = self.plan.payload(v)
        if p.partial and out_partial is None:
            raise RuntimeError(f"stage {v}: payload needs a partial sum but the stage produced none")
        return ([out_partial] if p.partial else []) + [out_blocks[j] for j in p.blocks]

    # ---------------------------------------------------------------------------------------------------------
    # backward
    def output_grads(self, chunk: int, mb: int, out_blocks: list[torch.Tensor], out_partial: torch.Tensor | None,
                     received_grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(roots, grads)`` for ``torch.autograd.backward`` of a non-last stage: p2p gradients of the sent
        tensors plus the cache accumulator of this chunk's output blocks (consumed here)."""
        v = self._stage(chunk)
        p = self.plan.payload(v)
        grads: dict[str | int, torch.Tensor] = {}
        for item, g in zip(p.items(), received_grads):
            grads[item] = g
        for j, g in enumerate(self.grads.pop((chunk, mb), [])):
            if g is not None:
                grads[j] = grads[j] + g if j in grads else g
        roots, gs = [], []
        for item, g in grads.items():
            t = out_partial if item == "partial" else out_blocks[item]
            if t is not None and t.requires_grad:
                roots.append(t)
                gs.append(g.to(t.dtype))
        return roots, gs

    def input_grads(self, chunk: int, mb: int, inp: StageInput) -> list[torch.Tensor]:
        """After the backward of local chunk ``chunk``: store the cached leaves' gradients for the previous local
        chunk and return the received leaves' gradients (wire order) to send back."""
        if inp.cached:
            pl = self.plan.part.placement
            prev_chunk = pl.chunk_of(pl.prev_local(self._stage(chunk)))
            self.grads[(prev_chunk, mb)] = [t.grad for t in inp.cached]
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inp.received]

    def check_empty(self) -> None:
        """End of step: nothing may be left (a leak means a schedule/cache bug)."""
        if self.fwd or self.grads:
            raise RuntimeError(f"block cache not empty after the step: fwd {sorted(self.fwd)}, "
                               f"grads {sorted(self.grads)}")
