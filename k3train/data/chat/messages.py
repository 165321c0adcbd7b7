"""Chat conversations in JSONL: one conversation per line, ``{"messages": [...], "tools": [...]?}``.

A message is an object with ``role`` (``system``, ``user``, ``assistant`` or ``tool``) and ``content`` (a string,
or a list of content parts -- objects, e.g. ``{"type": "text", "text": ...}``). An assistant message may carry
``tool_calls`` (a list of objects) instead of content, and reasoning (``reasoning_content``); a tool message may
carry ``tool_call_id`` and ``name``. Every other field is kept and given to the template as it is. ``tools``
(optional, a list of objects) is the conversation's tool declarations, given to the template as ``tools``.

Every problem is one :class:`~k3train.data.corpus.DataError` line naming ``file:line``: malformed JSON, no
``messages`` list, a malformed message, an unknown role, a conversation with no assistant turn, content holding
the text of one of the tokenizer's special tokens. Blank lines are skipped.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3train.data.chat.template import GEN_END, GEN_START
from k3train.data.corpus import DataError, open_text

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    source: str  # file:line
    tools: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def check_message(m: Any, i: int, where: str) -> None:
    if not isinstance(m, dict):
        raise DataError(f"{where}: messages[{i}] is {type(m).__name__}, expected an object with role and content")
    role = m.get("role")
    if role not in ROLES:
        raise DataError(f"{where}: messages[{i}] has role {role!r}; known roles: {', '.join(ROLES)}")
    content = m.get("content")
    if content is None:
        if not (role == "assistant" and m.get("tool_calls")):
            raise DataError(f"{where}: messages[{i}] ({role}) has no content")
    elif isinstance(content, list):
        if not all(isinstance(p, dict) for p in content):
            raise DataError(f"{where}: messages[{i}] ({role}) content is a list whose parts are not all objects")
    elif not isinstance(content, str):
        raise DataError(f"{where}: messages[{i}] ({role}) content is {type(content).__name__}, expected a string "
                        "or a list of parts")
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise DataError(f"{where}: messages[{i}] tool_calls must be a list of objects")


def check_conversation(obj: Any, where: str, special_names: Iterable[str] = ()) -> Conversation:
    """A :class:`Conversation` from one parsed JSONL line, or a :class:`DataError` naming ``where``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise DataError(f"{where}: expected an object with a 'messages' list")
    msgs = obj["messages"]
    if not msgs:
        raise DataError(f"{where}: 'messages' is empty")
    for i, m in enumerate(msgs):
        check_message(m, i, where)
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' must be a list of objects")
    names = [n for n in special_names if n]
    for s in _strings([msgs, tools]):
        if GEN_START in s or GEN_END in s:
            raise DataError(f"{where}: a message holds the private-use character U+E000 or U+E001 (k3train marks "
                            "generation blocks with them)")
        hit = next((n for n in names if n in s), None)
        if hit is not None:
            raise DataError(f"{where}: a message contains the special token text {hit!r}")
    return Conversation(msgs, where, tools, {k: v for k, v in obj.items() if k not in ("messages", "tools")})


def read_conversations(path: str | Path, special_names: Iterable[str] = ()) -> Iterator[Conversation]:
    """The conversations of one ``.jsonl[.gz]`` file, checked (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"input file not found: {p}")
    names = tuple(special_names)
    try:
        with open_text(p) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: malformed JSON ({e.msg})") from None
                yield check_conversation(obj, where, names)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {p}: {type(e).__name__}: {e}") from None
