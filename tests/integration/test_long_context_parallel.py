"""Long context through the trainer's real path (``parallelize`` -> ``ParallelModel.forward_backward``): the tiny
config at ``seq_len`` 8192 on ONE document that spans every CP rank equals the single-process model -- the step's
loss sums, EVERY parameter gradient and the routers' Quantile-Balancing step (the checks of
``test_composed_parallel._check_layout``, in its ``_body``).

The parallel side runs every long-context path at once: MLA under CP with the causal balance (half-segment query
swaps, kcp/mla_cp.py), ``recompute_granularity: sublayer`` (each sublayer, head chunk and MoE token chunk recomputed
on its own), head chunks of the KDA and MLA mixers, MoE token chunks through MoonEP's dispatcher; the reference is
the plain model (no chunks, no recomputation) on the whole row. Both layouts run in one spawn of 4 gloo ranks.
"""
from __future__ import annotations

from composed_cases import Layout, kjv_single_document, make_cfg, reference
from dist_helpers import run_distributed
from test_composed_parallel import _body

SEQ = 8192
# 4 layers (KDA x3, MLA; a dense first layer, 3 LatentMoE; the MTP layer): every kind of layer, half the time
DEPTH = ("--model.num_hidden_layers=4",)
LONG = (*DEPTH, "--parallel.recompute=true", "--parallel.recompute_granularity=sublayer")
LAYOUTS = [
    # 2048 tokens per rank: MLA keys of segments 0..max(r, 3-r); 4 MoE token chunks per rank, 2 head chunks
    Layout("cp4_ep4_moonep_long", cp=4, ep=4, seq_len=SEQ, gbs=1,
           extra=(*LONG, "--model.mixer_head_chunk=2", "--model.moe_token_chunk=512")),
    # 4096 tokens per rank on both pipeline stages (2 + 2 layers); head chunks of 3 + 1; the MTP layer's chunks on
    # stage 1
    Layout("pp2_cp2_ep2_moonep_long", pp=2, cp=2, ep=2, seq_len=SEQ, gbs=1,
           extra=(*LONG, "--model.mixer_head_chunk=3", "--model.moe_token_chunk=1024")),
]


def test_long_document_layouts_match_single_process() -> None:
    full = kjv_single_document(SEQ)
    assert int(full.doc_ids.max()) == 0  # one document over the whole row: every CP rank's MLA keys reach back
    ref = reference(make_cfg(seq_len=SEQ, gbs=1, extra=DEPTH), full)
    run_distributed(_body, 4, LAYOUTS, full, {"k3": ref}, timeout=600)
