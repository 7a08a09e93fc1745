"""The generator's OpenAI-compatible endpoint (docs/openai-endpoint.md): an external agent harness, any
program using the ``openai`` client, samples from this generator's model; every call of a session is
recorded token-in-token-out (generators/sessions.py), and once the sessions of a group have their rewards
the group goes to the broker through the sink like any other group.

Served (non-streaming): ``GET /v1/models``, ``POST /v1/chat/completions`` (messages, tools: rendered by
the tokenizer's chat template; Hermes-style ``<tool_call>{json}</tool_call>`` in the sampled text comes
back as ``tool_calls``), ``POST /v1/completions`` and ``POST /v1/relay/sessions/{id}/reward``.

Access: every request needs ``Authorization: Bearer <openai.api_key>`` (401 without it, before anything is
read or sampled) unless ``openai.open``; every POST must be ``Content-Type: application/json`` (415
otherwise: a web page can post ``text/plain`` cross-site without a preflight, never JSON); no CORS header is
ever sent. A reward the caller posts is trained as given and marked ``source: caller`` in the sample's
reward details; ``openai.reward_source = "reward_service"`` refuses posted numbers (403).

Each response names the weight version that sampled it (``relay.weight_version``, ``X-Relay-Weight-Version``)
and, on request (``logprobs``), the behaviour log-prob of each sampled token: the very number trained.

Sampling: the learner recomputes the behaviour log-probs with one sampling transform per run, so a
request may not change temperature, top_p or top_k: a different value is refused (400) or, with
``openai.sampling_mismatch = "override"``, replaced by the generator's (said in ``X-Relay-Sampling``).
``max_tokens`` is honoured up to ``openai.max_tokens``.

Concurrency: the engine is not thread-safe. :func:`serialize_engine` puts one re-entrant lock around
the backend's ``generate`` and the weight applier's ``update`` (instance attributes on the generator's
own objects: the main loop's batches, evaluation rounds, weight updates and these requests take turns),
so a call's weight version is the one that really sampled it.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request  # module level: the routes' annotations are resolved from here
from fastapi.responses import JSONResponse
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool

from broker.client.telemetry import emit_event
from broker.protocol.group import Group, Sample, versions_to_runs
from broker.protocol.messages import ItemIn
from generators.openai_answers import (
    Call,
    chat_logprobs,
    chat_logprobs_asked,
    completion_logprobs,
    completion_logprobs_asked,
    is_json,
)
from generators.sessions import Session, SessionError, Sessions

if TYPE_CHECKING:
    from generators.service import Generator

log = logging.getLogger("relay.generator.openai")

SESSION_HEADER, GROUP_HEADER = "x-relay-session", "x-relay-group"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


# -- the engine lock ----------------------------------------------------------------------------


def serialize_engine(gen: Generator) -> threading.RLock:
    """One lock around every use of the engine: ``gen.backend.generate`` and ``gen.weights.update``
    (which loads new weights into the engine and then sets the version served). Re-entrant: the
    "continue" in-flight policy updates weights from inside ``generate``. Installed as instance
    attributes, so every caller (the main loop, evaluation, this endpoint) goes through it."""
    lock = threading.RLock()
    for obj, name in ((gen.backend, "generate"), (gen.weights, "update")):
        inner = getattr(obj, name)

        def locked(*a, _inner=inner, **kw):
            with lock:
                return _inner(*a, **kw)

        setattr(obj, name, locked)
    return lock


# -- messages, tools and the chat template ------------------------------------------------------


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI content parts ([{type: text, text}])."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise SessionError(400, f"message content must be a string or text parts, got {type(content).__name__}")


def tool_call_text(name: str, arguments: Any) -> str:
    """A tool call as the Hermes format writes it (what the model is asked to emit)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _arguments(call: dict) -> Any:
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


