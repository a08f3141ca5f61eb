"""The HTTP layer's contract: secrets never echoed, flush needs --api-key, same-backend re-attach keeps
the live extra config, bad request fields are 400s, unexpected errors are JSON 500s, /generate streams are
monotonic with stop strings, and a busy --port fails before the model loads."""

from __future__ import annotations

import json
import socket

from engine import launch_server
from engine.server.args import parse_args

KEY = "user-secret-key"
ADMIN = "admin-secret-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------------- 1. secrets
def test_server_info_and_args_repr_never_show_the_keys(serve):
    _, client = serve("--api-key", KEY, "--admin-api-key", ADMIN)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info", "/health"):
        resp = client.get(path)
        assert resp.status_code == 200, path
        assert KEY not in resp.text and ADMIN not in resp.text, path
    info = client.get("/server_info").json()
    assert info["api_key"] == "***" and info["admin_api_key"] == "***"
    args = parse_args(["--model-path", "m", "--api-key", KEY, "--admin-api-key", ADMIN])
    assert KEY not in repr(args) and ADMIN not in repr(args)


def test_server_info_keys_are_null_when_unset(serve):
    _, client = serve()
    info = client.get("/server_info").json()
    assert info["api_key"] is None and info["admin_api_key"] is None


def test_flush_cache_requires_the_api_key_router_routes_do_not(serve):
    _, client = serve("--api-key", KEY)
    for method in ("POST", "GET"):
        resp = client.request(method, "/flush_cache")
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
        wrong = client.request(method, "/flush_cache", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.request(method, "/flush_cache", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.text == "Cache flushed.\n"
    # the router calls these keyless (docs/upstream.md P4)
    for path in ("/health", "/server_info", "/model_info"):
        assert client.get(path).status_code == 200, path


# ------------------------------------------------------------------------------------------- 2. re-attach
def test_same_backend_reattach_keeps_the_extra_config_in_use(serve, tmp_path):
    server, client = serve("--enable-hierarchical-cache", "--admin-api-key", ADMIN, "--page-size", "16")
    first = json.dumps({"file_path": str(tmp_path / "a")})
    body = {"hicache_storage_backend": "file", "hicache_storage_backend_extra_config_json": first}
    assert client.put("/hicache/storage-backend", json=body, headers=AUTH).status_code == 200
    second = json.dumps({"file_path": str(tmp_path / "b")})
    again = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": second,
        "hicache_write_policy": "write_back",
    }
    resp = client.put("/hicache/storage-backend", json=again, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert "extra config was not changed" in resp.text and "etach" in resp.text
    view = client.get("/hicache/storage-backend", headers=AUTH).json()
    assert view["hicache_storage_backend_extra_config"] == first
    assert view["hicache_write_policy"] == "write_back"  # the policies do change (upstream)
    assert client.get("/server_info").json()["hicache_storage_backend_extra_config"] == first

    same = client.put("/hicache/storage-backend", json=body, headers=AUTH)
    assert same.status_code == 200 and "not changed" not in same.text


# ------------------------------------------------------------------------------------------- 3. bad fields
def _chat(client, **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_chat_template_kwargs_add_generation_prompt_is_honoured(serve):
    _, client = serve()
    with_prompt = _chat(client)
    without = _chat(client, chat_template_kwargs={"add_generation_prompt": False})
    assert with_prompt.status_code == 200 and without.status_code == 200, without.text
    p_with = with_prompt.json()["usage"]["prompt_tokens"]
    assert without.json()["usage"]["prompt_tokens"] < p_with
    bad = _chat(client, chat_template_kwargs={"add_generation_prompt": "yes"})
    assert bad.status_code == 400 and "add_generation_prompt" in bad.json()["error"]["message"]
    reserved = _chat(client, chat_template_kwargs={"messages": []})
    assert reserved.status_code == 400 and "chat_template_kwargs" in reserved.json()["error"]["message"]


def test_bad_fields_are_400_naming_the_field_and_the_server_keeps_serving(serve):
    _, client = serve()
    cases = [
        ("/v1/chat/completions", {"stream": True, "stream_options": "x"}, "stream_options"),
        ("/v1/completions", {"stream": True, "stream_options": "x"}, "stream_options"),
        ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "y"}}, "include_usage"),
        ("/v1/completions", {"seed": 10**24}, "seed must be in"),  # the client's field, not sampling_seed
        ("/v1/completions", {"seed": -(2**63) - 1}, "seed must be in"),
    ]
    for path, extra, field in cases:
        body = {"max_tokens": 2, **extra}
        if path == "/v1/completions":
            body["prompt"] = "hi"
        else:
            body["messages"] = [{"role": "user", "content": "hi"}]
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (path, extra, resp.text)
        message = resp.json()["error"]["message"]
        assert field in message and "sampling_" not in message, (path, extra, message)
    gen = client.post("/generate", json={"text": "hi", "sampling_params": {"sampling_seed": 10**24}})
    assert gen.status_code == 400 and "sampling_seed" in gen.json()["error"]["message"]
    part = {"role": "user", "content": [{"type": "text", "text": 5}]}
    resp = client.post("/v1/chat/completions", json={"messages": [part], "max_tokens": 2})
    assert resp.status_code == 400 and "text" in resp.json()["error"]["message"]
    assert _chat(client).status_code == 200
    seeded = client.post("/generate", json={"text": "hi", "sampling_params": {"sampling_seed": 2**64 - 1}})
    assert seeded.status_code == 200


