"""The ``data`` section: the dataset, its tokenizer and special tokens, the split, the multimodal format; the
one parser of ``data.split``; and the section's check."""
from __future__ import annotations

import re
from dataclasses import dataclass

from k3train.config.model import ModelConfig
from k3train.config.report import Need, Origin
from k3train.config.vision import VisionConfig
from k3train.runtime.bad_input import ConfigError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str, where: str = "") -> tuple[float, float, float]:
    """``data.split`` -> its three weights (train, valid, test): exactly three finite non-negative numbers with a
    positive sum, e.g. ``"98,2,0"``. Megatron's own parser picks numbers out with a regex and accepts anything
    (``"98-2"`` would be ``[98, 2, 0]``), so this is the one rule both the config and the dataset builder use."""
    parts = [x.strip() for x in str(split).split(",")]
    # plain decimals only ("1e2" would be read by Megatron's regex as two numbers)
    w = tuple(float(x) for x in parts) if all(re.fullmatch(r"\d+\.?\d*|\.\d+", x) for x in parts) else ()
    if len(w) != 3 or sum(w) <= 0:
        raise ConfigError(f"data.split: cannot parse {split!r}: expected 3 comma-separated non-negative decimal "
                          f"weights (train,valid,test) with a positive sum, e.g. '98,2,0'{where}")
    return w  # type: ignore[return-value]


@dataclass
class DataConfig:
    path: str = "data_cache/corpus_text_document"  # Megatron indexed-dataset prefix (.bin/.idx)
    tokenizer: str = "k3train/data/assets/tokenizer.json"
    split: str = "98,2,0"
    # the literal special tokens of data.tokenizer; their ids must equal model.bos/eos/pad/media_placeholder_token_id
    # wherever a run reads the tokenizer (k3train/preflight.py: check_token_ids)
    bos_token: str = "<|bos|>"
    eos_token: str = "<|eos|>"  # appended to every document by tools/prepare_data.py
    pad_token: str = "<|pad|>"
    media_placeholder_token: str = ""  # "" = no vision placeholder (then model.media_placeholder_token_id = -1)
    # "text": data.path is a text dataset (Megatron GPTDataset); "multimodal": data.path was made by
    # tools/prepare_data.py --multimodal (tokens + media store) and batches carry Batch.media (k3train/data/multimodal);
    # "chat": data.path was made by `k3train prepare-data --chat` (tokens + assistant-only loss mask): whole
    # conversations packed into rows, the loss on the assistant's tokens only (k3train/data/chat)
    format: str = "text"
    # chat: a conversation longer than train.seq_len + 1 tokens is dropped, or truncated to its first seq_len + 1
    # tokens ("truncate"); the counts are logged per split
    chat_overlong: str = "drop"
    max_media_pixels: int = 3584 * 3584  # multimodal: largest image / frame (height * width px) a run accepts


def check_data(d: DataConfig, m: ModelConfig, v: VisionConfig, need: Need, origin: Origin) -> None:
    """The special tokens' names (their ids are compared with the tokenizer wherever a run reads it,
    k3train/preflight.py: check_token_ids; a meta-device tool reads none), the split, the format."""
    names = [d.bos_token, d.eos_token, d.pad_token]
    need(all(names) and len(set(names)) == 3, "data.bos_token",
         f"data.bos_token / eos_token / pad_token must be three different non-empty tokens, got {names}",
         "data.bos_token", "data.eos_token", "data.pad_token")
    parse_split(d.split, f" ({origin('data.split')})")
    need(d.format in ("text", "multimodal", "chat"), "data.format",
         f"must be 'text', 'multimodal' or 'chat', got {d.format!r}")
    need(d.chat_overlong in ("drop", "truncate"), "data.chat_overlong",
         f"must be 'drop' or 'truncate', got {d.chat_overlong!r}")
    need(d.max_media_pixels >= 28 * 28, "data.max_media_pixels",
         f"must be >= {28 * 28} (one 28 x 28 px unit), got {d.max_media_pixels}")
    if d.format == "multimodal":
        check_multimodal_against_model(d, m, v, need)


def check_multimodal_against_model(d: DataConfig, m: ModelConfig, v: VisionConfig, need: Need) -> None:
    """Cross-section: multimodal data (k3train/data/multimodal) needs the placeholder token and its id, and the
    vision encoder; a text-only model would train on bare placeholder tokens and never see the media (the
    placeholder id's range is checked with the vision section; the tokenizer's token in preflight.check_data)."""
    need(bool(d.media_placeholder_token) and m.media_placeholder_token_id >= 0, "data.format",
         "multimodal data needs data.media_placeholder_token (e.g. '<|media_pad|>' of "
         "k3train/data/assets/tokenizer-vl.json) and its id in model.media_placeholder_token_id",
         "data.format", "data.media_placeholder_token", "model.media_placeholder_token_id")
    need(v.enabled, "data.format",
         "multimodal data needs vision.enabled=true (the MoonViT-V2 encoder that turns the media into the "
         "placeholders' embeddings); with vision.enabled=false the model never sees the media",
         "data.format", "vision.enabled")
