"""Sessions of the OpenAI-compatible endpoint (generators/openai_server.py): the token-in-token-out
trajectory of one external agent episode, and the groups its sessions form. Pure logic: no model, no
HTTP (unit-tested with a fake tokenizer).

A session keeps the exact token sequence the model saw and produced across its calls, never text:

* each call renders the request's messages through the chat template (``render(messages, True)``);
* the first call's rendering is the prompt (context);
* a later call whose rendering *extends* the session's tokens (they are its prefix) appends the tokens
  after them as context: the tool's output, the harness's next message, the template's turn markers;
* a rendering that does not extend them is **template drift** (the template rewrote an earlier turn,
  or the sampled text tokenises otherwise when rendered again): it is counted, on the session and in
  the sample's details, and the session's tokens stay the truth (what was sampled is never replaced
  by a re-tokenisation). The new context is then the rendering of the messages the session does not
  hold yet: the tokens of ``render(messages, True)`` after ``P = render(held messages, False)`` (after
  their common prefix when the rendering does not start with ``P``), preceded by the template's
  end-of-turn tokens that follow the model's EOS in ``P`` (``<|im_end|>`` is the model's, the ``\\n``
  after it the template's);
* the sampled tokens are appended as trainable (1) with their behaviour log-probs and the weight
  version that sampled them; context tokens are trainable 0 with log-prob 0.0.

Sessions of one group (the harness's group id) are compared with each other (GRPO-style advantages):
when ``group_size`` of them have a reward the group is complete (:meth:`Sessions.reward`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

# render(messages, add_generation_prompt) -> token ids, through the chat template (tools bound by the caller)
Render = Callable[[list[dict], bool], list[int]]


class SessionError(Exception):
    """A request the session rules refuse; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Session:
    id: str
    group: str
    tokens: list[int] = field(default_factory=list)  # everything the model saw and sampled, in order
    trainable: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: context
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob (0.0 on context)
    versions: list[int] = field(default_factory=list)  # weight version of each token's call
    prompt_len: int = 0  # the first call's prompt tokens
    held: int = 0  # messages the tokens hold: the last request's messages and the answer to it
    held_messages: list[dict] = field(default_factory=list)
    template_drift: int = 0  # calls whose rendering did not extend the session's tokens
    calls: int = 0
    weight_version: int | None = None  # the version (and hash) of the first call
    weight_hash: str = ""
    finish_reason: str = "stop"  # of the last call
    reward: float | None = None
    reward_details: dict = field(default_factory=dict)  # where the reward came from (kept with the sample)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a call is being served (one at a time per session)

    def context(self, messages: list[dict], render: Render, eos: int) -> tuple[list[int], bool]:
        """The context tokens to append before this call samples, and whether the rendering drifted
        (counted here). ``messages`` are the request's, normalised (openai_requests.chat_messages)."""
        rendered = render(messages, True)
        if not self.tokens:
            return rendered, False
        if rendered[: len(self.tokens)] == self.tokens:
            return rendered[len(self.tokens) :], False
        self.template_drift += 1
        held = render(messages[: self.held], False) if 0 < self.held <= len(messages) else []
        start = len(held) if rendered[: len(held)] == held else common_prefix(rendered, held)
        # the template's end of the last assistant turn: what follows the model's EOS in its rendering
        last_eos = max((i for i, t in enumerate(held) if t == eos), default=None)
        if last_eos is None:
            bridge = []
        elif self.tokens[-1] == eos:
            bridge = held[last_eos + 1 : start]
        else:  # the model stopped on max_tokens: the template closes the turn
            bridge = held[last_eos:start]
        return bridge + rendered[start:], True

    def record(
        self,
        context: list[int],
        sampled: list[int],
        logprobs: list[float],
        version: int,
        finish_reason: str,
        messages: list[dict],
        answer: dict,
    ) -> None:
        """Append one call: its context (trainable 0) and what it sampled (trainable 1)."""
        if not self.tokens:
            self.prompt_len = len(context)
        self.tokens += context + sampled
        self.trainable += [0] * len(context) + [1] * len(sampled)
        self.logprobs += [0.0] * len(context) + [float(x) for x in logprobs]
        self.versions += [version] * (len(context) + len(sampled))
        self.finish_reason = finish_reason
        self.held_messages = list(messages) + [answer]
        self.held = len(self.held_messages)
        self.calls += 1
        self.last_used = time.monotonic()


@dataclass
class GroupParts:
    """A complete group's sessions, turned into one prompt and a completion per session."""

    group: str
    prompt_ids: list[int]
    sessions: list[Session]

    def completion(self, s: Session) -> tuple[list[int], list[int], list[float], list[int]]:
        """(completion ids, trainable, logprobs, versions) of session ``s`` after the group's prompt."""
        P = len(self.prompt_ids)
        return s.tokens[P:], s.trainable[P:], s.logprobs[P:], s.versions[P:]


