"""Shared test inputs for the KCP tests: document layouts and random KDA inputs (tiny, deterministic)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Document lengths per row; every case is used with T_full = 64 (cp=2 -> 32 per rank, cp=4 -> 16 per rank).
T_FULL = 64
LAYOUTS: dict[str, list[list[int]]] = {
    # one document spanning every rank
    "one_doc": [[64], [64]],
    # documents starting exactly at the cp=2 and cp=4 boundaries (16, 32, 48), and one crossing several ranks
    "boundaries": [[16, 16, 32], [32, 32]],
    # documents shorter than a segment, some crossing boundaries, one starting at the last token of a segment
    "short_docs": [[5, 7, 3, 20, 9, 4, 16], [15, 1, 1, 30, 2, 15]],
    # a row whose first segment has many documents and whose tail spans several ranks
    "mixed": [[3, 3, 3, 55], [40, 17, 7]],
}


# Layouts for cp = 3 and 4 built so that some CP segment neither receives state (it starts at a document start)
# nor passes it on (its last document ends at the segment end) while other rows/ranks do carry state: the case
# that hung KCP (issue 10). Segments of 16 tokens (cp=3: 48 per row, cp=4: 64 per row); "short_halo" has
# segments of 2 tokens, shorter than the ShortConv halo (kernel 4: 3 tokens) -- the halo spans several ranks.
HANG_LAYOUTS: dict[int, dict[str, list[list[int]]]] = {
    3: {
        "whole_and_half": [[16, 32], [32, 16]],        # rank 0 / rank 2 isolated, the others chained
        "isolated_rows": [[16, 16, 16], [8, 16, 24]],  # row 0 all whole documents, row 1 half documents
        "one_doc": [[48], [48]],                       # one document spanning every rank
        "mixed": [[5, 11, 16, 3, 13], [16, 20, 12]],
        "short_halo": [[6], [1, 2, 3]],                # 6 tokens, segments of 2
    },
    4: {
        "failing_16_32": [[16, 32, 16], [32, 16, 16]],  # the reproduced hang: cp=4, docs of 16 and 32, seq_len 64
        "isolated_rows": [[16, 16, 16, 16], [8, 16, 16, 24]],
        "one_doc": [[64], [64]],
        "mixed": [[5, 11, 16, 3, 29], [16, 40, 8]],
        "short_halo": [[8], [3, 2, 2, 1]],              # 8 tokens, segments of 2
    },
}


def doc_ids_from_lengths(rows: list[list[int]], total: int = T_FULL) -> torch.Tensor:
    """``[B, total]`` doc ids (unique per row, increasing) from per-row document lengths."""
    out = []
    for lengths in rows:
        if sum(lengths) != total:
            raise ValueError(f"row lengths {lengths} do not sum to {total}")
        out.append(torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)]))
    return torch.stack(out)


def kda_inputs(B: int, T: int, H: int = 2, K: int = 8, V: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random KDA inputs with the model's ranges: L2-normalised q, k; g in (-5, 0); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype) - 2.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    return dict(q=q, k=k, v=v, g=g, beta=beta)
