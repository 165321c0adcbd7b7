"""Kimi K3 model: plain ``nn.Module``s (no torch.distributed); parallelism is applied from outside.

Public API:
    K3Model            the backbone + MTP with the stage seams (embed / forward_layers / final_hidden / loss_sums)
    SeqInfo            per-micro-batch sequence layout (doc ids, positions, cu_seqlens, CP context)
    AttnResState       the depth state passed between layers / pipeline stages
    K3Layer, KDALayer, MLA, MTPLayer, AttnRes, ShortConv   building blocks
    attention_core, MaskInfo, attn_res_aggregate, causal_depthwise_conv   the functional cores
    model_flops_per_token, param_breakdown   FLOPs (for MFU) and parameter bookkeeping
"""
from k3train.model.attnres import AttnRes, AttnResState, attn_res_aggregate
from k3train.model.block import K3Layer
from k3train.model.conv import ShortConv, causal_depthwise_conv
from k3train.model.flops import model_flops_per_token, param_breakdown
from k3train.model.kda import KDALayer
from k3train.model.mla import MLA
from k3train.ops.mla_dense import MaskInfo, attention_core
from k3train.model.model import K3Model
from k3train.model.mtp import MTPLayer
from k3train.model.seq import SeqInfo

__all__ = [
    "AttnRes", "AttnResState", "K3Layer", "K3Model", "KDALayer", "MLA", "MTPLayer", "MaskInfo", "SeqInfo",
    "ShortConv", "attention_core", "attn_res_aggregate", "causal_depthwise_conv", "model_flops_per_token",
    "param_breakdown",
]
