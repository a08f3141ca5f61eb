"""tool_choice: what it accepts and refuses (naming the field), the constraint it implies, the calls read
back from a constrained output, and the streamed deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.grammar.tool_parsers import get_parser
from engine.grammar.tools import ToolStream, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add"}}
NAMED = {"type": "function", "function": {"name": "add"}}


def test_default_choice_is_auto_with_tools_and_none_without():
    assert parse_tools([WEATHER], None).choice == "auto"
    assert parse_tools(None, None) is None
    assert parse_tools([WEATHER], "none") is None


@pytest.mark.parametrize(
    ("tools", "choice", "field"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([], "required", "tool_choice"),
        ([{"type": "function", "function": {}}], "auto", "tools.0.function.name"),
        ([{"type": "retrieval"}], "auto", "tools.0.type"),
    ],
)
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        parse_tools(tools, choice)


def test_required_schema_accepts_any_offered_call_and_rejects_others():
    schema = json.loads(parse_tools([WEATHER, ADD], "required").json_schema())
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate([{"name": "add", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rm", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_function_schema_allows_exactly_one_call_of_it():
    schema = json.loads(parse_tools([WEATHER, ADD], NAMED).json_schema())
    jsonschema.validate([{"name": "add", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], schema)


def test_constrained_output_reads_back_as_calls():
    tools = parse_tools([WEATHER, ADD], "required")
    content, calls = tools.extract(
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', get_parser("qwen25")
    )
    assert (
        content == ""
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments) == {"city": "Oslo"}
    )
    assert tools.extract('[{"name": "get_weather", "para', get_parser("qwen25"))[1] == []  # cut by max_tokens


def test_stream_sends_content_then_whole_calls():
    stream = ToolStream(parse_tools([WEATHER], "auto"), get_parser("qwen25"))
    out = []
    for piece in [
        "Sure",
        ". <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Rome"}}</tool_call>',
    ]:
        out += stream.push(piece)
    out += stream.finish()
    assert "".join(d.get("content", "") for d in out) == "Sure."
    (call,) = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0


def test_stream_without_a_call_sends_all_text():
    stream = ToolStream(parse_tools([WEATHER], "auto"), get_parser("qwen25"))
    out = stream.push("a <") + stream.push("b") + stream.finish()
    assert "".join(d["content"] for d in out) == "a <b" and not stream.calls
