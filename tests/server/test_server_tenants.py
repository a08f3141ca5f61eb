"""Tenants by API key (``--tenant-keys-file``) over HTTP, directly and through each real router (smg, and
sglang-router 0.3.2 from its own venv: both pass ``Authorization`` on): each
tenant's requests get their own cache key space (another tenant's identical prompt gets 0 cached tokens and
the same output), keys of one tenant or of tenants given one ``cache_group`` share, ``max_requests`` is a
429 naming the tenant, per-tenant hit metrics carry a digest label, and no key or salt leaves the worker."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import time

import httpx
import openai
import pytest
from server_testlib import ThreadedServer

from engine.fleet.router import router_command, worker_args
from engine.ports import free_port
from engine.server.args import ArgumentError, parse_args
from engine.server.builder import build_engine
from engine.server.tenants import tenant_salt

pytestmark = pytest.mark.slow

PAGE = 16
PROMPT = [random.Random(7).randrange(3, 300) for _ in range(200)]
ALIGNED = (len(PROMPT) - 1) // PAGE * PAGE
OPERATOR = "sk-operator-0f3c"
TENANTS = {
    "acme": {"api_keys": ["sk-acme-1a2b", "sk-acme-3c4d"]},
    "acme-eu": {"api_keys": ["sk-acme-eu-5e6f"], "cache_group": "acme"},
    "globex": {"api_keys": ["sk-globex-7a8b"]},
    "initech": {"api_keys": ["sk-initech-9c0d"], "max_requests": 1},
}
SECRETS = [OPERATOR, *(k for t in TENANTS.values() for k in t["api_keys"])]


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tiny_runner, tmp_path_factory):
    """(engine, base url) of one worker with four tenants and an operator key."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": TENANTS}))
    flags = [
        "--model-path", str(tiny_model_dir), "--page-size", str(PAGE), "--max-total-tokens", "4096",
        "--enable-cache-report", "--enable-metrics", "--api-key", OPERATOR, "--tenant-keys-file", str(path),
    ]  # fmt: skip
    engine = build_engine(parse_args(flags), runner=tiny_runner)
    with ThreadedServer(engine) as server:
        yield engine, server.url
    engine.scheduler.stop()


def _generate(url: str, key: str | None, prompt=PROMPT, salt: str | None = None) -> tuple[list[int], dict]:
    body: dict = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    return resp.json()["output_ids"], meta["cached_tokens_details"]["device"]


def test_tenants_never_share_unless_one_tenant_or_one_group(worker):
    _, url = worker
    prompt = PROMPT[:120] + [5] * 80
    aligned = (len(prompt) - 1) // PAGE * PAGE
    cold, hit = _generate(url, "sk-globex-7a8b", prompt)
    assert hit == 0
    # another tenant: a miss, the same output; the operator key (shared space) misses too
    assert _generate(url, "sk-acme-1a2b", prompt) == (cold, 0)
    assert _generate(url, OPERATOR, prompt) == (cold, 0)
    # the same tenant's other key, and a tenant configured into its cache group, hit
    assert _generate(url, "sk-acme-3c4d", prompt) == (cold, aligned)
    assert _generate(url, "sk-acme-eu-5e6f", prompt) == (cold, aligned)
    assert _generate(url, "sk-globex-7a8b", prompt) == (cold, aligned)
    # no body salt reaches another tenant's space, not even the salt acme's requests run in
    assert _generate(url, "sk-initech-9c0d", prompt, salt=tenant_salt("acme", None)) == (cold, 0)
    assert _generate(url, OPERATOR, prompt, salt=tenant_salt("acme", None)) == (cold, 0)
    # a body salt splits a tenant's own space
    assert _generate(url, "sk-acme-1a2b", prompt, salt="project-x") == (cold, 0)
    assert _generate(url, "sk-acme-3c4d", prompt, salt="project-x") == (cold, aligned)


