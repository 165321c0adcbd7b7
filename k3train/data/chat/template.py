"""A chat template rendered as transformers' ``apply_chat_template`` renders it, and where the assistant's text is.

The environment is jinja2's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (a template from a checkpoint is
untrusted: no attribute escapes, no mutation of the inputs) with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), ``{% generation %}...{% endgeneration %}`` blocks,
the ``tojson`` filter as transformers defines it (``json.dumps``, non-ASCII kept, ``indent``/``separators``/
``sort_keys``), and the globals ``raise_exception(msg)``, ``strftime_now(fmt)``, ``namespace`` (no underscore
names) and ``dict``. The template sees ``messages``, ``tools``, ``documents`` (None), ``add_generation_prompt`` and
the tokenizer's named tokens (``bos_token``, ``eos_token``, ...), as transformers passes them.

Messages are given to the template as transformers normalises them: keys whose value is None dropped, and a message
with reasoning under ``reasoning_content``, ``thinking`` or ``reasoning`` carries it under both ``thinking`` and
``reasoning_content``.

Assistant spans (character ranges of the rendered text), :func:`assistant_spans`:

* a template with ``{% generation %}`` blocks: exactly the text those blocks render (what transformers'
  ``return_assistant_tokens_mask`` marks);
* a template without them: the conversation is rendered turn by turn; for the assistant message ``k`` the span
  runs from the end of ``messages[:k]`` rendered with ``add_generation_prompt=True`` (the assistant header) to the
  end of ``messages[:k+1]`` rendered without it, less trailing whitespace -- the answer and its end-of-turn token.
  Each of those renderings must be a prefix of the whole conversation's; a template that renders earlier turns
  differently once later ones follow (e.g. drops earlier reasoning) cannot be split so and is refused: mark its
  assistant turns with ``{% generation %}``.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

GEN_START, GEN_END = "\ue000", "\ue001"  # private-use marks around a {% generation %} block's output
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateFailed(ValueError):
    """The template raised or could not be compiled (the message is one line)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}``: the body's output between the marks :data:`GEN_START` /
    :data:`GEN_END` (removed again by :meth:`ChatTemplate.render`, which records where they were)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        return GEN_START + caller() + GEN_END


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` without underscore attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2.utils.Namespace's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=_make_dict)
    return env


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them (module docstring): None values dropped, reasoning aliased."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class ChatTemplate:
    """A compiled chat template with the tokenizer's named tokens (``bos_token``, ``eos_token``, ...)."""

    def __init__(self, source: str, named_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = make_environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateFailed(f"the chat template does not compile ({_one_line(e)})") from None
        self.source = source
        self.named_tokens = dict(named_tokens or {})
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))

    def render_marked(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                      add_generation_prompt: bool = False) -> str:
        """The rendered text with the generation marks still in."""
        try:
            return self._template.render(messages=normalize_messages(messages), tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.named_tokens)
        except Exception as e:  # noqa: BLE001 - anything a template raises is a template failure, one line
            raise TemplateFailed(f"the chat template failed to render ({_one_line(e)})") from None

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The text transformers' ``apply_chat_template(..., tokenize=False)`` gives."""
        return strip_marks(self.render_marked(messages, tools, add_generation_prompt))[0]


def strip_marks(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """``(text without the generation marks, [(start, end)] of each marked block in that text)``."""
    text, spans, pos, open_at, depth = [], [], 0, 0, 0
    for piece in re.split(f"([{GEN_START}{GEN_END}])", marked):
        if piece == GEN_START:
            if depth == 0:
                open_at = pos
            depth += 1
        elif piece == GEN_END:
            depth -= 1
            if depth == 0 and pos > open_at:
                spans.append((open_at, pos))
        else:
            text.append(piece)
            pos += len(piece)
    return "".join(text), spans


def assistant_spans(tpl: ChatTemplate, messages: list[dict[str, Any]], tools: list[Any] | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """``(rendered conversation, [(start, end)] of the assistant's text)`` (module docstring)."""
    if tpl.has_generation_blocks:
        return strip_marks(tpl.render_marked(messages, tools))
    full = tpl.render(messages, tools)
    spans = []
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        head = tpl.render(messages[:k], tools, add_generation_prompt=True)
        upto = tpl.render(messages[:k + 1], tools)
        if not (full.startswith(head) and full.startswith(upto) and len(upto) >= len(head)):
            raise TemplateFailed(f"the chat template does not render message {k} (assistant) turn by turn (the "
                                 "conversation up to it is not a prefix of the whole): mark the assistant turns of "
                                 "the template with {% generation %} ... {% endgeneration %}")
        end = len(upto.rstrip())
        if end > len(head):
            spans.append((len(head), end))
    return full, spans
