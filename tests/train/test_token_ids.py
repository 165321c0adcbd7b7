"""Token ids and lengths are wired, not decorative: ``model.*_token_id`` must be what the run's tokenizer gives its
``data.*_token`` names (k3train/preflight.py: check_token_ids), ``seq_len <= max_position_embeddings``, the special
token names are configurable, and a vocabulary size training cannot reach is said (tools/prepare_data.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from k3train.config import ConfigError, load_config
from k3train.data.corpus import DataError
from k3train.data.tokenizer import SpecialTokens, load_config_tokenizer, load_tokenizer
from k3train.preflight import check_token_ids

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void.\n"


def _prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data_tool", ROOT / "tools" / "prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_seq_len_beyond_max_position_embeddings_is_rejected():
    with pytest.raises(ConfigError, match=r"train.seq_len: seq_len=8192 exceeds model.max_position_embeddings=4096"):
        load_config(TINY, ["--train.seq_len=8192"])


@pytest.mark.parametrize("override, message", [
    ("--model.eos_token_id=5", r"model.eos_token_id=5 but data.tokenizer .* gives '<\|eos\|>' \(data.eos_token\) id 1"),
    ("--model.pad_token_id=0", r"model.pad_token_id=0 but .* '<\|pad\|>' \(data.pad_token\) id 2"),
    ("--model.media_placeholder_token_id=9", r"model.media_placeholder_token_id=9 but data.media_placeholder_token"),
])
def test_token_id_mismatch_names_both_values(override, message):
    cfg = load_config(TINY, [override])
    with pytest.raises(ConfigError, match=message):
        check_token_ids(cfg, load_config_tokenizer(cfg))


def test_shipped_configs_match_the_shipped_tokenizer():
    for name in ("tiny", "small"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        check_token_ids(cfg, load_config_tokenizer(cfg))


def test_own_tokenizer_with_other_special_names(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 20)
    tok_path = tmp_path / "tok.json"
    main = _prepare_data()
    names = ["--bos-token", "<s>", "--eos-token", "</s>", "--pad-token", "<pad>"]
    assert main(["--train-tokenizer", "--input", str(text), "--tokenizer", str(tok_path), "--vocab-size", "512",
                 *names, "--output-prefix", str(tmp_path / "d_text_document")]) == 0
    tok = load_tokenizer(tok_path, SpecialTokens("<s>", "</s>", "<pad>"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2) and tok.vocab_size < 512
    err = capsys.readouterr().err
    assert f"k3train: notice: --vocab-size 512 cannot be reached" in err and f"{tok.vocab_size} ids" in err
    with pytest.raises(DataError, match=r"data.bos_token: tokenizer .* has no special token '<\|bos\|>'"):
        load_tokenizer(tok_path)  # the shipped names are not in it
    cfg = load_config(TINY, [f"--data.tokenizer={tok_path}", "--data.bos_token=<s>", "--data.eos_token=</s>",
                             "--data.pad_token=<pad>"])
    check_token_ids(cfg, load_config_tokenizer(cfg))  # ids 0, 1, 2 as in tiny.yaml
    assert main(["--train-tokenizer", "--input", str(text), "--tokenizer", str(tmp_path / "t2.json"),
                 "--vocab-size", "512", "--exact-vocab-size"]) == 2
    assert "k3train: error: --vocab-size 512 cannot be reached" in capsys.readouterr().err
