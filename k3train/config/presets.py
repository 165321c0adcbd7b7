"""Small configs for the tests and benchmarks, each built in one place: configs/tiny.yaml with overrides, its
model section, a still smaller pipeline config, and one LatentMoE layer's ModelConfig.

``TINY_CONFIG`` is the checkout's configs/tiny.yaml (the configs are not installed with the package: these helpers
serve a checkout's tests and benchmarks)."""
from __future__ import annotations

from pathlib import Path

from k3train.config import Config, ModelConfig, load_config

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def tiny_config(*overrides: str, world_size: int | None = None) -> Config:
    """configs/tiny.yaml with ``--section.key=value`` overrides, validated (for ``world_size`` ranks if given)."""
    return load_config(TINY_CONFIG, list(overrides), world_size=world_size)


def tiny_model_config(*overrides: str) -> ModelConfig:
    """The validated model section of configs/tiny.yaml with ``key=value`` model overrides
    (``tiny_model_config("num_hidden_layers=4")``)."""
    return tiny_config(*(f"--model.{o}" for o in overrides)).model


def tiny_pipeline_config(pp: int = 2, vpp: int = 1, dp: int = 1, *, layers: int = 8,
                         pp_layers: list[int] | None = None, comm: str = "cached", schedule: str = "auto",
                         recompute: bool = False, micro_batches: int = 4, mtp: int = 1,
                         extra: list[str] | None = None) -> Config:
    """configs/tiny.yaml shrunk further (hidden 32, vocab 256, 4 experts, seq 12), blocks of 3 layers, for
    ``pp * dp`` ranks: ``micro_batches`` micro-batches of one sequence per pipeline; ``extra``: more overrides."""
    ov = ["--model.hidden_size=32", "--model.vocab_size=256", "--model.num_experts=4",
          "--model.intermediate_size=64", "--model.shared_expert_intermediate_size=32",
          "--model.routed_expert_hidden_size=16", "--model.moe_intermediate_size=16", "--model.kda_chunk_size=16",
          f"--model.num_hidden_layers={layers}", "--model.attn_res_block_size=3",
          f"--model.num_nextn_predict_layers={mtp}",
          f"--parallel.pp={pp}", f"--parallel.vpp={vpp}", f"--parallel.dp={dp}", f"--parallel.attnres_comm={comm}",
          f"--parallel.schedule={schedule}", f"--parallel.recompute={str(recompute).lower()}",
          "--train.seq_len=12", "--train.micro_batch_size=1", f"--train.global_batch_size={micro_batches * dp}",
          "--train.device=cpu"]
    if pp_layers:
        ov.append(f"--parallel.pp_layers=[{','.join(map(str, pp_layers))}]")
    return tiny_config(*ov, *(extra or []), world_size=pp * dp)


# one LatentMoE layer at test size: hidden 32, 8 routed experts top-2 on a 16-wide latent, expert FFN 16, one shared
# expert 16 wide, 64 Quantile-Balancing bins
TINY_MOE = dict(hidden_size=32, routed_expert_hidden_size=16, moe_intermediate_size=16, num_experts=8,
                num_experts_per_token=2, num_shared_experts=1, shared_expert_intermediate_size=16, qb_bins=64)


def tiny_moe_config(**fields: object) -> ModelConfig:
    """A ModelConfig for one LatentMoE layer (:data:`TINY_MOE`), ``fields`` replacing or adding any field."""
    return ModelConfig(**{**TINY_MOE, **fields})
