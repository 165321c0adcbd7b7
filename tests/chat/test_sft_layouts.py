"""Supervised fine-tuning of an imported Kimi Linear (transformers-native ``config.json``, tiktoken tokenizer, chat
template) on chat data, through the real Trainer, equals one process in every layout:

* the ``layer_types`` form of ``config.json`` imports and gives transformers' logits;
* ``k3train import-hf`` points ``data.tokenizer`` at the checkpoint's ``tiktoken.model`` with its token names;
* pp2 vpp2, dp2 ep2 (MoonEP, ZeRO-2) and cp2: the losses, the optimizer's gradients and the parameters after each of
  3 steps equal the single-process run's (fp32). The data is made so that micro-batches, and a data-parallel rank's
  whole share of a step, hold no assistant token (truncated conversations of prompt only): such ranks join every
  collective and add nothing to the mean over the global batch's assistant tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import k3train.hf as hf
from chat_helpers import KIMI_NAMES
from dist_helpers import run_distributed
from sft_cases import BASE, chat_records, rule_records, save_native_kimi_linear, sft_overrides, write_chat
from integration.trainer_parity import assert_close_all, max_diffs, owned_grads

STEPS = 3
LAYOUTS = {"pp2_vpp2": ["--parallel.pp=2", "--parallel.vpp=2"],
           "dp2_ep2_moonep_zero2": ["--parallel.dp=2", "--parallel.ep=2", "--parallel.moonep=true",
                                    "--parallel.zero=2"],
           "cp2": ["--parallel.cp=2"]}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    from k3train.data.chat.prepare import prepare_chat
    from k3train.data.special_tokens import SpecialTokens
    from k3train.data.tokenizer import load_tokenizer
    from k3train.hf_commands import import_hf_main

    d = tmp_path_factory.mktemp("sft")
    ckpt = d / "Kimi-Linear-tiny"
    ckpt.mkdir()
    ref = save_native_kimi_linear(ckpt)
    assert import_hf_main([str(ckpt), "-o", str(d / "run.yaml")]) == 0
    tok = load_tokenizer(ckpt / "tiktoken.model", SpecialTokens(*KIMI_NAMES))
    src = write_chat(d / "chat.jsonl", chat_records(24, long_prompts=12, words=6))
    prepare_chat([src], tok, d / "chat")
    return {"dir": d, "ckpt": ckpt, "ref": ref, "run": d / "run.yaml", "prefix": d / "chat"}


def test_native_config_imports_with_transformers_logits(sft):
    from k3train.config import load_config

    ids = torch.randint(0, BASE, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = hf.logits(hf.from_pretrained(sft["ckpt"]), ids), sft["ref"](ids).logits
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"\nlayer_types config.json: logits max rel diff {rel:.2e} vs transformers")
    assert rel < 1e-4
    cfg = load_config(sft["run"], sft_overrides(sft["dir"] / "x", sft["prefix"], 1))
    assert (cfg.data.tokenizer, cfg.data.bos_token, cfg.data.eos_token, cfg.data.pad_token) == \
        (str(sft["ckpt"] / "tiktoken.model"), "[BOS]", "[EOS]", "[PAD]")
    assert (cfg.model.full_attn_interval, cfg.model.first_k_dense_replace, cfg.model.kda_num_heads) == (4, 1, 4)


def _snap(tr, rec) -> dict:
    return {"params": {n: p.detach().clone() for n, p in tr.pm.model.named_parameters()},
            "grads": owned_grads(tr), "loss": rec["loss"]}


def _expert_slice(p: torch.nn.Parameter, want: torch.Tensor) -> torch.Tensor:
    if getattr(p, "_k3_expert_parallel", False) and p.shape != want.shape:
        return want[p._k3_shard_offset:p._k3_shard_offset + p.shape[0]]
    return want


def _layouts_body(rank: int, world: int, run_yaml: str, prefix: str, tmp: str, ref: list[dict]) -> None:
    from k3train.config import load_config
    from k3train.trainer import Trainer

    torch.set_num_threads(1)
    for name, layout in LAYOUTS.items():
        cfg = load_config(run_yaml, sft_overrides(Path(tmp) / name, Path(prefix), STEPS, layout), world_size=world)
        tr = Trainer(cfg)
        try:
            worst = [0.0, 0.0, 0.0]
            for s in range(STEPS):
                rec = tr.train_step()
                assert abs(rec["loss"] - ref[s]["loss"]) <= 1e-5 * abs(ref[s]["loss"]), \
                    f"{name} step {s + 1}: loss {rec['loss']} vs {ref[s]['loss']}"
                params = {n: p.detach() for n, p in tr.pm.model.named_parameters()}
                want_p = {n: _expert_slice(p, ref[s]["params"][n]) for n, p in tr.pm.model.named_parameters()}
                grads = owned_grads(tr)
                want_g = {n: _expert_slice(dict(tr.pm.model.named_parameters())[n], ref[s]["grads"][n])
                          for n in grads}
                assert_close_all(grads, want_g, atol=1e-6, rtol=1e-4, what=f"{name} step {s + 1} grad",
                                 scale_atol=1e-5)
                assert_close_all(params, want_p, atol=2e-6, rtol=1e-4, what=f"{name} step {s + 1} param")
                worst = [max(worst[0], abs(rec["loss"] - ref[s]["loss"])), max(worst[1], max_diffs(grads, want_g)[1]),
                         max(worst[2], max_diffs(params, want_p)[0])]
            if rank == 0:
                print(f"sft layout {name}: max |loss diff| {worst[0]:.2e}, grad max rel {worst[1]:.2e}, "
                      f"param max abs {worst[2]:.2e} over {STEPS} steps")
        finally:
            tr.metrics.close()
        dist.barrier()


def test_sft_layouts_equal_one_process(sft):
    from k3train.config import load_config
    from k3train.trainer import Trainer

    tr = Trainer(load_config(sft["run"], sft_overrides(sft["dir"] / "one", sft["prefix"], STEPS)))
    try:
        assert torch.equal(tr.pm.model.layers["1"].ffn.experts.w_gate[3],
                           hf.from_pretrained(sft["ckpt"]).layers["1"].ffn.experts.w_gate[3])  # starts from it
        ref, counts = [], []
        for _ in range(STEPS):
            full = tr.loader.global_batch(tr.loader.consumed_samples)
            counts.append(full.loss_mask.sum(dim=1).numpy())  # assistant targets per row
            ref.append(_snap(tr, tr.train_step()))
    finally:
        tr.metrics.close()
    counts = np.stack(counts)
    # the data gives rows (micro-batches) and a dp rank's whole share (2 rows) without any assistant target
    assert (counts == 0).any() and (counts.reshape(STEPS, 2, 2).sum(-1) == 0).any() and (counts > 0).any(), counts
    assert all(np.isfinite(r["loss"]) for r in ref)
    run_distributed(_layouts_body, 2, str(sft["run"]), str(sft["prefix"]), str(sft["dir"]), ref)


LEARN_STEPS = 24


def held_out_assistant_loss(sft: dict, shuffled: bool) -> float:
    """Fine-tune the imported model ``LEARN_STEPS`` steps on rule (or shuffled) chat data; the validation loss over
    the held-out split's assistant tokens at the end."""
    from k3train.config import load_config
    from k3train.data.chat.prepare import prepare_chat
    from k3train.data.special_tokens import SpecialTokens
    from k3train.data.tokenizer import load_tokenizer
    from k3train.trainer import Trainer

    name = "shuffled" if shuffled else "rule"
    tok = load_tokenizer(sft["ckpt"] / "tiktoken.model", SpecialTokens(*KIMI_NAMES))
    prefix = sft["dir"] / f"learn_{name}"
    prepare_chat([write_chat(sft["dir"] / f"{name}.jsonl", rule_records(600, shuffled))], tok, prefix)
    over = sft_overrides(sft["dir"] / f"run_{name}", prefix, LEARN_STEPS, gbs=6) + [
        "--data.split=90,10,0", f"--train.eval_interval={LEARN_STEPS}", "--train.eval_iters=2", "--optim.lr=1.5e-2",
        "--optim.warmup_steps=5"]
    tr = Trainer(load_config(sft["run"], over))
    try:
        for _ in range(LEARN_STEPS):
            tr.train_step()
        return tr.evaluator.evaluate()["val_loss"]
    finally:
        tr.metrics.close()


def test_sft_learns_what_only_the_answers_teach(sft):
    """Answers that follow from the prompt by a rule are learnt: the held-out assistant loss falls well below the
    same run's on answers shuffled across conversations (which only their overall frequencies predict)."""
    rule, shuffled = held_out_assistant_loss(sft, False), held_out_assistant_loss(sft, True)
    print(f"\nheld-out assistant loss after {LEARN_STEPS} SFT steps: rule {rule:.3f}, shuffled {shuffled:.3f}")
    assert rule < 0.75 * shuffled, (rule, shuffled)