def test_unexpected_error_in_a_route_is_a_json_500(serve, monkeypatch):
    server, client = serve()

    def broken(text, add_special_tokens=True):  # fault injection: a bug deep in a route
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(server.engine, "encode", broken)
    resp = client.post("/generate", json={"text": "hi"})
    assert resp.status_code == 500
    assert resp.json()["error"]["code"] == 500 and "tokenizer exploded" in resp.json()["error"]["message"]
    monkeypatch.undo()
    assert (
        client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code
        == 200
    )


# ------------------------------------------------------------------------------------------- 4. monotonic
def _stop_across_tokens(engine, ids: list[int]) -> tuple[str, int] | None:
    """A 2-char stop string spanning the boundary of tokens k and k+1 that first occurs there."""
    full = engine.decode(ids)
    for k in range(1, len(ids) - 1):
        head, nxt = engine.decode(ids[:k]), engine.decode(ids[: k + 1])
        if not head or len(nxt) <= len(head) or not nxt.startswith(head):
            continue
        stop = head[-1] + nxt[len(head)]
        if full.find(stop) == len(head) - 1 and stop.isprintable() and "\ufffd" not in stop:
            return stop, k
    return None


def test_generate_stream_with_stop_string_never_goes_backwards(serve):
    server, client = serve()
    prompt = [5, 6, 7, 8, 9]
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = client.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
    found = _stop_across_tokens(server.engine, plain["output_ids"])
    assert found is not None, plain["text"]
    stop, _ = found
    sp = {**sp, "stop": [stop]}
    expected = client.post("/generate", json={"input_ids": prompt, "sampling_params": sp}).json()
    assert expected["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    resp = client.post("/generate", json={"input_ids": prompt, "sampling_params": sp, "stream": True})
    frames = [json.loads(e) for e in _sse_events(resp.text)[:-1]]
    texts = [f["text"] for f in frames]
    for before, after in zip(texts, texts[1:], strict=False):
        assert after.startswith(before), texts
    assert texts[-1] == expected["text"] and stop not in texts[-1]
    assert frames[-1]["output_ids"] == expected["output_ids"]


# ------------------------------------------------------------------------------------------- 5. port
def test_busy_port_exits_2_before_the_model_is_loaded(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model path does not exist: reaching the model load would exit 1 instead.
        argv = ["--model-path", str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", str(port)]
        assert launch_server.main(argv) == 2
    err = capsys.readouterr().err
    assert "--port" in err and str(port) in err