class ChatRenderer:
    """Renders OpenAI chat messages (and tools) with a Hugging Face tokenizer's chat template.

    A template that knows ``tools`` / ``tool_calls`` renders them itself (tool-call arguments given to it as
    objects, as Hugging Face templates expect). One that does not (SmolLM2's) gets the Hermes convention:
    the tools described in the system message, an assistant's tool calls written as ``<tool_call>`` blocks
    after its text: the same text the model is asked to emit, so a session stays an extension."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        template = tokenizer.chat_template or ""
        if not template:
            raise RuntimeError(
                "the served tokenizer has no chat template: /v1/chat/completions needs one "
                "(/v1/completions works without)"
            )
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template

    def messages(self, raw: list[dict], tools: list[dict] | None) -> list[dict]:
        if not isinstance(raw, list) or not raw:
            raise SessionError(400, "messages must be a non-empty list")
        out = []
        for m in raw:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise SessionError(400, "every message needs a role")
            msg = {"role": m["role"], "content": _text(m.get("content"))}
            calls = m.get("tool_calls") or []
            if calls:
                if self.native_tool_calls:
                    msg["tool_calls"] = [
                        {
                            "type": "function",
                            "id": c.get("id", ""),
                            "function": {"name": (c.get("function") or {}).get("name", ""), "arguments": _arguments(c)},
                        }
                        for c in calls
                    ]
                else:
                    blocks = "\n".join(
                        tool_call_text((c.get("function") or {}).get("name", ""), _arguments(c)) for c in calls
                    )
                    msg["content"] = f"{msg['content']}\n{blocks}" if msg["content"] else blocks
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    msg[k] = m[k]
            out.append(msg)
        if tools and not self.native_tools:
            desc = HERMES_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{desc}" if out[0]["content"] else desc}
            else:
                out.insert(0, {"role": "system", "content": desc})
        return out

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        kw = {"tools": tools} if tools and self.native_tools else {}
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def common_text_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of sampled text: each ``<tool_call>{"name", "arguments"}</tool_call>`` whose
    JSON parses becomes an OpenAI tool call; the text outside them is the content (None when empty). A
    block that does not parse stays in the content, so the harness sees what the model wrote."""
    calls, spans = [], []
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args)},
            }
        )
        spans.append(m.span())
    content = text
    for a, b in reversed(spans):
        content = content[:a] + content[b:]
    content = content.strip()
    return (content or None) if calls else text, calls


# -- the endpoint ---------------------------------------------------------------------------------


