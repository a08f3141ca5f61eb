"""tool_choice: what it accepts and refuses (naming the field), the constraint it implies, the calls read
back from a constrained output, and the streamed deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.grammar.tool_parsers import get_parser
from engine.grammar.tools import ToolStream, dumps_prefix, parse_tools

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


def _accumulate(deltas: list[dict]) -> dict[int, dict]:
    """The calls an OpenAI client builds from ``tool_calls`` deltas (arguments appended by index)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return calls


def test_stream_sends_content_then_calls_with_incremental_arguments():
    stream = ToolStream(parse_tools([WEATHER], "auto"), get_parser("qwen25"))
    out = []
    for piece in [
        "Sure",
        ". <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city":',
        ' "Ro',
        'me", "days"',
        ": 3} }</tool_call>",
    ]:
        out += stream.push(piece)
    out += stream.finish()
    assert "".join(d.get("content", "") for d in out) == "Sure."
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    head = calls[0]
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert head["type"] == "function" and head["id"].startswith("call_") and head["index"] == 0
    assert [c["function"]["arguments"] for c in calls[1:]] == ['{"city": ', '"Rome", "days"', ": 3}"]
    assert _accumulate(out)[0]["arguments"] == stream.calls[0].arguments == '{"city": "Rome", "days": 3}'


@pytest.mark.parametrize(
    "parser, choice, text",
    [
        ("qwen25", "auto", '<tool_call>{"name":"get_weather","arguments":'
                           '{"city":"Ro\\u00e9me","n":[1.50,true,null]}}'
                           '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
        ("qwen25", "required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                               '{"name": "get_weather", "parameters": {"city": "Bergen"}}]'),
        ("llama3", "auto", '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                           '{"name": "get_weather", "parameters": {"city": "X"}}'),
        ("mistral", "auto", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon"}}]'),
        ("pythonic", "auto", '[get_weather(city="Paris")]'),
    ],
)  # fmt: skip
def test_streamed_calls_accumulate_to_the_non_streamed_ones(parser, choice, text):
    """Character by character, whatever the parser: the client's accumulation equals ``extract``."""
    tools = parse_tools([WEATHER], choice)
    stream = ToolStream(tools, get_parser(parser))
    out = [d for ch in text for d in stream.push(ch)] + stream.finish()
    _, calls = tools.extract(text, get_parser(parser))
    got = _accumulate(out)
    assert [(c["name"], c["arguments"]) for c in got.values()] == [(c.name, c.arguments) for c in calls]
    assert all(c["id"].startswith("call_") for c in got.values())


def test_dumps_prefix_only_grows_toward_json_dumps():
    raw = '{"a" : "x\\"y", "b":[1.50, -2e3, false], "c": {}}'
    final = json.dumps(json.loads(raw), ensure_ascii=False)
    prefixes = [dumps_prefix(raw[:k]) for k in range(len(raw) + 1)]
    assert all(final.startswith(p) for p, _ in prefixes)
    assert prefixes[-1] == (final, len(raw)) and all(end is None for _, end in prefixes[:-1])


def test_stream_without_a_call_sends_all_text():
    stream = ToolStream(parse_tools([WEATHER], "auto"), get_parser("qwen25"))
    out = stream.push("a <") + stream.push("b") + stream.finish()
    assert "".join(d["content"] for d in out) == "a <b" and not stream.calls
