"""Hugging Face checkpoints in and out: the published Kimi Linear (``kimi_linear``) and Kimi K3 (``kimi_k3``)
layouts (names in k3train/hf/names.py, config fields in k3train/hf/config_map.py).

* ``k3train import-hf HF_DIR -o RUN.yaml`` writes a run config from ``config.json``; ``--checkpoint.load_hf=HF_DIR``
  starts a run from the weights in any parallel layout (k3train/hf/load.py: each rank reads its own tensors);
* ``k3train export-hf --config C --checkpoint CKPT -o OUT`` writes sharded safetensors + index + config.json,
  every rank its own tensors (k3train/hf/export.py);
* for tools and tests: :func:`from_pretrained` (a single-process ``K3Model`` with the weights) and :func:`logits`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3train.hf.config_map import config_from_hf
from k3train.hf.load import check_hf_checkpoint, load_hf_weights
from k3train.model.model import K3Model
from k3train.model.seq import SeqInfo


def from_pretrained(hf_dir: str | Path, dtype: torch.dtype = torch.float32, overrides: list[str] | None = None):
    """A single-process :class:`k3train.model.model.K3Model` of the checkpoint's config with its weights, in
    ``dtype``, in eval mode. ``overrides``: ``--section.key=value`` (e.g. ``--model.kda_chunk_size=16``)."""
    cfg = config_from_hf(hf_dir, overrides, world_size=1)
    check_hf_checkpoint(cfg)
    model = K3Model(cfg.model, cfg.vision)
    load_hf_weights([model], cfg)
    model.hf_config = cfg
    return model.to(dtype).eval()


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` next-token logits of ``input_ids [B, T]`` (each row one document, positions 0..T-1)."""
    B, T = input_ids.shape
    doc_ids = torch.zeros(B, T, dtype=torch.long, device=input_ids.device)
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    seq = SeqInfo.from_doc_ids(doc_ids, positions)
    state = model.forward_layers(model.embed(input_ids), 0, model.cfg.num_hidden_layers, seq)
    return model.lm_head(model.final_hidden(state))


__all__ = ["from_pretrained", "logits"]
