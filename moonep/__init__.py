"""MoonEP: expert parallelism with perfectly balanced per-rank load via online redundant experts.

Public API:
    apply_expert_parallel(model, dims, moonep=True) -> ExpertParallelState   shard experts, install dispatchers
    param_reduce_group(name, param, dims), is_expert_param(param)             gradient reduction group
    mark_expert_params(modules)                                               re-mark after to_empty()
    dcp_state_dict(model, dims), as_expert_dtensor(tensor, param, mesh)       checkpoints (DTensor Shard(0) over ep)
    sync_router_balance(model, dims) -> metrics                               QB statistics all-reduce + bias step
    collect_moonep_metrics(modules) -> metrics                                per-layer load / replicas / bytes
    EPDispatcher                                                              the dispatcher (LocalDispatcher API)
    EPSide                                                                    one F/B-pairing side's groups/buffers
    ReplicaPool                                                               replica banks shared by all MoE layers
    plan_redundant_experts, plan_static, split_tokens, bounds                 the pure planner
"""
from moonep.comm import CommBuffers, all_to_all_autograd, token_buffer_rows
from moonep.dispatcher import EPDispatcher, EPSide
from moonep.metrics import collect_moonep_metrics
from moonep.planner import (
    Plan,
    plan_redundant_experts,
    plan_static,
    redundancy_lower_bound,
    redundancy_upper_bound,
    replica_lower_bound,
    split_tokens,
)
from moonep.qb_sync import all_reduce_router_stats, sync_router_balance
from moonep.replica_pool import ReplicaPool
from moonep.shard import (
    ExpertParallelState,
    apply_expert_parallel,
    as_expert_dtensor,
    dcp_state_dict,
    gather_full_experts,
    is_expert_param,
    mark_expert_params,
    param_reduce_group,
)

__all__ = [
    "CommBuffers", "EPDispatcher", "EPSide", "ExpertParallelState", "Plan", "ReplicaPool", "all_reduce_router_stats",
    "all_to_all_autograd",
    "apply_expert_parallel", "as_expert_dtensor", "collect_moonep_metrics", "dcp_state_dict", "gather_full_experts",
    "is_expert_param", "mark_expert_params", "param_reduce_group", "plan_redundant_experts", "plan_static",
    "redundancy_lower_bound", "redundancy_upper_bound", "replica_lower_bound", "split_tokens",
    "sync_router_balance", "token_buffer_rows",
]
