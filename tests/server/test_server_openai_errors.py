"""The openai SDK against the tiny model: a 400 from the OpenAI routes names the field the client sent
(``max_tokens`` / ``max_completion_tokens``, ``n``, ``temperature``, ``top_p``, ``stop``, ``seed``), an
unknown chat role is refused naming ``messages.<i>.role``, and the context-length error of
``/v1/completions`` speaks of the prompt (``1 token from the prompt``), the chat route's of the input
messages (upstream's wording)."""

from __future__ import annotations

import openai
import pytest

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def sdk(serve):
    server, _ = serve()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0) as client:
        yield client


def _message(call) -> str:
    return _error(call).body["message"]


def _error(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    assert raised.value.status_code == 400
    return raised.value


CASES = [
    ({"max_tokens": -1}, "max_tokens must be >= 0, got -1"),
    ({"n": 0}, "n must be an integer >= 1, got 0"),
    ({"temperature": -1}, "temperature must be >= 0, got -1.0"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
    ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
    ({"seed": 2**65}, "seed must be in [-2**63, 2**64)"),
]


@pytest.mark.parametrize(("extra", "expected"), CASES)
def test_sdk_400s_name_the_clients_field(sdk, extra, expected):
    completion = _message(lambda: sdk.completions.create(model="m", prompt="Hi", **extra))
    chat = _message(lambda: sdk.chat.completions.create(model="m", messages=USER, **extra))
    assert completion == chat == expected


@pytest.mark.parametrize(("extra", "expected"), CASES)
def test_sdk_400s_carry_the_field_as_param(sdk, extra, expected):
    (field,) = extra
    assert _error(lambda: sdk.completions.create(model="m", prompt="Hi", **extra)).param == field
    assert _error(lambda: sdk.chat.completions.create(model="m", messages=USER, **extra)).param == field


def test_chat_names_max_completion_tokens_when_that_was_sent(sdk):
    message = _message(
        lambda: sdk.chat.completions.create(model="m", messages=USER, max_completion_tokens=-2)
    )
    assert message == "max_completion_tokens must be >= 0, got -2"


@pytest.mark.parametrize("role", ["wizard", "User", ""])
def test_an_unknown_chat_role_is_a_400_naming_it(sdk, role):
    messages = [{"role": "system", "content": "be brief"}, {"role": role, "content": "Hi"}]
    message = _message(lambda: sdk.chat.completions.create(model="m", messages=messages, max_tokens=2))
    assert message.startswith("messages.1.role: must be one of 'user', 'system', 'assistant'"), message
    error = _error(lambda: sdk.chat.completions.create(model="m", messages=messages, max_tokens=2))
    assert error.param == "messages.1.role"
    assert message.endswith(f"got {role!r}")


def test_known_roles_in_any_case_but_user_are_accepted(sdk):
    messages = [{"role": "SYSTEM", "content": "be brief"}, {"role": "user", "content": "Hi"}]
    out = sdk.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert out.choices[0].message.role == "assistant"


def test_context_length_errors_name_the_prompt_on_completions(sdk):
    limit = sdk.models.list().data[0].max_model_len
    message = _message(lambda: sdk.completions.create(model="m", prompt=[5], max_tokens=limit))
    assert message == (
        f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested "
        f"a total of {limit + 1} tokens: 1 token from the prompt and {limit} tokens for the completion."
    )
    chat = _message(lambda: sdk.chat.completions.create(model="m", messages=USER, max_tokens=limit))
    assert "tokens from the input messages and" in chat and "for the completion." in chat