def group_parts(group: str, sessions: list[Session]) -> GroupParts:
    """The group's prompt is its sessions' common first-call prompt: the first call's prompt tokens when
    they all began alike, else their longest common prefix (the rest of each one's prompt is context in
    its completion). ``SessionError`` when they share no token or a session sampled nothing."""
    prompt = sessions[0].tokens[: sessions[0].prompt_len]
    for s in sessions[1:]:
        prompt = prompt[: common_prefix(prompt, s.tokens[: s.prompt_len])]
    if not prompt:
        raise SessionError(409, f"the sessions of group {group!r} share no prompt token")
    for s in sessions:
        if not any(s.trainable[len(prompt) :]):
            raise SessionError(409, f"session {s.id!r} of group {group!r} sampled nothing")
    return GroupParts(group, prompt, sessions)


class Sessions:
    """The endpoint's sessions and groups, thread-safe. Counters (shown in /metrics): sessions started,
    dropped idle, template drift, groups completed, groups unusable (no common prompt token, or a session
    that sampled nothing: refused 409 to the reward that completed them, and dropped)."""

    def __init__(self, group_size: int, idle_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic):
        self.group_size, self.idle_s, self.max_sessions, self.clock = group_size, idle_s, max_sessions, clock
        self.lock = threading.Lock()
        self.by_id: dict[str, Session] = {}
        self.groups: dict[str, list[str]] = {}  # group id -> its session ids, in order of arrival
        self.started = self.dropped_idle = self.template_drift = self.groups_completed = self.groups_unusable = 0
        self._auto = 0  # the automatic group being filled (sessions that name no group)

    def begin(self, sid: str, group: str | None) -> Session:
        """The session ``sid`` (new: joins ``group``; None: the automatic group being filled, ``auto-<k>``),
        marked busy for one call."""
        with self.lock:
            s = self.by_id.get(sid)
            if s is not None and group is None:
                group = s.group
            if s is None and group is None:
                if len(self.groups.get(f"auto-{self._auto}", [])) >= self.group_size:
                    self._auto += 1
                group = f"auto-{self._auto}"
            if s is None:
                members = self.groups.setdefault(group, [])
                if len(members) >= self.group_size:
                    raise SessionError(
                        409,
                        f"group {group!r} already has its {self.group_size} sessions "
                        f"(openai.group_size); use another X-Relay-Group",
                    )
                if len(self.by_id) >= self.max_sessions:
                    raise SessionError(
                        429, f"{len(self.by_id)} sessions held (openai.max_sessions); finish some with a reward first"
                    )
                s = self.by_id[sid] = Session(sid, group, created=self.clock(), last_used=self.clock())
                members.append(sid)
                self.started += 1
            elif s.group != group:
                raise SessionError(409, f"session {sid!r} belongs to group {s.group!r}, not {group!r}")
            if s.reward is not None:
                raise SessionError(409, f"session {sid!r} already has its reward: start a new session")
            if s.busy:
                raise SessionError(409, f"session {sid!r} has a call in progress (one at a time per session)")
            s.busy = True
            return s

    def end(self, s: Session, drifted: bool) -> None:
        with self.lock:
            s.busy = False
            s.last_used = self.clock()
            self.template_drift += int(drifted)

    def reward(self, sid: str, value: float, details: dict | None = None) -> GroupParts | None:
        """Record a session's reward; the group's parts when this completes it (its sessions are then
        forgotten), else None."""
        with self.lock:
            s = self.by_id.get(sid)
            if s is None:
                raise SessionError(404, f"no session {sid!r} (never started, already sent, or dropped idle)")
            if s.busy:
                raise SessionError(409, f"session {sid!r} has a call in progress")
            if not s.calls:
                raise SessionError(409, f"session {sid!r} sampled nothing yet")
            if s.reward is not None:
                raise SessionError(409, f"session {sid!r} already has its reward")
            s.reward = float(value)
            s.reward_details = dict(details or {"source": "caller"})
            s.last_used = self.clock()
            members = [self.by_id[m] for m in self.groups.get(s.group, [])]
            if len(members) < self.group_size or any(m.reward is None for m in members):
                return None
            for m in members:  # complete, or unusable: its sessions are done either way
                del self.by_id[m.id]
            del self.groups[s.group]
            try:
                parts = group_parts(s.group, members)
            except SessionError:
                self.groups_unusable += 1
                raise
            self.groups_completed += 1
            return parts

    def drop_idle(self) -> list[Session]:
        """Drop sessions unused for ``idle_s`` (a group that lost one can never complete: its other
        sessions go too); returns what was dropped, counted."""
        now = self.clock()
        with self.lock:
            stale = {s.group for s in self.by_id.values() if not s.busy and now - s.last_used > self.idle_s}
            out = []
            for g in stale:
                for sid in self.groups.pop(g, []):
                    s = self.by_id.pop(sid, None)
                    if s is not None:
                        out.append(s)
            self.dropped_idle += len(out)
            return out
