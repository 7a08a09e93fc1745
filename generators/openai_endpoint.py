"""The OpenAI-compatible endpoint's state and request handlers (docs/openai-endpoint.md; served by
generators/openai_server.py). Each handler returns ``(status, body, headers)`` or raises a
:class:`~generators.sessions.SessionError`.

It sees of its generator only :class:`EndpointContext`: the engine, the lock every use of the engine holds
(the generator's main loop, evaluation rounds, weight updates and these requests take turns, so a call's
weight version is the one that really sampled it), the version served, and where groups and rewards go."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from generators.chat_render import ChatRenderer
from generators.openai_answers import (
    Call,
    chat_logprobs,
    chat_logprobs_asked,
    completion_logprobs,
    completion_logprobs_asked,
)
from generators.openai_groups import checked_reward, posted_reward, score_session, session_group
from generators.openai_metrics import EndpointCounters, endpoint_metrics
from generators.openai_requests import (
    chat_messages,
    common_text_prefix,
    completion_prompt,
    request_ids,
    request_sampling,
)
from generators.sessions import Session, SessionError, Sessions
from generators.tool_calls import openai_tool_calls

if TYPE_CHECKING:
    from generators.backends.base import Backend
    from generators.config import OpenAIConfig, SamplingConfig

log = logging.getLogger("relay.generator.openai")


@dataclass
class EndpointContext:
    """What the endpoint uses of its generator (built by ``Generator``)."""

    cfg: OpenAIConfig  # the generator's ``openai`` section
    sampling: SamplingConfig  # the run's
    seed: int
    generator_id: str
    run_id: str
    backend: Backend
    engine_lock: threading.RLock  # held around every use of the engine
    served: Callable[[], tuple[int | None, str]]  # (version, hash) served now; version None before the first
    hash_for: Callable[[int], str] | None  # an in-process transport's announced hash of a version (None: none)
    count_tokens: Callable[[int], None]  # tokens sampled, added to the generator's count
    send_group: Callable  # the sink's ``send_group``: a group to the broker, its ack back
    score: Callable  # the reward service's ``score`` of reward items
    stop: threading.Event  # the generator stops: so does the endpoint
    emit: Callable[..., None]  # an event of the run (``emit_event`` bound to its Redis and keys)


class OpenAIEndpoint:
    """The endpoint's sessions and counters, and its request handlers."""

    def __init__(self, ctx: EndpointContext):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.sessions = Sessions(self.cfg.group_size, self.cfg.session_idle_s, self.cfg.max_sessions)
        self.max_tokens = self.cfg.max_tokens or ctx.sampling.max_tokens
        self.counters = EndpointCounters()
        self._calls = 0
        self._renderer: ChatRenderer | None = None
        self.port = 0
        self.server = None

    # -- the engine

    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            backend = self.ctx.backend
            tok = getattr(backend, "tokenizer", None)
            if tok is None:
                raise SessionError(501, f"the {backend.name} backend has no Hugging Face tokenizer here")
            if not getattr(tok, "chat_template", None):
                raise SessionError(
                    400,
                    "this model's tokenizer has no chat template, so /v1/chat/completions cannot "
                    "render messages: send the text to /v1/completions instead, or serve a model "
                    "whose tokenizer has a chat template",
                )
            self._renderer = ChatRenderer(tok)
        return self._renderer

    def loaded(self) -> None:
        """503 until the first version is loaded (the model, and its tokenizer, come with it)."""
        if self.ctx.served()[0] is None:
            raise SessionError(503, "no weights loaded yet: the generator is waiting for the first version")

    def generate(self, ids: list[int], sampling) -> tuple[Any, int, str]:
        """Sample one completion of ``ids`` under the engine lock: (completion, version, hash)."""
        ctx = self.ctx
        self.loaded()
        with ctx.engine_lock:
            version, whash = ctx.served()
            self._calls += 1
            seed = zlib.crc32(f"{ctx.seed}:{ctx.generator_id}:openai:{self._calls}".encode())
            c = ctx.backend.generate([ids], sampling, seed=seed)[0][0]
        ctx.count_tokens(len(c.token_ids))
        return c, version, whash

    def text_ids(self, text: str) -> list[int]:
        """Token ids of text inside a sequence (no BOS or other special tokens added)."""
        tok = getattr(self.ctx.backend, "tokenizer", None)
        if tok is None:
            return self.ctx.backend.encode(text)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens, such as the EOS sampled, by their names)."""
        tok = getattr(self.ctx.backend, "tokenizer", None)
        if tok is None:
            return [self.ctx.backend.decode([i]) for i in ids]
        return [tok.decode([i], skip_special_tokens=False) for i in ids]

    def _call(
        self, sid: str | None, group: str, messages: list[dict], context_of, sampling, text: bool = False
    ) -> Call:
        """One sampled call, recorded in session ``sid`` (None: untracked)."""
        if sid is None:
            ids, _ = context_of(None)
            c, version, _ = self.generate(ids, sampling)
            self.counters.untracked += 1
            return Call(c, None, version, len(ids))
        s = self.sessions.begin(sid, group)
        drifted = False
        try:
            context, drifted = context_of(s)
            fed = len(s.tokens) + len(context)
            c, version, whash = self.generate(s.tokens + context, sampling)
            if s.weight_version is None:
                s.weight_version, s.weight_hash = version, whash
            said = self.ctx.backend.decode(c.token_ids)
            answer = {"text": said} if text else {"role": "assistant", "content": said}
            s.record(context, c.token_ids, c.logprobs, version, c.finish_reason, messages, answer)
            self.counters.tokens["context"] += len(context)
            self.counters.tokens["sampled"] += len(c.token_ids)
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

    def _answer(self, kind: str, body: dict, choice: dict, call: Call, note: str):
        return (
            200,
            {
                "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
                "object": kind,
                "created": int(time.time()),
                "model": body.get("model") or self.cfg.model_name,
                "choices": [{"index": 0, **choice}],
                "usage": call.usage(),
                **call.relay(),
            },
            call.headers(note),
        )

    def chat(self, headers, body: dict):
        sampling, note = request_sampling(body, self.ctx.sampling, self.cfg, self.max_tokens)
        want_logprobs = chat_logprobs_asked(body)
        self.loaded()
        r = self.renderer()
        tools = body.get("tools") or None
        messages = chat_messages(body.get("messages"), tools, r)
        sid, group = request_ids(headers, body)

        def context_of(s: Session | None):
            render = lambda ms, agp: r.ids(ms, agp, tools)  # noqa: E731
            if s is None:
                return render(messages, True), False
            return s.context(messages, render, self.ctx.backend.eos_token_id)

        call = self._call(sid, group, messages, context_of, sampling)
        c = call.completion
        text = self.ctx.backend.decode(c.token_ids)
        content, calls = openai_tool_calls(text) if tools else (text, [])
        msg = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        logprobs = chat_logprobs(self.token_texts(c.token_ids), c.logprobs) if want_logprobs else None
        finish = "tool_calls" if calls else c.finish_reason
        return self._answer(
            "chat.completion", body, {"message": msg, "finish_reason": finish, "logprobs": logprobs}, call, note
        )

    def completions(self, headers, body: dict):
        sampling, note = request_sampling(body, self.ctx.sampling, self.cfg, self.max_tokens)
        want_logprobs = completion_logprobs_asked(body)
        self.loaded()
        prompt = completion_prompt(body)
        sid, group = request_ids(headers, body)

        def context_of(s: Session | None):
            if s is None or not s.tokens:
                return self.ctx.backend.encode(prompt), False
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
        text = self.ctx.backend.decode(c.token_ids)
        choice = {"text": text, "finish_reason": c.finish_reason, "logprobs": logprobs}
        return self._answer("text_completion", body, choice, call, note)

    def models(self):
        model = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "relay"}
        return 200, {"object": "list", "data": [model]}, {}

    def reward(self, sid: str, body: dict):
        """``{"reward": x}`` from the caller (trained as given, marked ``source: caller``; refused with
        ``reward_source = "reward_service"``), or ``{"task": ..., "reference": ...}``: the reward service
        scores the session's last answer with that task's plugin (the first user message as the prompt)."""
        value, details = posted_reward(body, self.cfg.reward_source), {"source": "caller"}
        if value is None and isinstance(body.get("task"), str) and body["task"]:
            s = self.sessions.by_id.get(sid)
            value, details = score_session(s, sid, body["task"], str(body.get("reference", "")), self.ctx.score)
        parts = self.sessions.reward(sid, checked_reward(value), details)
        source = details["source"].split(":", 1)[0]
        self.counters.rewarded[source] = self.counters.rewarded.get(source, 0) + 1
        if parts is None:
            return 200, {"session": sid, "group_complete": False}, {}
        g = session_group(parts, self.ctx, self.max_tokens)
        try:
            ack = self.ctx.send_group(g)
        except (TimeoutError, OSError) as e:
            self.counters.groups["failed"] += 1
            log.error("group %s of the OpenAI endpoint could not be sent: %s", g.group_id, e)
            raise SessionError(503, f"the group could not be sent to the broker: {e}") from e
        rejected = ack.status == "rejected"
        self.counters.groups["rejected" if rejected else "sent"] += 1
        out = {"session": sid, "group_complete": True, "group_id": g.group_id, "broker": ack.status}
        return 200, {**out, **({"reason": ack.reason} if rejected else {})}, {}

    def session_info(self, sid: str):
        s = self.sessions.by_id.get(sid)
        if s is None:
            raise SessionError(404, f"no session {sid!r}")
        info = {"session": sid, "group": s.group, "calls": s.calls, "tokens": len(s.tokens)}
        info.update(trainable_tokens=sum(s.trainable), template_drift=s.template_drift, reward=s.reward)
        return 200, info, {}

    # -- upkeep

    def reap(self) -> None:
        """Drop idle sessions (every few seconds, on its own thread) until the generator stops."""
        stop = self.ctx.stop
        while not stop.is_set():
            stop.wait(min(5.0, self.cfg.session_idle_s / 4))
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

    def collect(self):
        """The endpoint's metrics (yielded by the generator's /metrics: generators/metrics.py)."""
        return endpoint_metrics(self.counters, self.sessions)
