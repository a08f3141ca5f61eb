"""OpenAI routes over HTTP on the tiny model: response shapes, streaming deltas that add up to the
non-streamed text (also with a stop string), usage chunk, cache report, and 400s for unsupported fields."""

from __future__ import annotations

import json

PROMPT = [5, 9, 17, 33, 65, 129, 7, 11, 13]


def _chunks(text: str) -> list[dict]:
    events = [ln[len("data: ") :] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_stream_adds_up_to_plain_text_with_a_stop_string(serve):
    _, client = serve()
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 16, "total_tokens": 25}
    text = plain["choices"][0]["text"]
    stop = text[4:7]
    stopped = client.post("/v1/completions", json={**body, "stop": stop}).json()
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["matched_stop"] == stop
    for extra in ({}, {"stop": stop}):
        resp = client.post("/v1/completions", json={**body, **extra, "stream": True,
                                                   "stream_options": {"include_usage": True}})  # fmt: skip
        chunks = _chunks(resp.text)
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        expected = stopped if extra else plain
        assert streamed == expected["choices"][0]["text"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_chat_completion_shapes_and_cache_report(serve):
    _, client = serve("--enable-cache-report")
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox"}],
            "max_completion_tokens": 6, "temperature": 0, "separate_reasoning": True,
            "stream_reasoning": True, "skip_special_tokens": True, "continue_final_message": False,
            "model": None}  # fmt: skip
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    out = first.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] <= 6 and "prompt_tokens_details" in out["usage"]
    again = client.post("/v1/chat/completions", json=body).json()
    assert again["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    resp = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = _chunks(resp.text)
    assert (
        chunks[0]["object"] == "chat.completion.chunk"
        and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == out["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_cache_report_is_off_by_default(serve):
    _, client = serve()
    out = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert "prompt_tokens_details" not in out["usage"]


def test_unsupported_openai_fields_are_400(serve):
    _, client = serve()
    user = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [], "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"messages": user, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": user, "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": user, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 10**6}, "context length"),
    ]  # fmt: skip
    for path, body, needle in cases:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (path, body)
        assert needle in resp.json()["error"]["message"]
