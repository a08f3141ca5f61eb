"""Structured output and tools through the ``openai`` SDK against a SmolLM2 worker process:
``response_format`` json_schema (strict) for 20 concurrent prompts, json_object, ``tools`` with
``tool_choice`` required and a named function (plain and streamed), and bad input (400 naming the field;
the worker serves on)."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Bo", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun",
         "Kai", "Lea", "Mo", "Nia", "Oto", "Pia", "Quin", "Ravi", "Sol", "Tam"]  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client():
    flags = ["--model-path", "smollm2", "--max-total-tokens", "8192", "--page-size", "16"]
    with ServerProcess(flags, timeout=600) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600, max_retries=0)


def _person(client, name: str):
    messages = [
        {"role": "user", "content": f"Describe a person called {name} as JSON with name, age and city."}
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    return client.chat.completions.create(
        model="m", messages=messages, response_format=fmt, max_tokens=120, temperature=0
    )


def test_json_schema_response_format_validates_for_20_concurrent_prompts(client):
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda n: _person(client, n), NAMES))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_response_format_is_a_json_object(client):
    out = client.completions.create(
        model="m", prompt="A JSON object about a cat:", max_tokens=80, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def _check_call(call, tool: dict) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_returns_a_well_formed_call(client):
    out = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    _check_call(call, WEATHER if call.function.name == "get_weather" else TIME)


def test_named_tool_choice_calls_that_function_streamed_too(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80, temperature=0
    )
    (call,) = out.choices[0].message.tool_calls
    _check_call(call, TIME)
    stream = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80, temperature=0,
        stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    # The first delta opens the call (id, type, name); the arguments follow in several deltas.
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_time"
    assert [d.function.name for d in deltas[1:]] == [None] * (len(deltas) - 1) and len(deltas) > 2
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The SDK's own accumulation of the stream gives the non-streamed call.
    with client.chat.completions.stream(
        model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80, temperature=0
    ) as events:
        final = events.get_final_completion()
    (acc,) = final.choices[0].message.tool_calls
    assert (acc.function.name, acc.function.arguments) == (call.function.name, call.function.arguments)
    _check_call(acc, TIME)


def test_auto_without_a_call_answers_in_text(client):
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
UNKNOWN_TOOL = {"type": "function", "function": {"name": "launch"}}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format.json_schema.schema"),
        ({"tools": [WEATHER], "tool_choice": UNKNOWN_TOOL}, "tool_choice"),
        ({"extra_body": {"regex": "[a-"}}, "regex"),
    ],
)
def test_bad_constraint_is_a_400_naming_the_field_and_the_worker_serves_on(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=8, **kwargs)
    assert err.value.message.startswith("Error code: 400") and field in str(err.value)
    ok = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content
