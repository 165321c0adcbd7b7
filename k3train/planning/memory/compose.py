"""Whole-chunk traces or pieces composed in order: which one a micro-batch takes, and the composition."""
from __future__ import annotations

from k3train.config import Config

# Above this many (tokens per micro-batch and rank) x (model layers) chunks are not traced whole: the cost of a
# fake trace grows with both (chunked KDA's recurrence is one Python step per 64 tokens: a 64K-token K3 segment
# would take hours of fake ops; 93 K3 layers at 4K tokens ~10 minutes on 2 cores). Instead each distinct piece --
# the embedding, each layer signature (or, under parallel.recompute_granularity = sublayer, each of its token mixer
# and FFN sublayers: the units recomputed on their own), the head + MTP -- is traced alone at a few token counts,
# every byte count is fitted EXACTLY by a + b T + c T^2 (memory is at most quadratic in T), evaluated at the real T,
# and the pieces of a chunk are composed in order (forward peak: earlier pieces' saved bytes + this piece's
# transient; backward in reverse). The three token counts are COMPOSE_TOKENS = 1K, 2K, 4K (a KDA layer's or
# mixer's: 256 and 512, a line -- its bytes are a constant plus a term per 64-token chunk, and its fake trace is the
# slowest, one Python step per chunk and head chunk; an MLA's: 1, 2, 4 attention blocks, so that a trace holds the
# real per-block transients), except for a piece holding a module that computes in token chunks (a LatentMoE:
# model.moe_token_chunk; the LM head + MTP cross-entropy: CE_CHUNK_TOKENS) when the real micro-batch has more
# tokens than the chunk: then 2 and 3 times the chunk (the least common multiple of the chunks in play), the line
# fitted where the real run is -- a fixed per-chunk transient plus bytes linear in the tokens (:func:`piece_tokens`).
# An MLA's pieces are also traced at CP rank 1 (at their first token count: what a key segment more holds is
# proportional to the tokens) and extended to every rank in its key segments (:func:`mla_key_segments`).
TRACE_BUDGET = 8192 * 16  # tokens x layers traced whole (tiny and small: whole chunks)


def whole_traces(cfg: Config, B: int, T: int) -> bool:
    """Trace whole chunks (every CP rank's) rather than compose per-layer fits: while the CP group's tokens of a
    micro-batch (``B x T x cp``) times the depth stay within ``TRACE_BUDGET`` -- a whole trace is taken once per
    CP rank, so at K3 width a large cp with short rows per rank would cost minutes per layout."""
    return B * T * cfg.parallel.cp * cfg.model.num_hidden_layers <= TRACE_BUDGET


def compose(pieces: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    saved, f_peak, b_peak, prefix = 0, 0, 0, 0
    for sv, f, b in pieces:
        f_peak, b_peak = max(f_peak, prefix + f), max(b_peak, prefix + b)
        prefix += sv
        saved += sv
    return saved, f_peak, b_peak
