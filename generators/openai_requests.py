"""What the OpenAI-compatible endpoint reads from a request (docs/openai-endpoint.md), checked before
anything is sampled: the sampling it may use (the run's; a different temperature, top_p or top_k is refused
or overridden), the session and group it belongs to, a chat's messages (OpenAI's form: content parts, tool
calls, tools) as the chat renderer takes them, and a completion's prompt. Every refusal is a
:class:`~generators.sessions.SessionError` carrying its HTTP status."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from generators.sessions import SessionError
from generators.tool_calls import tool_call_text

if TYPE_CHECKING:
    from generators.chat_render import ChatRenderer
    from generators.config import OpenAIConfig, SamplingConfig

SESSION_HEADER, GROUP_HEADER = "x-relay-session", "x-relay-group"
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def request_sampling(body: dict, run: SamplingConfig, cfg: OpenAIConfig, max_tokens: int) -> tuple[SamplingConfig, str]:
    """The run's sampling for this call (n=1, max_tokens clamped to ``max_tokens``), and the X-Relay-Sampling
    note: the learner trains one sampling transform per run, so a call may not choose its own."""
    asked = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    bad = [k for k, v in asked.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise SessionError(400, f"{', '.join(bad)} must be numbers")
    differ = {k: v for k, v in asked.items() if abs(float(v) - float(getattr(run, k))) > 1e-6}
    note = "as-run"
    if differ:
        ran = {k: getattr(run, k) for k in differ}
        if cfg.sampling_mismatch == "refuse":
            raise SessionError(
                400,
                f"sampling {differ} differs from this run's {ran}: the learner "
                "trains one sampling transform per run; send the run's values or none "
                "(openai.sampling_mismatch = 'override' replaces them)",
            )
        note = "overridden: " + ", ".join(f"{k}={getattr(run, k)}" for k in differ)
    if body.get("n", 1) != 1:
        raise SessionError(400, "n must be 1: each call is one step of one session")
    if body.get("stream"):
        raise SessionError(400, "streaming is not supported by this endpoint (send stream=false)")
    mt = body.get("max_completion_tokens") or body.get("max_tokens") or max_tokens
    if not isinstance(mt, int) or mt < 1:
        raise SessionError(400, f"max_tokens must be a positive integer, got {mt!r}")
    return run.model_copy(update={"n": 1, "max_tokens": min(mt, max_tokens)}), note


def request_ids(headers, body: dict) -> tuple[str | None, str | None]:
    """(session id, group id) of a request: X-Relay-Session or the ``user`` field; X-Relay-Group (None:
    an automatic group)."""
    sid = headers.get(SESSION_HEADER) or body.get("user") or None
    return (str(sid) if sid is not None else None), (headers.get(GROUP_HEADER) or None)


def completion_prompt(body: dict) -> str:
    """A /v1/completions request's prompt: one non-empty string (or a list holding one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise SessionError(400, "prompt must be one non-empty string")
    return prompt


def common_text_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- a chat's messages and tools, for the chat renderer ----------------------------------------------


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI content parts ([{type: text, text}])."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise SessionError(400, f"message content must be a string or text parts, got {type(content).__name__}")


def _arguments(call: dict) -> Any:
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def _tool_calls(msg: dict, calls: list[dict], renderer: ChatRenderer) -> None:
    """An assistant's tool calls, given to a template that knows ``tool_calls`` (arguments as objects, as
    Hugging Face templates expect), else written as ``<tool_call>`` blocks after its text: the same text the
    model is asked to emit, so a session stays an extension."""
    if renderer.native_tool_calls:
        msg["tool_calls"] = [
            {
                "type": "function",
                "id": c.get("id", ""),
                "function": {"name": (c.get("function") or {}).get("name", ""), "arguments": _arguments(c)},
            }
            for c in calls
        ]
    else:
        blocks = "\n".join(tool_call_text((c.get("function") or {}).get("name", ""), _arguments(c)) for c in calls)
        msg["content"] = f"{msg['content']}\n{blocks}" if msg["content"] else blocks


def chat_messages(raw: list[dict], tools: list[dict] | None, renderer: ChatRenderer) -> list[dict]:
    """OpenAI chat messages (and tools) as ``renderer``'s template takes them. A template that does not know
    ``tools`` (SmolLM2's) gets the Hermes convention: the tools described in the system message."""
    if not isinstance(raw, list) or not raw:
        raise SessionError(400, "messages must be a non-empty list")
    out = []
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SessionError(400, "every message needs a role")
        msg = {"role": m["role"], "content": _text(m.get("content"))}
        calls = m.get("tool_calls") or []
        if calls:
            _tool_calls(msg, calls, renderer)
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    if tools and not renderer.native_tools:
        desc = HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{desc}" if out[0]["content"] else desc}
        else:
            out.insert(0, {"role": "system", "content": desc})
    return out
