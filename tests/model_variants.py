"""The model variants every parallel layout is tested with (``--model.*`` overrides of configs/tiny.yaml), shared by
the composed-parallel test (tests/integration) and the Hugging Face tests (tests/hf)."""
from __future__ import annotations

# model variants (configs/tiny.yaml + these overrides); every one runs through the composed layouts
VARIANTS: dict[str, tuple[str, ...]] = {
    "k3": (),
    # the standard PreNorm residual (the model.residual ablation)
    "standard": ("--model.residual=standard",),
    # what the published Kimi Linear checkpoints need (k3train/hf): standard residual, KDA with the softplus decay
    # and the low-rank output gate, MLA without query compression and without the output gate, SwiGLU FFNs, a MoE
    # without the latent projection, grouped top-k routing, no renormalisation, a routed scaling factor
    "kimi_linear": ("--model.residual=standard", "--model.kda_decay_form=softplus", "--model.use_full_rank_gate=false",
                    "--model.q_lora_rank=null", "--model.mla_use_output_gate=false", "--model.hidden_act=silu",
                    "--model.routed_expert_hidden_size=null", "--model.latent_moe_use_norm=false",
                    "--model.num_expert_group=2", "--model.topk_group=1", "--model.moe_renormalize=false",
                    "--model.routed_scaling_factor=2.5"),
}
