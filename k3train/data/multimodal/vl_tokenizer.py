"""The shipped vision tokenizer ``assets/tokenizer-vl.json``: the shipped text tokenizer, unchanged (ids 0..4095),
plus ``<|media_pad|>`` (the media placeholder, id 4096), ``<|media_start|>`` (4097) and ``<|media_end|>`` (4098).

Text encodes to exactly the same ids with either file, so text-only data prepared with ``tokenizer.json`` keeps its
meaning. A run on it names ``data.tokenizer: k3train/data/assets/tokenizer-vl.json``,
``data.media_placeholder_token: <|media_pad|>``, ``model.media_placeholder_token_id: 4096`` and
``model.vocab_size >= 4099``. Rebuild with ``python -m k3train.data.multimodal.vl_tokenizer``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from k3train.data.corpus import ASSETS_DIR, DataError
from k3train.data.tokenizer import DEFAULT_TOKENIZER, SpecialTokens

MEDIA_PAD, MEDIA_START, MEDIA_END = "<|media_pad|>", "<|media_start|>", "<|media_end|>"
VL_TOKENS = (MEDIA_PAD, MEDIA_START, MEDIA_END)
VL_TOKENIZER = ASSETS_DIR / "tokenizer-vl.json"
VL_SPECIAL = SpecialTokens(media=MEDIA_PAD)


def build_vl_tokenizer(src: str | Path = DEFAULT_TOKENIZER, dst: str | Path = VL_TOKENIZER) -> Path:
    """Append :data:`VL_TOKENS` as special tokens to the tokenizer ``src`` (ids ``n, n+1, n+2`` after its ``n``
    ids) and save it to ``dst``."""
    tok = Tokenizer.from_file(str(src))
    n = tok.get_vocab_size(with_added_tokens=True)
    if any(tok.token_to_id(t) is not None for t in VL_TOKENS):
        raise DataError(f"{src} already has media tokens")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_TOKENS])
    got = [tok.token_to_id(t) for t in VL_TOKENS]
    if got != [n, n + 1, n + 2]:
        raise DataError(f"media tokens got ids {got}, expected {[n, n + 1, n + 2]}")
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst), pretty=False)
    return Path(dst)


if __name__ == "__main__":
    print(build_vl_tokenizer(*sys.argv[1:3]))
