"""A Kimi Linear checkpoint directory as a user has it: a tiny random ``KimiLinearForCausalLM`` saved by transformers
with its config built the way transformers 5.24 documents it (``layer_types``, ``mlp_layer_types``), beside a
tiktoken tokenizer (``tiktoken.model`` + ``tokenizer_config.json`` with a chat template); chat JSONL from real text;
and the run overrides of the SFT tests."""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch

from chat_helpers import N_MERGES, reverse_words_conversations, write_jsonl, write_kimi_tokenizer
from k3train.data.corpus import DEFAULT_CORPUS, read_documents

BASE = 256 + N_MERGES  # the tokenizer's first special id: [BOS]
BOS, EOS, PAD = BASE, BASE + 1, BASE + 255
VOCAB = BASE + 256


def save_native_kimi_linear(out: Path, seed: int = 0, template: str | None = None):
    """``out``: config.json in transformers' own form + safetensors + the tiktoken tokenizer. Returns the model."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
        topk_group=1, num_experts_per_tok=2, num_local_experts=8, rms_norm_eps=1e-6,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    model = KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    model.save_pretrained(str(out), max_shard_size="300KB")
    cj = json.loads((out / "config.json").read_text())
    assert "layer_types" in cj and "mlp_layer_types" in cj and "linear_attn_config" not in cj
    write_kimi_tokenizer(out, **({} if template is None else {"template": template}))
    return model


def chat_records(n: int, long_prompts: int = 0, words: int = 24, skip: int = 0) -> list[dict]:
    """``n`` reverse-the-words conversations from KJV verses; the first ``long_prompts`` of them with a user turn
    far longer than a test row (truncated, their rows hold no assistant token)."""
    verses = [ln for d in itertools.islice(read_documents(DEFAULT_CORPUS), 30) for ln in d.text.splitlines() if ln]
    texts = [" ".join(v.split()[1:words + 1]) for v in verses[skip:skip + n]]
    recs = reverse_words_conversations(texts)
    for r, v in zip(recs[:long_prompts], verses[skip + n:]):
        r["messages"][0]["content"] = " ".join([v] * 6)
    return recs


def sft_overrides(out_dir: Path, data_prefix: Path, steps: int, layout: list[str] | None = None,
                  seq_len: int = 64, gbs: int = 4) -> list[str]:
    return [f"--data.path={data_prefix}", "--data.format=chat", "--data.split=100,0,0",
            "--data.chat_overlong=truncate", f"--train.seq_len={seq_len}", f"--train.global_batch_size={gbs}",
            "--train.micro_batch_size=1", f"--train.steps={steps}", "--train.device=cpu", "--train.dtype=float32",
            f"--train.out_dir={out_dir}", "--optim.warmup_steps=1", "--logging.wandb=false",
            "--logging.peak_flops=1e9", "--logging.level=WARNING", "--checkpoint.resume=none",
            "--checkpoint.interval=0", "--train.eval_interval=0", *(layout or [])]


def write_chat(path: Path, records: list[dict]) -> Path:
    return write_jsonl(path, records)


def rule_records(n: int, shuffled: bool, seed: int = 0, vocab_size: int = 16) -> list[dict]:
    """``n`` conversations whose answer follows from the user's word by a rule (a fixed random permutation of
    ``vocab_size`` KJV words), or -- ``shuffled`` -- the same answers shuffled across conversations (nothing in the
    prompt predicts them). A short system turn keeps the template's default system prompt out."""
    words = sorted({w.strip(",.;:") for d in itertools.islice(read_documents(DEFAULT_CORPUS), 5)
                    for w in d.text.split() if w.strip(",.;:").isalpha()})[:vocab_size]
    rng = random.Random(seed)
    perm = words[:]
    rng.shuffle(perm)
    rule = dict(zip(words, perm))
    asks = [rng.choice(words) for _ in range(n)]
    answers = [rule[w] for w in asks]
    if shuffled:
        random.Random(seed + 1).shuffle(answers)
    return [{"messages": [{"role": "system", "content": "R"}, {"role": "user", "content": q},
                          {"role": "assistant", "content": a}]} for q, a in zip(asks, answers)]
