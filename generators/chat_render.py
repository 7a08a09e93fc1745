"""Rendering chat messages into a model's tokens: :class:`ChatRenderer` (a tokenizer's chat template), used
by the episodes (generators/episodes.py) and the OpenAI endpoint (generators/openai_endpoint.py); and
:class:`PlainRenderer`, the episodes' rendering for a tokenizer without a template (the built-in tiny model).

An episode's renderer (:func:`make_renderer`) gives the prompt's ids, an environment reply's ids
(``reply_ids``), whether the conversation drifted from its template's rendering (``drift``), and whether
the tokenizer can spell a reply (``misspelled``)."""

from __future__ import annotations

from typing import Callable

from broker.protocol.messages import PromptEntry


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> ids without special tokens added (no BOS), for a transformers or a ``tokenizers`` tokenizer."""
    if hasattr(tokenizer, "apply_chat_template"):  # transformers
        return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def plain_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> the text they spell, special tokens by their names (an unknown token shows as what it is)."""
    if hasattr(tokenizer, "apply_chat_template"):  # transformers
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def misspelled(text: str, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> str | None:
    """What the tokens of ``text`` spell when it is not ``text`` (whitespace aside: a tokenizer may normalise
    spaces without losing anything), else None. ``higher`` through the tiny model's tokenizer: ``<pad>``."""
    spelled = decode(encode(text))
    return None if "".join(spelled.split()) == "".join(text.split()) else spelled


class PlainRenderer:
    """A tokenizer without a chat template (the built-in tiny model): a tool's reply is
    ``<tool_response>REPLY</tool_response>``, a user's reply its text; no drift check (there is no
    template to drift from). The prompt is encoded as single-turn prompts are."""

    def __init__(
        self,
        encode_prompt: Callable[[str], list[int]],
        encode_plain: Callable[[str], list[int]],
        decode_plain: Callable[[list[int]], str] | None = None,
    ):
        self.encode_prompt, self.encode_plain, self.decode_plain = encode_prompt, encode_plain, decode_plain

    def prompt_ids(self, prompt: PromptEntry) -> list[int]:
        return prompt.prompt_ids if prompt.prompt_ids is not None else self.encode_prompt(prompt.text)

    def reply_ids(self, messages: list[dict], turn_ids: list[int], reply: str, role: str) -> list[int]:
        return self.encode_plain(f"<tool_response>{reply}</tool_response>" if role == "tool" else reply)

    def drift(self, messages: list[dict], used_ids: list[int]) -> bool | None:
        return None

    def misspelled(self, reply: str) -> str | None:
        """What the model reads instead of ``reply`` when the tokenizer cannot spell it (None: it can)."""
        return misspelled(reply, self.encode_plain, self.decode_plain) if self.decode_plain else None


class ChatRenderer:
    """A tokenizer's chat template (SmolLM2, Qwen, ...): the one renderer of chat messages, for the episodes
    (generators/episodes.py) and the OpenAI endpoint (generators/openai_endpoint.py) alike.

    Episodes: the prompt is the template's rendering of the user message (when the feeder did not give
    ids), and a reply's tokens are the difference between rendering the conversation with the new message
    (and the generation prompt) and without it. What the template puts after an assistant message that the
    model did not sample (the newline after ``<|im_end|>``, or the end marker of a turn cut by max_tokens) is
    added as context too, so the tokens follow the template exactly.

    Tools: a template that knows ``tools`` / ``tool_calls`` (``native_tools``, ``native_tool_calls``) renders
    them itself; one that does not (SmolLM2's) is given the Hermes convention by the endpoint
    (generators/openai_requests.py)."""

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
        self.encode_plain = plain_encoder(tokenizer)
        self.decode_plain = plain_decoder(tokenizer)

    def misspelled(self, reply: str) -> str | None:
        """What the model reads instead of ``reply`` when the tokenizer cannot spell it (None: it can)."""
        return misspelled(reply, self.encode_plain, self.decode_plain)

    def render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The template's text of ``messages`` (``tools`` given to a template that knows them)."""
        kw = {"tools": tools} if tools and self.native_tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def ids(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        """The token ids of :meth:`render`'s text (no special tokens added: the template wrote its own)."""
        return list(self.encode_plain(self.render(messages, generation_prompt, tools)))

    def prompt_ids(self, prompt: PromptEntry) -> list[int]:
        if prompt.prompt_ids is not None:
            return prompt.prompt_ids
        return self.encode_plain(self.render([{"role": "user", "content": prompt.text}], True))

    def reply_ids(self, messages: list[dict], turn_ids: list[int], reply: str, role: str) -> list[int]:
        without = self.render(messages, False)  # ends with the last assistant turn, as the template closes it
        with_ = self.render(messages + [{"role": role, "content": reply}], True)
        turn = self.tok.decode(turn_ids, skip_special_tokens=False)
        at = without.rfind(turn) if turn else -1
        gap = without[at + len(turn) :] if at >= 0 else ""  # the template's close of the turn, past what was sampled
        if with_.startswith(without):
            new = with_[len(without) :]
        else:  # the template rewrites earlier turns once a message is added: counted at the episode's end
            k = 0
            while k < min(len(with_), len(without)) and with_[k] == without[k]:
                k += 1
            new = with_[k:]
        return self.encode_plain(gap + new)

    def drift(self, messages: list[dict], used_ids: list[int]) -> bool:
        """Whether the template renders the conversation otherwise than the tokens used. They must be a
        prefix of its rendering: what the template adds after the final turn (its end marker, a newline;
        the close of a turn cut by a budget) was never sampled, so it is no drift. Tokens that differ only
        in how the model split its own text (a sampled ``" 1"`` ``"9"`` where the tokenizer would write
        ``" 19"``: the same text) are no template drift either: the sampled ids are what is trained,
        never re-tokenised, so only a template that renders other *text* (rewrites a turn) counts."""
        text = self.render(messages, False)
        ref = self.encode_plain(text)
        if ref[: len(used_ids)] == list(used_ids):
            return False
        used = self.tok.decode(list(used_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return not text.startswith(used)


def make_renderer(backend) -> PlainRenderer | ChatRenderer:
    """The renderer for ``backend``'s tokenizer (loaded): the chat template's when it has one."""
    tok = getattr(backend, "tokenizer", None)
    if tok is not None and getattr(tok, "chat_template", None):
        return ChatRenderer(tok)
    if tok is None:
        raise ValueError(
            f"the {backend.name} backend exposes no tokenizer: multi-turn episodes need one to render "
            "the environment's replies"
        )
    return PlainRenderer(backend.encode, plain_encoder(tok), plain_decoder(tok))


def check_tool_vocabulary(renderer, backend) -> None:
    """A plain (template-less) tokenizer must know the tool markers, or every reply would become
    unknown tokens: refuse to start instead (the tiny model needs learner.tiny.tools)."""
    if not isinstance(renderer, PlainRenderer):
        return
    ids = renderer.encode_plain("<tool_response></tool_response>")
    if len(ids) != 2 or backend.decode(ids) != "<tool_response></tool_response>":
        raise ValueError(
            "the model's tokenizer has no <tool_response> / </tool_response> tokens: with the built-in "
            "tiny model, set learner.tiny.tools = true (relay up --task calc does)"
        )
