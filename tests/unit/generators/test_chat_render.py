"""The one chat renderer (generators/chat_render.py), shared by the episodes and the OpenAI endpoint: the
template's text and ids of a conversation (tools given to a template that knows them), the drift check,
and what a tokenizer cannot spell. Its use in episodes: test_episode_templates.py; in the endpoint:
tests/integration/test_openai_endpoint.py."""

from __future__ import annotations

import pytest

from generators.chat_render import ChatRenderer, misspelled
from learner.tiny_model import build_tokenizer
from tests.support.smollm2 import smollm2_tokenizer

PLAIN = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
WITH_TOOLS = "{% if tools %}T{{ tools|length }};{% endif %}" + PLAIN


def tiny(template: str):
    tok = build_tokenizer(tools=True)
    tok.chat_template = template
    return tok


def test_tools_go_to_a_template_that_knows_them_and_ids_are_the_texts_tokens():
    msgs = [{"role": "user", "content": "1+2"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    r = ChatRenderer(tiny(WITH_TOOLS))
    assert (r.native_tools, r.native_tool_calls) == (True, False)
    assert r.render(msgs, False, tools) == "T1;user:1+2;"
    assert r.ids(msgs, False, tools) == r.tok("T1;user:1+2;", add_special_tokens=False)["input_ids"]
    plain = ChatRenderer(tiny(PLAIN))
    assert not plain.native_tools and plain.render(msgs, False, tools) == "user:1+2;"  # the caller describes them


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(RuntimeError, match="no chat template"):
        ChatRenderer(tiny(""))


def test_a_turn_the_model_split_unlike_the_tokenizer_is_not_template_drift():
    """SmolLM2 samples "hello" letter by letter where its tokenizer writes one token: the same text,
    trained as sampled (never re-tokenised), so no template drift; a template that renders other text
    (the turn rewritten) still is."""
    tok = smollm2_tokenizer()
    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "What is 7*8?"}]
    prompt = tok(r.render(msgs, True), add_special_tokens=False)["input_ids"]
    split = [i for ch in "hello" for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert split != tok("hello", add_special_tokens=False)["input_ids"]  # the model's own split of its text
    used = prompt + split + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert not r.drift(msgs + [{"role": "assistant", "content": "hello"}], used)
    assert r.drift(msgs + [{"role": "assistant", "content": "olleh"}], used)  # the template renders other text


def test_whitespace_a_tokenizer_normalises_is_not_counted_as_unspellable():
    words = {"higher": [1], "lower": [2]}
    enc = lambda t: [i for w in t.split() for i in words.get(w, [0])]  # noqa: E731
    dec = lambda ids: " ".join({1: "higher", 2: "lower", 0: "<unk>"}[i] for i in ids)  # noqa: E731
    assert misspelled("higher", enc, dec) is None
    assert misspelled("higher  lower", enc, dec) is None  # whitespace normalised: nothing lost
    assert misspelled("warmer", enc, dec) == "<unk>"
