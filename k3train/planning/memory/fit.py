"""Exact fits of a piece's bytes in its token count: the token counts it is traced at, and the fit through them."""
from __future__ import annotations

import math

COMPOSE_TOKENS = (1024, 2048, 4096)


KDA_COMPOSE_TOKENS = (256, 512)  # linear: a constant plus a term per 64-token chunk (the fits' c was 0 at 3)


def piece_tokens(n_real: int, chunks: list[int], base: tuple[int, ...] = COMPOSE_TOKENS) -> tuple[int, ...]:
    """Token counts a composed piece is traced at for a micro-batch of ``n_real`` tokens, given the token chunks
    of the modules it holds: ``base`` when ``n_real`` exceeds none of them (one chunk: the module runs whole, as
    at the trace's sizes); else ``2m, 3m`` with ``m`` the least common multiple of the chunks ``n_real`` exceeds
    (the chunked regime, every chunk full: a fixed per-chunk transient plus bytes linear in the tokens, so two
    points fit it), provided no other chunk is then exceeded; a micro-batch between two chunk sizes with no such
    ``m`` is traced at ``n_real`` itself."""
    over = sorted({c for c in chunks if 0 < c < n_real})
    if not over:
        return base
    m = math.lcm(*over)
    pts = (2 * m, 3 * m)
    if any(c > 0 and c not in over and c < pts[-1] for c in chunks):
        return (n_real,)
    return pts


def quadratic_fit(ts: tuple[int, ...], ys: list[int]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the quadratic through three points (exact: memory is at most quadratic in T); of the line
    through two; one point: the constant."""
    if len(ts) == 1:
        return float(ys[0]), 0.0, 0.0
    if len(ts) == 2:
        b = (ys[1] - ys[0]) / (ts[1] - ts[0])
        return ys[0] - b * ts[0], b, 0.0
    (t1, t2, t3), (y1, y2, y3) = ts, ys
    c = ((y3 - y2) / (t3 - t2) - (y2 - y1) / (t2 - t1)) / (t3 - t1)
    b = (y2 - y1) / (t2 - t1) - c * (t1 + t2)
    return y1 - b * t1 - c * t1 * t1, b, c


def poly(abc: tuple[float, float, float], t: int) -> float:
    return abc[0] + abc[1] * t + abc[2] * t * t
