"""What an answer of the OpenAI-compatible endpoint says beyond the sampled text (docs/openai-endpoint.md):
the weight version that sampled it, ``usage``, Relay's ``relay`` extension and headers, and the sampled
tokens' behaviour log-probs when asked; and which requests' bodies the endpoint reads at all (JSON only)."""

from __future__ import annotations

from dataclasses import dataclass

from generators.backends.base import Completion
from generators.sessions import Session, SessionError


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header names JSON (``application/json``, parameters such as a charset allowed)."""
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


NO_TOP_LOGPROBS = (
    "the generator records only the sampled token's log-prob (the behaviour log-prob the learner "
    "trains with), not the alternatives"
)


def chat_logprobs_asked(body: dict) -> bool:
    """Whether a chat request asks for its tokens' log-probs (``logprobs: true``); ``top_logprobs`` above 0
    is refused (400), never answered with less than was asked."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise SessionError(400, f"logprobs must be true or false, got {want!r}")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise SessionError(400, f"top_logprobs must be a non-negative integer, got {top!r}")
        if top > 0:
            raise SessionError(
                400,
                f"top_logprobs = {top} is not available: {NO_TOP_LOGPROBS}; send "
                "logprobs = true with top_logprobs 0 or none",
            )
    return bool(want)


def completion_logprobs_asked(body: dict) -> bool:
    """Whether a completions request asks for its tokens' log-probs (``logprobs: 0``); more than 0
    alternatives is refused (400)."""
    n = body.get("logprobs")
    if n is None:
        return False
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise SessionError(400, f"logprobs must be a non-negative integer (the alternatives per token), got {n!r}")
    if n > 0:
        raise SessionError(400, f"logprobs = {n} is not available: {NO_TOP_LOGPROBS}; send logprobs = 0")
    return True


@dataclass
class Call:
    """One sampled call: its completion, its session (None: untracked), the weight version that sampled it
    and the tokens the model was fed (the session's tokens and the new context, or the whole prompt)."""

    completion: Completion
    session: Session | None
    version: int
    prompt_tokens: int

    def usage(self) -> dict:
        n = len(self.completion.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def relay(self) -> dict:
        """Relay's extension of a response: the weight version, the session, and the exact token ids sampled
        (what is trained)."""
        s = self.session
        out = {"weight_version": self.version, "session": None, "completion_ids": list(self.completion.token_ids)}
        if s is not None:
            out.update(session=s.id, group=s.group, calls=s.calls, template_drift=s.template_drift)
        return {"relay": out}

    def headers(self, sampling_note: str) -> dict:
        return {"X-Relay-Sampling": sampling_note, "X-Relay-Weight-Version": str(self.version)}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    """OpenAI's chat ``logprobs``: each sampled token's text, log-prob and bytes, no alternatives."""
    return {
        "content": [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs)
        ]
    }


def completion_logprobs(prompt: str, tokens: list[str], logprobs: list[float]) -> dict:
    """OpenAI's completions ``logprobs``: the tokens, their log-probs and their offsets in prompt + text."""
    offsets, at = [], len(prompt)
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in logprobs],
        "top_logprobs": None,
        "text_offset": offsets,
    }
