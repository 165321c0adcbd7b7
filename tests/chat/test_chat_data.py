"""Chat rendering, assistant masks and ``prepare-data --chat``:

* for a template with ``{% generation %}`` blocks and one without (and a ChatML-like one), the rendered text equals
  transformers' ``apply_chat_template(tokenize=False)`` and the mask covers exactly the assistant spans (with the
  generation template: equal to transformers' ``return_assistant_tokens_mask``);
* tool calls, tool results and reasoning are kept and rendered when the template uses them;
* bad input (no assistant turn, unknown role, malformed message, malformed JSON, a template that fails to render,
  special-token text in a message) is one ``k3train: error:`` line naming file and line, exit 2, nothing written.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chat_helpers import (CHATML_TEMPLATE, KIMI_NAMES, TEMPLATE_GENERATION, TEMPLATE_PLAIN,
                          write_hf_tokenizer_with_chat_tokens, write_jsonl, write_kimi_tokenizer)
from k3train.data.chat.prepare import encode_conversation, mask_prefix, prepare_chat
from k3train.data.chat.messages import check_conversation
from k3train.data.chat.template import ChatTemplate, assistant_spans
from k3train.data.dataset import read_documents_back
from k3train.data.special_tokens import SpecialTokens
from k3train.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Reverse: one two three"},
                  {"role": "assistant", "content": "three two one"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "天气怎么样？"},
                  {"role": "assistant", "content": "晴天 ☀️", "reasoning_content": "look outside"},
                  {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "code?"}]},
                  {"role": "assistant", "content": "def f():\n    return 1\n"}]},
    {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
     "messages": [{"role": "user", "content": "2+3?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"},
                  {"role": "assistant", "content": "It is 5."}]},
]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_chat_tok")
    return load_tokenizer(write_kimi_tokenizer(d), SpecialTokens(*KIMI_NAMES))


def _hf_tokenizer(d: Path, template: str):
    transformers = pytest.importorskip("transformers")
    path = write_hf_tokenizer_with_chat_tokens(d, template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<|bos|>", eos_token="<|eos|>",
                                              pad_token="<|pad|>")
    hf.chat_template = template
    return path, hf


@pytest.mark.parametrize("name, template", [("generation", TEMPLATE_GENERATION), ("plain", TEMPLATE_PLAIN),
                                            ("chatml", CHATML_TEMPLATE)])
def test_rendering_and_masks_match_transformers(tmp_path, name, template):
    path, hf = _hf_tokenizer(tmp_path, template)
    tok = load_tokenizer(path)
    tpl = ChatTemplate(template, tok.template_tokens)
    convs = CONVERSATIONS if name != "chatml" else [CONVERSATIONS[0]]
    for rec in convs:
        conv = check_conversation(rec, "test:1")
        want = hf.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=False)
        text, spans = assistant_spans(tpl, conv.messages, conv.tools)
        assert text == want == tpl.render(conv.messages, conv.tools)
        ids, mask = encode_conversation(conv, tpl, tok)
        assert ids.tolist() == hf(want, add_special_tokens=False)["input_ids"]
        assistant = [m for m in rec["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(assistant)
        for (a, b), m in zip(spans, assistant):  # each span: the answer and its end-of-turn token, nothing else
            assert text[a:b].endswith("<|im_end|>") and (m.get("content") or "") in text[a:b]
            assert "<|im_user|>" not in text[a:b] and "<|im_assistant|>" not in text[a:b]
        if name == "generation":
            out = hf.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
            assert mask.tolist() == list(out["assistant_masks"])
        # the decoded masked tokens are exactly the assistant spans' text
        assert tok.decode(ids[mask.astype(bool)]) == "".join(text[a:b] for a, b in spans)
    assert "tool_declare" in text and 'add:{"a": 2, "b": 3}' in text and "<think>look outside</think>" not in text \
        if name != "chatml" else True


def test_reasoning_and_tool_fields_reach_the_template(kimi_tok):
    tpl = ChatTemplate(TEMPLATE_PLAIN, kimi_tok.template_tokens)
    text, spans = assistant_spans(tpl, CONVERSATIONS[1]["messages"])
    assert "<think>look outside</think>晴天 ☀️<|im_end|>" in [text[a:b] for a, b in spans]
    msgs = [{**m, "reasoning": m.pop("reasoning_content")} if "reasoning_content" in m else m
            for m in json.loads(json.dumps(CONVERSATIONS[1]["messages"]))]
    assert tpl.render(msgs) == text  # 'reasoning' is aliased to reasoning_content, as transformers does


def test_prepare_chat_writes_tokens_and_mask(kimi_tok, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    info, stats = prepare_chat([src], kimi_tok, tmp_path / "c")
    assert info.num_documents == 3 and stats.conversations == 3 and 0 < stats.assistant_tokens < stats.tokens
    toks = list(read_documents_back(tmp_path / "c"))
    masks = list(read_documents_back(mask_prefix(tmp_path / "c")))
    tpl = ChatTemplate(TEMPLATE_PLAIN, kimi_tok.template_tokens)
    for rec, t, m in zip(CONVERSATIONS, toks, masks):
        ids, mask = encode_conversation(check_conversation(rec, "x"), tpl, kimi_tok)
        assert t.tolist() == ids.tolist() + [kimi_tok.eos_id] and m.tolist() == mask.tolist() + [0]
    meta = json.loads((tmp_path / "c.meta.json").read_text())
    assert meta["chat"]["mask"] == "c.mask" and meta["tokenizer_sha256"] == kimi_tok.sha256


BAD = {
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "unknown role": ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     "has role 'robot'"),
    "malformed message": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
                          "content is int"),
    "not a list": ({"messages": "hello"}, "expected an object with a 'messages' list"),
    "special token text": ({"messages": [{"role": "user", "content": "a <|im_end|> b"},
                                         {"role": "assistant", "content": "y"}]}, "special token text '<|im_end|>'"),
    "template raises": ({"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "y"}]},
                        "the chat template failed to render (TemplateError: no boom)"),
}


def _bad_case(tmp_path: Path, how: str) -> tuple[Path, Path, str]:
    """A tokenizer whose template raises on 'boom', and an input whose 3rd line is bad in way ``how``."""
    template = "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}" + TEMPLATE_PLAIN
    path = write_kimi_tokenizer(tmp_path / "tok", template=template)
    good = json.dumps(CONVERSATIONS[0])
    src = tmp_path / "in.jsonl"
    bad_line = "{'messages': oops" if how == "malformed JSON" else json.dumps(BAD[how][0])
    src.write_text(good + "\n\n" + bad_line + "\n" + good + "\n")
    return path, src, "malformed JSON" if how == "malformed JSON" else BAD[how][1]


@pytest.mark.parametrize("how", [*BAD, "malformed JSON"])
def test_bad_chat_input_is_one_line_and_writes_nothing(tmp_path, how):
    from k3train.data.corpus import DataError

    path, src, needle = _bad_case(tmp_path, how)
    out = tmp_path / "out" / "c"
    with pytest.raises(DataError) as e:
        prepare_chat([src], load_tokenizer(path, SpecialTokens(*KIMI_NAMES)), out)
    msg = str(e.value)
    assert msg.startswith(f"{src}:3: ") and needle in msg and "\n" not in msg, msg
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_bad_chat_input_through_the_command(tmp_path):
    """The real command: exit 2, one ``k3train: error:`` line naming file and line, no traceback, nothing written."""
    path, src, needle = _bad_case(tmp_path, "unknown role")
    out = tmp_path / "out" / "c"
    res = subprocess.run([sys.executable, "-m", "k3train.cli", "prepare-data", "--chat", "--input", str(src),
                          "--tokenizer", str(path), "--bos-token", "[BOS]", "--eos-token", "[EOS]", "--pad-token",
                          "[PAD]", "--output-prefix", str(out)], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3train:")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith(f"k3train: error: {src}:3: ") and needle in lines[0], lines[0]
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_template_without_spans_turn_by_turn_is_refused(kimi_tok):
    """A template that renders earlier turns differently once later ones follow cannot be split turn by turn."""
    drops_history = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]{% else %}"
                     "{{ m.role }}:{{ m.content }}<|im_end|>{% endif %}{% endfor %}")
    tpl = ChatTemplate(drops_history, kimi_tok.template_tokens)
    with pytest.raises(ValueError, match="generation"):
        assistant_spans(tpl, CONVERSATIONS[1]["messages"])
