"""End to end with real processes: start-up errors, the openai SDK against SmolLM2, and the real router (smg,
PyPI) with the cache_aware policy in front of two workers."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args

pytestmark = pytest.mark.slow


def _launch_error(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.launch_server", *flags], capture_output=True, text=True, timeout=120
    )


def test_startup_errors_name_the_flag_or_path(tmp_path):
    unknown = _launch_error("--model-path", "smollm2", "--enable-turbo-mode")
    assert unknown.returncode == 2 and "--enable-turbo-mode" in unknown.stderr
    bad = _launch_error("--model-path", "smollm2", "--hicache-write-policy", "sometimes")
    assert bad.returncode == 2 and "--hicache-write-policy" in bad.stderr
    bad_page = _launch_error("--model-path", "smollm2", "--page-size", "0")
    assert bad_page.returncode == 2 and "--page-size" in bad_page.stderr
    missing = _launch_error("--model-path", str(tmp_path / "nope"))
    assert missing.returncode == 1 and str(tmp_path / "nope") in missing.stderr


@pytest.fixture(scope="module")
def smollm2_server():
    flags = ["--model-path", "smollm2", "--enable-cache-report", "--enable-hierarchical-cache",
             "--max-total-tokens", "4096", "--page-size", "16", "--api-key", "sk-e2e"]  # fmt: skip
    with ServerProcess(flags) as server:
        yield server


def test_openai_sdk_chat_and_completions(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="sk-e2e")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # --enable-cache-report

    prompt = "The three primary colors are"
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    text = comp.choices[0].text
    assert text and comp.usage.completion_tokens == 12 and comp.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text

    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=-2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="wrong").models.list()


def _requests_served(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            return float(line.split()[-1])
    raise AssertionError("sglang:num_requests_total missing")


def test_the_router_cache_aware_routes_to_two_workers(tiny_model_dir):
    flags = ["--model-path", str(tiny_model_dir), "--enable-hierarchical-cache", "--page-size", "16",
             "--enable-metrics"]  # fmt: skip
    with ServerProcess(flags) as w1, ServerProcess(flags) as w2:
        sp = {"max_new_tokens": 8, "temperature": 0}
        prompts = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(6)]
        expected = [
            httpx.post(f"{w1.url}/generate", json={"text": t, "sampling_params": sp}).json() for t in prompts
        ]
        comp_body = {"prompt": prompts[0], "max_tokens": 8, "temperature": 0}
        comp_expected = httpx.post(f"{w2.url}/v1/completions", json=comp_body).json()["choices"][0]["text"]
        before = _requests_served(w1.url) + _requests_served(w2.url)
        with RouterProcess(worker_args([w1.url, w2.url]), min_workers=2) as router:
            router_url = router.url
            for text, exp in zip(prompts, expected, strict=True):
                routed = httpx.post(
                    f"{router_url}/generate", json={"text": text, "sampling_params": sp}, timeout=60
                )
                assert routed.status_code == 200, routed.text
                assert routed.json()["output_ids"] == exp["output_ids"]
            model = httpx.get(f"{router_url}/v1/models", timeout=10).json()["data"][0][
                "id"
            ]  # smg routes by it
            comp = httpx.post(f"{router_url}/v1/completions", json={"model": model, **comp_body}, timeout=60)
            assert comp.status_code == 200, comp.text
            assert comp.json()["choices"][0]["text"] == comp_expected
            chat_body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                         "temperature": 0}  # fmt: skip
            chat = httpx.post(f"{router_url}/v1/chat/completions", json=chat_body, timeout=60)
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["role"] == "assistant"
            after = _requests_served(w1.url) + _requests_served(w2.url)
            assert after - before == len(prompts) + 2  # every routed request reached a worker exactly once
