"""Tool calls in a model's turn: parsing them out of its text, writing them, and the tiny model's tool
reply. The one parser of ``<tool_call>`` blocks: the episodes' environments (generators/envs/) read a turn's
calls with :func:`parse_tool_calls`; the OpenAI endpoint answers them as OpenAI ``tool_calls``
(:func:`openai_tool_calls`) and writes a conversation's earlier calls back with :func:`tool_call_text`.

Two forms, both between ``<tool_call>`` and ``</tool_call>`` (several per turn allowed):

- **Hermes / Qwen JSON** (what chat templates with tools produce):
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "7*8"}}</tool_call>``.
  ``arguments`` may also be a JSON string holding the object (some models write it so).
- **Compact** (the built-in tiny model, whose tokenizer has no letters): ``<tool_call>7*8</tool_call>``,
  any content that does not start with ``{``. It means "the environment's default tool, its single
  argument = the content"; the parser returns it with ``name == ""`` and ``compact`` set, and the
  environment resolves the tool (:meth:`generators.envs.tools.Tool.compact_arguments`).

A call that cannot be read is returned with ``error`` set, never raised: the model wrote it, so it is
the model's mistake, answered as such by the environment and counted. Errors: ``bad_json`` (content
starts with ``{`` but is not JSON), ``bad_call`` (JSON, but not ``{"name": str, "arguments": object}``),
``empty`` (nothing between the tags), ``unclosed`` (a ``<tool_call>`` with no ``</tool_call>`` after it:
the turn ended inside a call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
COMPACT_ARG = "input"  # the key under which a compact call's content is kept in ``arguments``


@dataclass
class ParsedCall:
    """One tool call as the model wrote it.

    name:      the tool's name; "" for a compact call (the environment's default tool).
    arguments: the call's arguments (a compact call: ``{"input": content}``); {} when unreadable.
    raw:       the text between the tags, as written.
    error:     "" when readable, else bad_json / bad_call / empty / unclosed.
    compact:   written in the compact form.
    span:      where the call (tags included) stands in the text parsed.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str = ""
    compact: bool = False
    span: tuple[int, int] = (0, 0)


def _parse_one(raw: str) -> ParsedCall:
    content = raw.strip()
    if not content:
        return ParsedCall("", raw=raw, error="empty")
    if not content.startswith("{"):
        return ParsedCall("", {COMPACT_ARG: content}, raw=raw, compact=True)
    try:
        obj = json.loads(content)
    except json.JSONDecodeError:
        return ParsedCall("", raw=raw, error="bad_json")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParsedCall("", raw=raw, error="bad_call")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments JSON-encoded as a string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ParsedCall(obj["name"], raw=raw, error="bad_json")
    if not isinstance(args, dict):
        return ParsedCall(obj["name"], raw=raw, error="bad_call")
    return ParsedCall(obj["name"], args, raw=raw)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every tool call in ``text``, in order; [] when the turn has none (it is a final answer)."""
    calls = []
    for m in CALL.finditer(text):
        call = _parse_one(m.group(1))
        call.span = m.span()
        calls.append(call)
    start = text.rfind(CLOSE) + len(CLOSE) if CLOSE in text else 0
    if OPEN in text[start:]:  # the turn ended inside a call
        at = text.index(OPEN, start)
        calls.append(ParsedCall("", raw=text[at + len(OPEN) :], error="unclosed", span=(at, len(text))))
    return calls


def strip_tool_calls(text: str) -> str:
    """The turn's text outside its tool calls (what it says besides calling tools), stripped."""
    text = CALL.sub("", text)
    if OPEN in text:
        text = text[: text.index(OPEN)]
    return text.strip()


def tool_call_text(name: str, arguments: Any) -> str:
    """A tool call as the Hermes format writes it (what a model is asked to emit)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def openai_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of sampled text, as the OpenAI API answers them: each readable JSON call
    becomes an OpenAI tool call (its arguments JSON-encoded); the text outside them is the content (None
    when empty). A call that cannot be read, or the compact form (no tool is named), stays in the content,
    so the harness sees what the model wrote."""
    calls, spans = [], []
    for c in parse_tool_calls(text):
        if c.error or c.compact:
            continue
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
        )
        spans.append(c.span)
    content = text
    for a, b in reversed(spans):
        content = content[:a] + content[b:]
    content = content.strip()
    return (content or None) if calls else text, calls


def render_tool_response(text: str) -> str:
    """A tool's reply in the tiny model's format (models with a chat template get theirs rendered by
    the template)."""
    return f"<tool_response>{text}</tool_response>"
