"""The one request object (``GenerateRequest``) as the routes build it from SGLang's ``/generate`` body and
OpenAI's bodies, on a real in-process engine (tiny model): every option lands in its field, a bad value is a
400 naming the client's field, and ``samples`` / ``warmup`` / ``to_req`` carry each field to the scheduler's
``Req``."""

from __future__ import annotations

import asyncio

import pytest

from engine.scheduler.logprobs import LogprobRequest
from engine.scheduler.req import Bootstrap
from engine.scheduler.request import GenerateRequest
from engine.scheduler.sampling_params import SamplingParams
from engine.server.generate import generate_requests
from engine.server.http_utils import HTTPError
from engine.server.openai import chat_request, completion_requests
from engine.server.schemas import ChatCompletionRequest, CompletionRequest, GenerateReqInput, validated


@pytest.fixture
def engine(make_engine):
    return make_engine()


def _generate(engine, body: dict):
    return asyncio.run(generate_requests(engine, validated(GenerateReqInput, body), None))


def _chat(engine, body: dict):
    return asyncio.run(chat_request(engine, validated(ChatCompletionRequest, body), None))


def _completions(engine, body: dict):
    return asyncio.run(completion_requests(engine, validated(CompletionRequest, body), None))


def test_a_generate_body_gives_one_request_per_prompt_with_every_option(engine):
    body = {
        "text": ["a b c", "d e"],
        "sampling_params": [
            {"max_new_tokens": 3, "regex": "[ab]+"},
            {"max_new_tokens": 4, "sampling_seed": 7},
        ],
        "rid": ["r0", "r1"],
        "extra_key": "tenant-a",  # upstream's name for cache_salt
        "return_logprob": [True, False],
        "top_logprobs_num": 2,
    }
    requests, batched = _generate(engine, body)
    assert batched and [r.rid for r in requests] == ["r0", "r1"]
    assert [r.input_ids for r in requests] == [engine.encode("a b c"), engine.encode("d e")]
    assert [r.params.max_new_tokens for r in requests] == [3, 4]
    assert requests[1].params.sampling_seed == 7
    assert [r.cache_salt for r in requests] == ["tenant-a", "tenant-a"]
    assert (
        requests[0].logprob == LogprobRequest(len(requests[0].input_ids) - 1, 2)
        and requests[1].logprob is None
    )
    assert requests[0].grammar is not None and requests[1].grammar is None  # compiled before queueing
    assert all(r.bootstrap is None and not r.mm_items and not r.health_check for r in requests)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"regex": "("}}, "sampling_params.regex"),
        ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
        ({"text": "a", "sampling_params": {"n": 2}, "rid": "x"}, "rid"),
        ({"text": "a", "cache_salt": "s", "extra_key": "t"}, "cache_salt"),
        ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "bootstrap_room": 5}, "bootstrap_room"),
    ],
)
def test_a_bad_generate_body_is_a_400_naming_the_field(engine, body, field):
    with pytest.raises(HTTPError) as err:
        _generate(engine, body)
    assert err.value.status == 400 and err.value.message.startswith(field), err.value.message


def test_a_chat_body_gives_one_request_with_the_clients_options(engine):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "seed": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 4,
        "cache_salt": "s1",
        "response_format": {"type": "json_object"},
    }
    request, tools = _chat(engine, body)
    assert tools is None and request.rid is None and request.bootstrap is None
    assert request.input_ids == engine.chat_prompt(body["messages"])
    params = request.params
    assert (params.max_new_tokens, params.sampling_seed, params.n) == (5, 3, 2)
    assert request.logprob == LogprobRequest(len(request.input_ids) - 1, 4)
    assert request.cache_salt == "s1" and request.grammar is not None


def test_completions_give_one_request_per_prompt(engine):
    body = {"prompt": ["a b", "c d"], "max_tokens": 2, "echo": True, "logprobs": 1}
    requests, texts, echo = _completions(engine, body)
    assert echo and texts == ["a b", "c d"]
    assert [r.input_ids for r in requests] == [engine.encode("a b"), engine.encode("c d")]
    assert all(r.params.max_new_tokens == 2 and r.logprob == LogprobRequest(0, 1) for r in requests)


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
        ("completions", {"prompt": "a", "n": 0}, "n"),
        ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ],
)
def test_a_bad_openai_body_is_a_400_naming_the_clients_field(engine, route, body, field):
    with pytest.raises(HTTPError) as err:
        (_chat if route == "chat" else _completions)(engine, body)
    assert err.value.status == 400 and err.value.message.startswith(field), err.value.message


def test_samples_warmup_and_the_schedulers_req_carry_each_field():
    rooms = [Bootstrap("p", 8998, 10 + j) for j in range(3)]
    want = LogprobRequest(1, 2)
    request = GenerateRequest(
        [1, 2, 3], SamplingParams(n=3, sampling_seed=5, max_new_tokens=4), bootstrap=rooms, cache_salt="s",
        logprob=want,
    )  # fmt: skip
    samples = request.samples()
    assert [s.params.sampling_seed for s in samples] == [5, 6, 7] and all(s.params.n == 1 for s in samples)
    assert [s.bootstrap for s in samples] == rooms and all(s.cache_salt == "s" for s in samples)
    with pytest.raises(ValueError, match="bootstrap"):
        request.to_req(print)  # several pairings: only one sample at a time reaches the scheduler
    req = samples[2].to_req(print)
    assert req.bootstrap == rooms[2] and req.cache_salt == "s" and req.logprob is not None
    assert req.input_ids == [1, 2, 3] and req.input_ids is not request.input_ids
    assert req.generator is not None and req.generator.initial_seed() == 7 and len(req.rid) == 32
    warm = GenerateRequest([1, 2], SamplingParams(n=2, min_new_tokens=1), rid=None, cache_salt="s").warmup()
    assert (warm.params.n, warm.params.max_new_tokens, warm.params.min_new_tokens) == (1, 0, 0)
    assert warm.cache_salt == "s" and warm.logprob is None and warm.bootstrap is None
    assert GenerateRequest([1], SamplingParams(), rid="x").samples()[0].to_req(print).rid == "x"
