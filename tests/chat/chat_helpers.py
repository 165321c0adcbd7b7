"""Test pieces for chat data: a tiktoken tokenizer in a Kimi checkpoint's files (``tiktoken.model`` ranks built from
the shipped byte-level BPE's merges, ``tokenizer_config.json`` with Kimi's special-token layout and class name),
Kimi-style chat templates with and without ``{% generation %}`` blocks, and chat JSONL written from real text."""
from __future__ import annotations

import base64
import json
import random
from pathlib import Path

from tokenizers import Tokenizer

from k3train.data.tokenizer import DEFAULT_TOKENIZER

N_MERGES = 700  # ranks: 256 bytes + the shipped BPE's first merges -> specials from 956, vocabulary 956 + 256
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
                 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>", 254: "[UNK]",
                 255: "[PAD]"}

# A Kimi-style template (roles as Kimi's headers, tool declarations and tool calls rendered, a default system prompt)
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{GEN_OPEN}"
    "{%- if message.get('reasoning_content') -%}<think>{{ message['reasoning_content'] }}</think>{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- if message.get('tool_calls') -%}<|tool_calls|>{%- for tc in message['tool_calls'] -%}"
    "{{ tc['function']['name'] }}:{{ tc['function']['arguments'] | tojson }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>{GEN_CLOSE}"
    "{%- else -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
TEMPLATE_PLAIN = KIMI_TEMPLATE.replace("{GEN_OPEN}", "").replace("{GEN_CLOSE}", "")
TEMPLATE_GENERATION = KIMI_TEMPLATE.replace("{GEN_OPEN}", "{%- generation -%}").replace(
    "{GEN_CLOSE}", "{%- endgeneration -%}")
# ChatML-like with a newline after each turn (the end-of-turn token, then whitespace the mask leaves out)
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_user|>' + message['role'] + '\n' + message['content'] "
                   "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_user|>assistant\n' }}"
                   "{% endif %}")


def byte_level_ranks(n_merges: int = N_MERGES) -> dict[bytes, int]:
    """tiktoken ranks: the 256 bytes, then the shipped BPE's first ``n_merges`` merged tokens in id order."""
    tok = json.loads(Path(DEFAULT_TOKENIZER).read_text())
    vocab = tok["model"]["vocab"]
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    to_byte = {chr(c): b for b, c in zip(bs, cs)}
    ranks = {bytes([b]): b for b in range(256)}
    merged = sorted((i, s) for s, i in vocab.items() if len(s) > 1 and not s.startswith("<|"))
    for i, s in merged[:n_merges]:
        ranks.setdefault(bytes(to_byte[ch] for ch in s), len(ranks))
    return ranks


def write_kimi_tokenizer(d: Path, template: str | None = TEMPLATE_PLAIN, n_merges: int = N_MERGES,
                         tokenizer_class: str = "TikTokenTokenizer") -> Path:
    """``d/tiktoken.model`` + ``d/tokenizer_config.json`` (a Kimi checkpoint's tokenizer files); returns the ranks
    file. Special ids: ranks count + the offsets of :data:`KIMI_SPECIALS`."""
    d.mkdir(parents=True, exist_ok=True)
    ranks = byte_level_ranks(n_merges)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    cfg = {"tokenizer_class": tokenizer_class,
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
           "added_tokens_decoder": {str(base + k): {"content": v, "special": True, "lstrip": False,
                                                    "normalized": False, "rstrip": False, "single_word": False}
                                    for k, v in KIMI_SPECIALS.items()},
           "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
           "model_max_length": 1048576}
    if tokenizer_class != "TikTokenTokenizer":
        cfg["auto_map"] = {"AutoTokenizer": [f"tokenization_other.{tokenizer_class}", None]}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return d / "tiktoken.model"


KIMI_NAMES = ("[BOS]", "[EOS]", "[PAD]")


def write_hf_tokenizer_with_chat_tokens(d: Path, template: str) -> Path:
    """The shipped tokenizer.json plus the chat special tokens, with a tokenizer_config.json holding ``template``."""
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    tok.add_special_tokens(["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<|bos|>", "eos_token": "<|eos|>",
                                                         "pad_token": "<|pad|>", "chat_template": template}))
    return d / "tokenizer.json"


def reverse_words_conversations(texts: list[str], shuffle_answers: bool = False, seed: int = 0) -> list[dict]:
    """Chat records whose answer is the user's words in reverse order (or, shuffled, another record's answer)."""
    recs = []
    for t in texts:
        words = t.split()
        recs.append({"messages": [{"role": "user", "content": " ".join(words)},
                                  {"role": "assistant", "content": " ".join(reversed(words))}]})
    if shuffle_answers:
        answers = [r["messages"][1]["content"] for r in recs]
        random.Random(seed).shuffle(answers)
        for r, a in zip(recs, answers):
            r["messages"][1]["content"] = a
    return recs


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path
