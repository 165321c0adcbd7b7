"""Shared pieces of the Hugging Face import/export tests: a tiny random Kimi Linear built and saved with transformers
(the test-only dependency; never imported by k3train), reading a checkpoint directory back, and the run config
that trains on the shipped corpus from an imported checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from shipped_data import shipped_view

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 4096  # the shipped tokenizer's ids (bos 0, eos 1, pad 2), so an imported model trains on the shipped corpus


def save_tiny_kimi_linear(out: Path, seed: int = 0) -> tuple[object, object]:
    """A tiny random ``KimiLinearForCausalLM`` (fp32; 3 KDA + 1 MLA layer, a dense first layer, MoE layers with
    2 shared experts and grouped routing over 2 groups, a routed scaling factor, random correction biases) saved
    with ``save_pretrained`` in small shards. Returns ``(model, config)``.

    ``rms_norm_eps=1e-6``: transformers' Kimi Linear MLA builds its q_a / kv_a RMSNorms with their default eps
    (1e-6) whatever the config says, while SGLang and k3train use ``rms_norm_eps`` everywhere; with 1e-6 both
    readings are the same model."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
        topk_group=1, num_experts_per_tok=2, num_local_experts=8, first_k_dense_replace=1, rms_norm_eps=1e-6,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                            "full_attn_layers": [4]},
        pad_token_id=2, bos_token_id=0, eos_token_id=1)
    model = KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)  # a trained checkpoint's balancing bias is not zero
    model.save_pretrained(str(out), max_shard_size="200KB")
    return model, cfg


def read_checkpoint(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(index, {tensor: value})`` of a safetensors checkpoint directory, every tensor read from the file the
    index names (so the index is checked too)."""
    from safetensors import safe_open  # noqa: PLC0415

    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for key, fname in index["weight_map"].items():
        with safe_open(str(d / fname), framework="pt") as f:
            out[key] = f.get_tensor(key)
    return index, out


def assert_same_checkpoint(a: Path, b: Path) -> int:
    """Same key set, same ``metadata.total_size``, every tensor bit for bit (dtype, shape, bytes). Returns the
    tensor count."""
    ia, ta = read_checkpoint(a)
    ib, tb = read_checkpoint(b)
    assert set(ta) == set(tb), f"key sets differ: {sorted(set(ta) ^ set(tb))[:5]}"
    assert ia["metadata"]["total_size"] == ib["metadata"]["total_size"]
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), f"{k} differs"
    return len(ta)


def run_overrides(out_dir: Path, steps: int, layout: list[str] | None = None) -> list[str]:
    """A short run on the shipped corpus (seq 32, 4 sequences per step, fp32 on the CPU)."""
    return [f"--data.path={shipped_view('corpus_text_document')}", "--data.split=100,0,0", "--train.seq_len=32",
            "--train.global_batch_size=4", "--train.micro_batch_size=1", f"--train.steps={steps}",
            "--train.device=cpu", "--train.dtype=float32", f"--train.out_dir={out_dir}", "--optim.warmup_steps=1",
            "--logging.wandb=false", "--logging.peak_flops=1e9", "--logging.level=WARNING",
            "--checkpoint.resume=none", "--checkpoint.interval=0", *(layout or [])]
