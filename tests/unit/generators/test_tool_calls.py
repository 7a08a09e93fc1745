"""The one parser of ``<tool_call>`` blocks (generators/tool_calls.py): the calls of a model's turn as the
episodes' environments read them, and as the OpenAI endpoint answers them."""

import json

from generators.tool_calls import (
    openai_tool_calls,
    parse_tool_calls,
    render_tool_response,
    strip_tool_calls,
    tool_call_text,
)


def test_hermes_single_call():
    [c] = parse_tool_calls(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*8"}}\n</tool_call>'
    )
    assert (c.name, c.arguments, c.error, c.compact) == ("calculator", {"expression": "7*8"}, "", False)


def test_hermes_several_calls_in_order_and_arguments_as_a_json_string():
    calls = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_bad_json_is_a_call_with_an_error_not_an_exception():
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call> </tool_call><tool_call>{"name"'
    )
    assert [c.error for c in calls] == ["bad_json", "bad_call", "empty", "unclosed"]
    assert calls[0].raw == '{"name": "calculator", "arguments": {'


def test_compact_form_means_the_default_tool():
    [c] = parse_tool_calls("<tool_call>7*8</tool_call>")
    assert (c.name, c.arguments, c.compact, c.error) == ("", {"input": "7*8"}, True, "")


def test_no_call_and_rendering():
    assert parse_tool_calls("56") == []
    assert strip_tool_calls("ok <tool_call>1+1</tool_call> done") == "ok  done"
    assert render_tool_response("56") == "<tool_response>56</tool_response>"


def test_the_endpoint_answers_readable_calls_as_openai_tool_calls():
    text = "Let me add.\n" + tool_call_text("add", {"a": 2, "b": 3}) + "\n<tool_call>not json</tool_call>"
    content, calls = openai_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert content == "Let me add.\n\n<tool_call>not json</tool_call>"  # what did not parse stays visible
    assert openai_tool_calls("no tools here") == ("no tools here", [])
    assert openai_tool_calls(tool_call_text("f", {}))[0] is None


def test_the_endpoint_leaves_calls_it_cannot_answer_in_the_content():
    """An unreadable call, a compact one (no tool named) or an unclosed one is what the model wrote: the
    harness sees it as content, and a turn without a readable call is its whole text."""
    for text in ("<tool_call>{bad</tool_call>", "<tool_call>7*8</tool_call>", '<tool_call>{"name": "f"'):
        assert openai_tool_calls(text) == (text, [])
    content, calls = openai_tool_calls('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b')
    assert content == "a  b" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}


def test_a_call_knows_where_it_stands_in_the_text():
    text = 'say <tool_call>{"name": "f"}</tool_call> then <tool_call>{"name"'
    first, unclosed = parse_tool_calls(text)
    assert text[slice(*first.span)] == '<tool_call>{"name": "f"}</tool_call>'
    assert unclosed.error == "unclosed" and text[slice(*unclosed.span)] == '<tool_call>{"name"'