def test_openai_sdk_with_a_tenant_key_gets_its_tenants_hits(worker):
    _, url = worker
    text = "tenant isolation with the openai client " * 8

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
        out = client.completions.create(model="m", prompt=text, max_tokens=4, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("sk-globex-7a8b") == 0
    assert cached("sk-acme-1a2b") == 0
    assert cached("sk-acme-3c4d") > 0


@pytest.mark.parametrize("header", [None, "Bearer sk-not-a-key", "Basic sk-acme-1a2b"])
def test_a_request_without_a_tenant_or_operator_key_is_a_401(worker, header):
    _, url = worker
    headers = {"Authorization": header} if header else {}
    for path, body in (("/generate", {"input_ids": PROMPT[:8]}), ("/v1/completions", {"prompt": "hi"})):
        resp = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
        assert resp.status_code == 401, resp.text
        assert "sk-" not in resp.text


def test_a_tenant_at_max_requests_gets_a_429_naming_it(worker):
    engine, url = worker
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"input_ids": PROMPT[:8], "sampling_params": {"max_new_tokens": 2}}).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-initech-9c0d\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as held:
        held.sendall(head + body[:5])  # in flight (its body still arriving) until the rest is sent
        headers = {"Authorization": "Bearer sk-initech-9c0d"}
        resp = _poll_for(
            lambda: httpx.post(f"{url}/generate", json={"input_ids": PROMPT[:8]}, headers=headers)
        )
        assert resp.status_code == 429
        assert resp.json()["error"]["message"].startswith("tenant 'initech' has 1 requests in flight")
        assert _generate(url, "sk-globex-7a8b")[0]  # another tenant is not limited by it
        held.sendall(body[5:])
        answer = b""
        while chunk := held.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    assert _generate(url, "sk-initech-9c0d")[0]  # the slot is free again
    labels = {t["name"]: t["label"] for t in httpx.get(f"{url}/server_info").json()["tenants"]}
    assert _metric(url, "sglang:tenant_rejected_requests_total", tenant=labels["initech"]) == 1


def _poll_for(send, tries: int = 50):
    """``send()`` until it is not a 200 (the held request may not have reached the gate yet)."""
    for _ in range(tries):
        resp = send()
        if resp.status_code != 200:
            return resp
    return resp


def _metric(url: str, name: str, **labels) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.split()[-1])
    raise AssertionError(f"{name} {labels} missing")


def test_per_tenant_hit_metrics_carry_digest_labels_and_no_secret(worker, caplog):
    _, url = worker
    info = httpx.get(f"{url}/server_info").json()
    labels = {t["name"]: t["label"] for t in info["tenants"]}
    assert labels["acme"] == labels["acme-eu"] != labels["globex"]
    assert all(re.fullmatch(r"[0-9a-f]{12}", v) for v in labels.values())
    prompt = [17] * 40 + PROMPT[:120]  # shares no page with the other tests
    before = _metric(url, "sglang:tenant_cached_tokens_total", tenant=labels["globex"], cache_source="device")
    _generate(url, "sk-globex-7a8b", prompt)
    _generate(url, "sk-globex-7a8b", prompt)
    after = _metric(url, "sglang:tenant_cached_tokens_total", tenant=labels["globex"], cache_source="device")
    assert after - before == (len(prompt) - 1) // PAGE * PAGE
    metrics = httpx.get(f"{url}/metrics").text
    exposed = metrics + json.dumps(info) + caplog.text
    for secret in [*SECRETS, tenant_salt("acme", None), tenant_salt("globex", None)]:
        assert f'"{secret}"' not in exposed and f"={secret}" not in exposed
    assert all(k not in exposed for k in SECRETS)


def test_tenant_keys_file_errors_name_the_flag_and_never_a_key(tiny_model_dir, tiny_runner, tmp_path):
    bad = tmp_path / "t.json"
    for content, expected in (
        ({"tenants": {"a": {"api_keys": []}}}, "tenants.a.api_keys"),
        ({"tenants": {"a": {"api_keys": ["sk-dup"]}, "b": {"api_keys": ["sk-dup"]}}}, "listed twice"),
        ({"tenants": {"a": {"api_keys": ["sk-x"], "max_request": 2}}}, "unknown field 'max_request'"),
    ):
        bad.write_text(json.dumps(content))
        args = parse_args(["--model-path", str(tiny_model_dir), "--tenant-keys-file", str(bad)])
        with pytest.raises(ArgumentError, match="--tenant-keys-file") as err:
            build_engine(args, runner=tiny_runner)
        assert expected in str(err.value) and "sk-" not in str(err.value)


@pytest.mark.parametrize("kind", ["smg", "sglang-router"])
def test_through_the_router_each_key_keeps_its_tenants_cache(worker, kind, request):
    if kind == "sglang-router":
        request.getfixturevalue("sglang_router_env")
    _, url = worker
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    router = subprocess.Popen(
        router_command(worker_args([url]), port, free_port(), kind=kind),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_router(router_url)
        prompt = [23 if kind == "smg" else 29] * 30 + PROMPT[:130]  # shares no page with the other tests
        aligned = (len(prompt) - 1) // PAGE * PAGE
        cold, hit = _generate(router_url, "sk-globex-7a8b", prompt)
        assert hit == 0
        assert _generate(router_url, "sk-acme-1a2b", prompt) == (cold, 0)
        assert _generate(router_url, "sk-globex-7a8b", prompt) == (cold, aligned)
        assert _generate(router_url, "sk-acme-eu-5e6f", prompt) == (cold, aligned)
    finally:
        router.terminate()
        router.wait(timeout=20)


def _wait_router(url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/readiness", timeout=2).status_code == 200
            if ready and httpx.get(f"{url}/workers", timeout=2).json().get("workers"):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("router did not become ready")
