"""Pipeline parallelism for k3train: partition (layers per virtual stage), schedules (AFAB / 1F1B / interleaved
1F1B as pure action lists), p2p programs, cache-based AttnRes communication, stage building and step runners.

Public API:
    build_step_runner(model, cfg, dims, ...) -> StepRunner     (LocalRunner for pp=1, PipelineRunner for pp>1)
    LossNorm(lm_tokens, mtp_tokens, mtp_weight)                 per-micro-batch loss scaling (global counts)
    build_partition(model_cfg, parallel_cfg, seq_len) -> PipelinePartition;  describe_partition(part)
    build_schedule(schedule, pp, vpp, M), simulate(...), theoretical_bubble(pp, vpp, M)
    place_encoder(schedule, pp, vpp, ..., mode)                 vision encoder actions (parallel.encoder_schedule)
    AttnResCommPlan(partition, mode)                            what each stage boundary sends
"""
from parallel.pipeline.attnres_comm import AttnResCommPlan
from parallel.pipeline.loss_norm import LossNorm
from parallel.pipeline.partition import PipelinePartition, build_partition, describe_partition, layer_cost
from parallel.pipeline.runner import LocalRunner, PipelineRunner, StepRunner, build_step_runner
from parallel.pipeline.schedules import (Action, build_schedule, resolve_schedule, simulate,
                                         theoretical_bubble)

__all__ = [
    "Action", "AttnResCommPlan", "LocalRunner", "LossNorm", "PipelinePartition", "PipelineRunner", "StepRunner",
    "build_partition", "build_schedule", "build_step_runner", "describe_partition", "layer_cost",
    "resolve_schedule", "simulate", "theoretical_bubble",
]