class OpenAIEndpoint:
    """The endpoint's state (sessions, counters) and its request handlers; served by :func:`start`."""

    def __init__(self, gen: Generator, lock: threading.RLock):
        self.gen, self.cfg, self.lock = gen, gen.cfg.openai, lock
        self.sessions = Sessions(self.cfg.group_size, self.cfg.session_idle_s, self.cfg.max_sessions)
        self.max_tokens = self.cfg.max_tokens or gen.cfg.sampling.max_tokens
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, outcome) -> count
        self.groups = {"sent": 0, "rejected": 0, "failed": 0}
        self.rewarded = {"caller": 0, "reward_service": 0}  # sessions' rewards by where they came from
        self.tokens = {"context": 0, "sampled": 0}
        self.untracked = 0  # calls without a session id: answered, not trained
        self._calls = 0
        self._renderer: ChatRenderer | None = None
        self.port = 0
        self.server = None

    # -- helpers

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            tok = getattr(self.gen.backend, "tokenizer", None)
            if tok is None:
                raise SessionError(501, f"the {self.gen.backend.name} backend has no Hugging Face tokenizer here")
            if not getattr(tok, "chat_template", None):
                raise SessionError(
                    400,
                    "this model's tokenizer has no chat template, so /v1/chat/completions cannot "
                    "render messages: send the text to /v1/completions instead, or serve a model "
                    "whose tokenizer has a chat template",
                )
            self._renderer = ChatRenderer(tok)
        return self._renderer

    def sampling(self, body: dict) -> tuple[Any, str]:
        """The generator's sampling for this call (n=1, max_tokens clamped), and the X-Relay-Sampling note."""
        s = self.gen.cfg.sampling
        asked = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
        bad = [k for k, v in asked.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise SessionError(400, f"{', '.join(bad)} must be numbers")
        differ = {k: v for k, v in asked.items() if abs(float(v) - float(getattr(s, k))) > 1e-6}
        note = "as-run"
        if differ:
            run = {k: getattr(s, k) for k in differ}
            if self.cfg.sampling_mismatch == "refuse":
                raise SessionError(
                    400,
                    f"sampling {differ} differs from this run's {run}: the learner trains one "
                    "sampling transform per run; send the run's values or none "
                    "(openai.sampling_mismatch = 'override' replaces them)",
                )
            note = "overridden: " + ", ".join(f"{k}={getattr(s, k)}" for k in differ)
        if body.get("n", 1) != 1:
            raise SessionError(400, "n must be 1: each call is one step of one session")
        if body.get("stream"):
            raise SessionError(400, "streaming is not supported by this endpoint (send stream=false)")
        mt = body.get("max_completion_tokens") or body.get("max_tokens") or self.max_tokens
        if not isinstance(mt, int) or mt < 1:
            raise SessionError(400, f"max_tokens must be a positive integer, got {mt!r}")
        return s.model_copy(update={"n": 1, "max_tokens": min(mt, self.max_tokens)}), note

    @staticmethod
    def ids(headers, body: dict) -> tuple[str | None, str | None]:
        """(session id, group id) of a request: X-Relay-Session or the ``user`` field; X-Relay-Group (None:
        an automatic group)."""
        sid = headers.get(SESSION_HEADER) or body.get("user") or None
        return (str(sid) if sid is not None else None), (headers.get(GROUP_HEADER) or None)

    def loaded(self) -> None:
        """503 until the first version is loaded (the model, and its tokenizer, come with it)."""
        if self.gen.weights.version is None:
            raise SessionError(503, "no weights loaded yet: the generator is waiting for the first version")

    def generate(self, ids: list[int], sampling) -> tuple[Any, int, str]:
        """Sample one completion of ``ids`` under the engine lock: (completion, version, hash)."""
        w = self.gen.weights
        self.loaded()
        with self.lock:
            version, whash = w.version, w.hash
            self._calls += 1
            seed = zlib.crc32(f"{self.gen.cfg.seed}:{self.gen.cfg.id}:openai:{self._calls}".encode())
            c = self.gen.backend.generate([ids], sampling, seed=seed)[0][0]
        self.gen.tokens += len(c.token_ids)
        return c, version, whash

    def text_ids(self, text: str) -> list[int]:
        """Token ids of text inside a sequence (no BOS or other special tokens added)."""
        tok = getattr(self.gen.backend, "tokenizer", None)
        if tok is None:
            return self.gen.backend.encode(text)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _call(
        self, sid: str | None, group: str, messages: list[dict], context_of, sampling, text: bool = False
    ) -> Call:
        """One sampled call, recorded in session ``sid`` (None: untracked)."""
        if sid is None:
            ids, _ = context_of(None)
            c, version, _ = self.generate(ids, sampling)
            self.untracked += 1
            return Call(c, None, version, len(ids))
        s = self.sessions.begin(sid, group)
        drifted = False
        try:
            context, drifted = context_of(s)
            fed = len(s.tokens) + len(context)
            c, version, whash = self.generate(s.tokens + context, sampling)
            if s.weight_version is None:
                s.weight_version, s.weight_hash = version, whash
            said = self.gen.backend.decode(c.token_ids)
            answer = {"text": said} if text else {"role": "assistant", "content": said}
            s.record(context, c.token_ids, c.logprobs, version, c.finish_reason, messages, answer)
            self.tokens["context"] += len(context)
            self.tokens["sampled"] += len(c.token_ids)
            if drifted:
                log.warning(
                    "template drift in session %s (call %d): the chat template's rendering does not extend "
                    "the tokens sampled so far; they stay the truth (docs/openai-endpoint.md)",
                    sid,
                    s.calls,
                )
        finally:
            self.sessions.end(s, drifted)
        return Call(c, s, version, fed)

    # -- handlers (each returns (status, body, headers))

    def chat(self, headers, body: dict):
        sampling, note = self.sampling(body)
        want_logprobs = chat_logprobs_asked(body)
        self.loaded()
        r = self.renderer()
        tools = body.get("tools") or None
        messages = r.messages(body.get("messages"), tools)
        sid, group = self.ids(headers, body)

        def context_of(s: Session | None):
            render = lambda ms, agp: r.render(ms, tools, agp)  # noqa: E731
            if s is None:
                return render(messages, True), False
            return s.context(messages, render, self.gen.backend.eos_token_id)

        call = self._call(sid, group, messages, context_of, sampling)
        c = call.completion
        text = self.gen.backend.decode(c.token_ids)
        content, calls = parse_tool_calls(text) if tools else (text, [])
        finish = "tool_calls" if calls else c.finish_reason
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        logprobs = chat_logprobs(self.token_texts(c.token_ids), c.logprobs) if want_logprobs else None
        return (
            200,
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.cfg.model_name,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs}],
                "usage": call.usage(),
                **call.relay(),
            },
            call.headers(note),
        )

    def completions(self, headers, body: dict):
        sampling, note = self.sampling(body)
        want_logprobs = completion_logprobs_asked(body)
        self.loaded()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise SessionError(400, "prompt must be one non-empty string")
        sid, group = self.ids(headers, body)

        def context_of(s: Session | None):
            if s is None or not s.tokens:
                return self.gen.backend.encode(prompt), False
            # the session's text so far: its prompts and the completions returned; the new text after it is
            # the new context (the tokens held stay the truth); a prompt that does not start with it drifted
            held = "".join(m["text"] for m in s.held_messages)
            k = len(held) if prompt.startswith(held) else common_text_prefix(prompt, held)
            if k < len(held):
                s.template_drift += 1
            return self.text_ids(prompt[k:]), k < len(held)

        call = self._call(sid, group, [{"text": prompt}], context_of, sampling, text=True)
        c = call.completion
        logprobs = completion_logprobs(prompt, self.token_texts(c.token_ids), c.logprobs) if want_logprobs else None
        return (
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.cfg.model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": self.gen.backend.decode(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "logprobs": logprobs,
                    }
                ],
                "usage": call.usage(),
                **call.relay(),
            },
            call.headers(note),
        )

    def models(self):
        return (
            200,
            {
                "object": "list",
                "data": [{"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "relay"}],
            },
            {},
        )

    def reward(self, sid: str, body: dict):
        """``{"reward": x}`` from the caller (trained as given, marked ``source: caller``; refused with
        ``reward_source = "reward_service"``), or ``{"task": ..., "reference": ...}``: the reward service
        scores the session's last answer with that task's plugin (the first user message as the prompt)."""
        value, details = body.get("reward"), {"source": "caller"}
        if value is not None and self.cfg.reward_source == "reward_service":
            raise SessionError(
                403,
                "this endpoint takes rewards from the reward service only (openai.reward_source "
                '= "reward_service"): post {"task": <reward plugin>, "reference": <answer>}',
            )
        if value is None and isinstance(body.get("task"), str) and body["task"]:
            value, details = self.score(sid, body["task"], str(body.get("reference", "")))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise SessionError(
                400, 'the body must be {"reward": <finite number>} or {"task": <reward plugin>, "reference": <answer>}'
            )
        parts = self.sessions.reward(sid, float(value), details)
        source = details["source"].split(":", 1)[0]
        self.rewarded[source] = self.rewarded.get(source, 0) + 1
        if parts is None:
            return 200, {"session": sid, "group_complete": False}, {}
        g = self.group(parts)
        try:
            ack = self.gen.sink.send_group(g)
        except (TimeoutError, OSError) as e:
            self.groups["failed"] += 1
            log.error("group %s of the OpenAI endpoint could not be sent: %s", g.group_id, e)
            raise SessionError(503, f"the group could not be sent to the broker: {e}") from e
        outcome = "rejected" if ack.status == "rejected" else "sent"
        self.groups[outcome] += 1
        return (
            200,
            {
                "session": sid,
                "group_complete": True,
                "group_id": g.group_id,
                "broker": ack.status,
                **({"reason": ack.reason} if ack.status == "rejected" else {}),
            },
            {},
        )

    def score(self, sid: str, task: str, reference: str) -> tuple[float, dict]:
        """The reward service's score of session ``sid``'s last answer (502 when it could not score it)."""
        s = self.sessions.by_id.get(sid)
        if s is None or not s.calls:
            raise SessionError(404, f"no session {sid!r} with an answer to score")
        held = s.held_messages
        prompt = next((m.get("content", "") for m in held if m.get("role") == "user"), held[0].get("text", ""))
        answer = held[-1].get("content", held[-1].get("text", ""))
        r = self.gen.rewards.score(
            [
                ItemIn(
                    prompt=prompt, completion=answer, reference=reference, finished=s.finish_reason == "stop", task=task
                )
            ]
        )[0]
        if not r.ok:
            raise SessionError(502, f"the reward service could not score session {sid!r}: {r.reason}")
        return float(r.score), {**r.details, "source": f"reward_service:{r.plugin or task}"}  # a plugin's own
        # "source" sub-score never hides where the reward came from

    def session_info(self, sid: str):
        s = self.sessions.by_id.get(sid)
        if s is None:
            raise SessionError(404, f"no session {sid!r}")
        return (
            200,
            {
                "session": sid,
                "group": s.group,
                "calls": s.calls,
                "tokens": len(s.tokens),
                "trainable_tokens": sum(s.trainable),
                "template_drift": s.template_drift,
                "reward": s.reward,
            },
            {},
        )

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens, such as the EOS sampled, by their names)."""
        tok = getattr(self.gen.backend, "tokenizer", None)
        if tok is None:
            return [self.gen.backend.decode([i]) for i in ids]
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    # -- groups

    def group(self, parts) -> Group:
        """The wire group of a complete set of sessions (docs/openai-endpoint.md, "What is trained")."""
        gen, samples = self.gen, []
        first = min(parts.sessions, key=lambda s: s.weight_version)
        for s in parts.sessions:
            ids, trainable, lps, versions = parts.completion(s)
            samples.append(
                Sample(
                    completion_ids=np.asarray(ids, dtype=np.int32),
                    logprobs=np.asarray(lps, dtype=np.float32),
                    version_runs=versions_to_runs(versions),
                    finish_reason=s.finish_reason,
                    reward=s.reward,
                    reward_status="ok",
                    trainable=np.asarray(trainable, dtype=np.uint8),
                    reward_details={
                        **s.reward_details,
                        "session": s.id,
                        "calls": s.calls,
                        "template_drift": s.template_drift,
                    },
                )
            )
        whash = first.weight_hash or (
            gen.weights.hash_for(first.weight_version) if gen.weights.receiver is not None else ""
        )
        now = time.time()
        return Group(
            group_id=Group.new_id(),
            run_id=gen.cfg.run_id,
            prompt_id=f"openai:{parts.group}",
            prompt_ids=np.asarray(parts.prompt_ids, dtype=np.int32),
            samples=samples,
            generator_id=gen.cfg.id,
            weight_version=first.weight_version,
            weight_hash=whash,
            sampling={**gen.cfg.sampling.model_dump(), "n": len(samples), "max_tokens": self.max_tokens},
            task="openai",
            created_at=min(s.created for s in parts.sessions) - time.monotonic() + now,
            scored_at=now,
            sent_at=now,
        )

    def reap(self) -> None:
        """Drop idle sessions (every few seconds, on its own thread) until the generator stops."""
        while not self.gen.stop.is_set():
            self.gen.stop.wait(min(5.0, self.cfg.session_idle_s / 4))
            dropped = self.sessions.drop_idle()
            if dropped:
                log.warning(
                    "dropped %d idle session(s) (openai.session_idle_s = %.0f): %s",
                    len(dropped),
                    self.cfg.session_idle_s,
                    ", ".join(s.id for s in dropped[:5]),
                )
        if self.server is not None:  # the generator stops: so does the endpoint
            self.server.should_exit = True

    # -- metrics (yielded by the generator's /metrics: generators/metrics.py)

    def collect(self):
        req = CounterMetricFamily(
            "relay_generator_openai_requests",
            "requests to the OpenAI-compatible endpoint",
            labels=["endpoint", "outcome"],
        )
        for (ep, outcome), n in sorted(self.requests.items()):
            req.add_metric([ep, outcome], n)
        yield req
        ss = self.sessions
        sess = CounterMetricFamily(
            "relay_generator_openai_sessions", "endpoint sessions started, and dropped idle", labels=["outcome"]
        )
        sess.add_metric(["started"], ss.started)
        sess.add_metric(["dropped_idle"], ss.dropped_idle)
        yield sess
        yield GaugeMetricFamily(
            "relay_generator_openai_open_sessions", "endpoint sessions held now", value=len(ss.by_id)
        )
        yield CounterMetricFamily(
            "relay_generator_openai_template_drift",
            "endpoint calls whose chat-template rendering did not extend the session's sampled tokens",
            value=ss.template_drift,
        )
        grp = CounterMetricFamily("relay_generator_openai_groups", "endpoint groups by outcome", labels=["outcome"])
        for k, n in {**self.groups, "unusable": ss.groups_unusable}.items():
            grp.add_metric([k], n)
        yield grp
        rew = CounterMetricFamily(
            "relay_generator_openai_rewards",
            "sessions' rewards by where they came from (caller: a number the caller posted; reward_service)",
            labels=["source"],
        )
        for k, n in self.rewarded.items():
            rew.add_metric([k], n)
        yield rew
        tok = CounterMetricFamily("relay_generator_openai_tokens", "endpoint tokens recorded, by kind", labels=["kind"])
        for k, n in self.tokens.items():
            tok.add_metric([k], n)
        yield tok


# -- the HTTP server --------------------------------------------------------------------------------


def create_app(ep: OpenAIEndpoint) -> FastAPI:
    """The routes. No CORS middleware: a browser on another origin gets no ``Access-Control-Allow-*`` header,
    so it can neither read an answer nor send the preflight a JSON POST needs."""
    app = FastAPI(title="Relay generator: OpenAI-compatible endpoint", docs_url=None, redoc_url=None)
    key, open_ = ep.cfg.api_key.encode(), ep.cfg.open

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error" if status < 500 else "server_error",
                    "code": status,
                }
            },
            status_code=status,
        )

    def authorized(request: Request) -> bool:
        if open_:
            return True
        auth = request.headers.get("authorization", "")  # an empty key matches nothing (fail closed)
        return bool(key) and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), key)

    async def handle(request: Request, name: str, fn, *args, body: bool = True):
        if not authorized(request):
            ep.count(name, "unauthorized")
            return error(
                401,
                "a valid 'Authorization: Bearer <openai.api_key>' is required (relay up keeps the "
                "run's key in runs/<id>/secrets/openai.key)",
            )
        data = None
        if body:
            ctype = request.headers.get("content-type", "")
            if not is_json(ctype):
                ep.count(name, "unsupported_media_type")
                return error(
                    415,
                    f"the body must be JSON sent with 'Content-Type: application/json', got "
                    f"{ctype[:100]!r}: other types are refused (a web page can post them from any site)",
                )
            try:
                data = await request.json()
            except ValueError:
                ep.count(name, "bad_request")
                return error(400, "the body must be JSON")
            if not isinstance(data, dict):
                ep.count(name, "bad_request")
                return error(400, "the body must be a JSON object")
        try:  # sampling blocks: off the event loop
            status, out, headers = await run_in_threadpool(fn, *args, *([request.headers, data] if body else []))
        except SessionError as e:
            ep.count(name, f"error_{e.status}")
            return error(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - an engine or template failure: logged, counted, answered 500
            log.exception("%s request failed", name)
            ep.count(name, "error_500")
            return error(500, f"{type(e).__name__}: {e}"[:500])
        ep.count(name, "ok")
        return JSONResponse(out, status_code=status, headers=headers)

    @app.get("/v1/models")
    async def models(request: Request):
        return await handle(request, "models", ep.models, body=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat", ep.chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions", ep.completions)

    @app.post("/v1/relay/sessions/{sid}/reward")
    async def reward(sid: str, request: Request):
        return await handle(request, "reward", lambda _headers, data: ep.reward(sid, data))

    @app.get("/v1/relay/sessions/{sid}")
    async def info(sid: str, request: Request):
        return await handle(request, "session", lambda: ep.session_info(sid), body=False)

    return app


def start(gen: Generator) -> OpenAIEndpoint:
    """Serve the endpoint on its own thread (``cfg.openai.host:port``; port 0 picks one): the engine lock,
    the idle-session reaper, and an ``openai_endpoint`` event with the URL."""
    import uvicorn

    cfg = gen.cfg.openai
    ep = OpenAIEndpoint(gen, serialize_engine(gen))
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as e:
        raise OSError(
            f"cannot serve the OpenAI endpoint on {cfg.host}:{cfg.port}: {e.strerror} (set openai.port; "
            "0 picks a free one)"
        ) from None
    ep.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(ep), log_level="warning", access_log=False, log_config=None))
    ep.server = server
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openai-http", daemon=True).start()
    threading.Thread(target=ep.reap, name="openai-reaper", daemon=True).start()
    url = f"http://{cfg.host}:{ep.port}/v1"
    log.info(
        "OpenAI-compatible endpoint on %s (sessions of %d per group; %s; rewards from %s)",
        url,
        cfg.group_size,
        "open: no key" if cfg.open else "Authorization: Bearer <openai.api_key>",
        cfg.reward_source,
    )
    if cfg.open:
        log.warning(
            "the OpenAI endpoint on %s is OPEN (openai.open = true): anyone who reaches this port samples from "
            "the model and trains it with the rewards they post; give it a key (RELAY_OPENAI__API_KEY) "
            "unless this machine is yours alone",
            url,
        )
    emit_event(
        gen.r,
        gen.keys,
        "openai_endpoint",
        generator=gen.cfg.id,
        url=url,
        auth="none" if cfg.open else "bearer",
        reward_source=cfg.reward_source,
    )
    return ep
