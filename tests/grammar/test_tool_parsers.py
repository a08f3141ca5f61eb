"""Tool-call parsers: each family's format gives the calls, text before them stays content, and a stream
holds back only what may start a call."""

from __future__ import annotations

import json

import pytest

from engine.grammar.tool_parsers import TOOL_CALL_PARSERS, default_parser, get_parser

NAMES = {"get_weather", "add"}
CASES = {
    "qwen25": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3": 'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_calls_and_the_text_before_them(name):
    content, calls = get_parser(name).parse(CASES[name], NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]


def test_pythonic_calls():
    content, calls = get_parser("pythonic").parse('[get_weather(city="Paris"), add(a=1, b=2)]', NAMES)
    assert content == "" and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1, "b": 2}


def test_llama3_bare_json_is_a_call():
    _, calls = get_parser("llama3").parse('{"name": "add", "parameters": {"a": 1}}', NAMES)
    assert [c.name for c in calls] == ["add"]


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_plain_text_has_no_calls(name):
    assert get_parser(name).parse("The weather is fine.", NAMES) == ("The weather is fine.", [])


def test_a_function_not_offered_is_dropped():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert get_parser("qwen25").parse(text, NAMES) == (text, [])


def test_broken_call_json_stays_text():
    text = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    assert get_parser("qwen25").parse(text, NAMES) == (text, [])


def test_stream_holds_back_a_possible_marker_only():
    parser = get_parser("qwen25")
    assert parser.hold_from("Hello <tool") == len("Hello ")
    assert parser.hold_from("Hello <tool_call>{") == len("Hello ")
    assert parser.hold_from("Hello world") == len("Hello world")


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '<|im_start|>' + m['role'] }}", "qwen25"),
        ("{% if tools %}<tool_call>{% endif %}", "qwen25"),
        ("<|start_header_id|>{{ m['role'] }}<|end_header_id|>", "llama3"),
        ("[INST] {{ m['content'] }} [/INST]", "mistral"),
        ("{{ m['content'] }}", "pythonic"),
    ],
)
def test_default_parser_follows_the_chat_template(template, parser):
    assert default_parser(template) == parser
