"""Native HTTP API over a real uvicorn server on 127.0.0.1: /generate (JSON and SSE), info, health, metrics,
flush, bad input answered with 4xx while the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import pytest

PROMPT = "the quick brown fox jumps over the lazy dog"


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_generate_text_and_input_ids_give_same_greedy_output(serve):
    _, client = serve()
    sp = {"max_new_tokens": 10, "temperature": 0}
    by_text = client.post("/generate", json={"text": PROMPT, "sampling_params": sp})
    assert by_text.status_code == 200, by_text.text
    body = by_text.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 10 and meta["completion_tokens"] == 10
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["cached_tokens_details"].keys() == {"device", "host", "storage"}
    assert meta["e2e_latency"] > 0 and meta["prompt_tokens"] > 0
    again = client.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()
    assert again["output_ids"] == body["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0


def test_generate_stream_is_cumulative_sse_ending_in_done(serve):
    _, client = serve()
    sp = {"max_new_tokens": 8, "temperature": 0}
    plain = client.post("/generate", json={"input_ids": [5, 6, 7, 8, 9], "sampling_params": sp}).json()
    resp = client.post(
        "/generate", json={"input_ids": [5, 6, 7, 8, 9], "sampling_params": sp, "stream": True}
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 8
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 9))
    assert chunks[-1]["output_ids"] == plain["output_ids"] and chunks[-1]["text"] == plain["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[0]["meta_info"]["finish_reason"] is None


def test_batched_generate_and_router_extra_fields(serve):
    _, client = serve()
    body = {
        "input_ids": [[5, 6, 7], [9, 10, 11, 12]],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "log_metrics": True, "return_hidden_states": False, "no_logs": False, "return_bytes": False,
        "return_entropy": False, "background": False, "return_text_in_logprobs": False, "model": None,
        "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "rid": ["r-a", "r-b"],
    }  # fmt: skip
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert isinstance(out, list) and [len(o["output_ids"]) for o in out] == [4, 4]
    assert [o["meta_info"]["id"] for o in out] == ["r-a", "r-b"]
    single = client.post(
        "/generate", json={"input_ids": [9, 10, 11, 12], "sampling_params": body["sampling_params"]}
    )
    assert single.json()["output_ids"] == out[1]["output_ids"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({}, "exactly one"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"logit_bias": {"999999": 1}}}, "logit_bias"),
        ({"input_ids": [1, 2, 100000]}, "input_ids"),
        ({"input_ids": list(range(3, 300)) * 2}, "context length"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 600}}, "context length"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_bad_generate_requests_are_400_and_server_keeps_serving(serve, body, needle):
    _, client = serve()
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]
    ok = client.post("/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_bad_json_is_400(serve):
    _, client = serve()
    resp = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "invalid JSON" in resp.json()["error"]["message"]
    resp = client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "object" in resp.json()["error"]["message"]


def test_server_info_model_info_and_health(serve, tiny_model_dir):
    _, client = serve("--page-size", "16", "--max-total-tokens", "2048", "--enable-hierarchical-cache")
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    # the health probe's request ends in the scheduler's next published snapshot (later on a loaded machine)
    deadline = time.monotonic() + 30
    while not client.get("/server_info").json()["is_idle"]:
        assert time.monotonic() < deadline, "not idle 30 s after /health_generate answered"
        time.sleep(0.05)
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["model_path"] == str(tiny_model_dir)
        assert info["page_size"] == 16 and info["enable_hierarchical_cache"] is True
        assert info["hicache_ratio"] == 2.0 and info["hicache_write_policy"] == "write_through"
        assert info["disaggregation_mode"] == "null" and info["disaggregation_bootstrap_port"] == 8998
        assert info["is_idle"] is True and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        assert set(info["inflight_cache_io"]) == {"writes", "loads", "prefetches", "backups"}
        assert info["hicache"] is not None
    for path in ("/model_info", "/get_model_info"):
        model = client.get(path).json()
        assert model["model_path"] == str(tiny_model_dir) and model["is_generation"] is True
        # one rank's KV shape: with the stored dtype it gives the bytes per token the worker reports
        shape, dtype = model["kv_shape"], model["kv_cache_dtype"]
        per_element = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
        row = shape["head_dim"] * per_element
        assert model["kv_bytes_per_token"] == 2 * shape["num_layers"] * shape["num_kv_heads"] * row


def test_server_info_hicache_is_null_without_hierarchical_cache(serve):
    _, client = serve()
    assert client.get("/server_info").json()["hicache"] is None


def test_flush_cache_clears_prefix_hits(serve):
    _, client = serve("--enable-hierarchical-cache")
    body = {"text": PROMPT * 3, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    client.post("/generate", json=body)
    assert client.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    assert client.post("/flush_cache").status_code == 200
    assert client.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


def test_metrics_have_sglang_names(serve):
    _, client = serve("--enable-metrics", "--enable-hierarchical-cache")
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    client.post("/generate", json=body)
    client.post("/generate", json=body)
    text = client.get("/metrics").text
    for name in (
        'sglang:cached_tokens_total{cache_source="device"',
        'sglang:cached_tokens_total{cache_source="host"',
        'sglang:cached_tokens_total{cache_source="storage"',
        "sglang:num_running_reqs{",
        "sglang:num_queue_reqs{",
        "sglang:time_to_first_token_seconds_bucket{",
        "sglang:inter_token_latency_seconds_bucket{",
        "sglang:hicache_host_used_tokens{",
        "sglang:hicache_host_total_tokens{",
        "sglang:prefetched_tokens_total{",
        "sglang:backuped_tokens_total{",
        "sglang:load_back_tokens_total{",
        "sglang:evicted_tokens_total{",
        "sglang:cache_hit_rate{",
        "sglang:prefetch_completed_total{",
        "sglang:prefetch_timeout_total{",
        "sglang:prefetch_revoked_total{",
        "sglang:prompt_tokens_total{",
        "sglang:generation_tokens_total{",
    ):
        assert name in text, name
    assert 'model_name="' in text
    ttft_count = [ln for ln in text.splitlines() if ln.startswith("sglang:time_to_first_token_seconds_count")]
    assert ttft_count and float(ttft_count[0].split()[-1]) == 2.0
    device_hits = [ln for ln in text.splitlines() if 'cached_tokens_total{cache_source="device"' in ln]
    assert float(device_hits[0].split()[-1]) > 0


def test_metrics_off_without_flag(serve):
    _, client = serve()
    assert client.get("/metrics").status_code == 404


def test_api_key_protects_inference_routes_only(serve):
    _, client = serve("--api-key", "sk-test")
    assert client.get("/v1/models").status_code == 401
    assert client.post("/generate", json={"text": "a"}).status_code == 401
    auth = {"Authorization": "Bearer sk-test"}
    models = client.get("/v1/models", headers=auth)
    assert models.status_code == 200 and models.json()["data"][0]["object"] == "model"
    assert client.get("/health").status_code == 200 and client.get("/server_info").status_code == 200


def test_health_fails_when_scheduler_thread_is_dead(serve):
    server, client = serve()
    server.engine.scheduler.stop()
    assert client.get("/health").status_code == 503
    resp = client.get("/health_generate")
    assert resp.status_code == 503 and "dead" in resp.text
    gen = client.post("/generate", json={"text": "a", "stream": True})
    assert gen.status_code == 503 and "not running" in gen.json()["error"]["message"]


def test_client_disconnect_aborts_the_request_and_frees_its_kv(serve):
    server, client = serve("--enable-hierarchical-cache")
    sampling = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}
    one = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": sampling}
    # A streamed n > 1 batch: every sample of every prompt is aborted with the connection.
    many = {"input_ids": [[5, 6, 7], [8, 9, 10]], "stream": True, "sampling_params": {**sampling, "n": 3}}
    for body in (one, many):
        with client.stream("POST", "/generate", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break  # one token arrived; drop the connection
        deadline = time.monotonic() + 60  # idle: nothing running or waiting, its L1->L2 writes acknowledged
        while not (info := client.get("/server_info").json())["is_idle"]:
            assert time.monotonic() < deadline, f"aborted request still held: {info}"
            time.sleep(0.05)
        assert info["num_running_reqs"] == 0
        used = server.engine.scheduler.state["num_used_tokens"]
        assert used == 0  # everything the requests held went back to the pool or the evictable tree


def test_health_fails_while_the_scheduler_is_stuck(serve):
    server, client = serve("--watchdog-timeout", "0.3")
    release = threading.Event()
    stuck = server.engine.scheduler.call(lambda s: release.wait(120))  # blocks the scheduler thread
    deadline = time.monotonic() + 60
    while (resp := client.get("/health")).status_code == 200:
        assert time.monotonic() < deadline, "health still 200 with the scheduler stuck"
        time.sleep(0.05)
    assert resp.status_code == 503 and "watchdog" in resp.text
    assert client.get("/health_generate").status_code == 503
    release.set()
    stuck.result(30)
    deadline = time.monotonic() + 60
    while (resp := client.get("/health")).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.05)
    assert client.get("/health_generate").status_code == 200
