"""``cache_salt`` over HTTP on one worker with a file L3: requests with different salts share no cached KV in
any tier (L1, L2, and L3 after a flush of L1/L2) and still produce the same greedy output; the same salt
gets the hits; both OpenAI routes carry the salt; a bad salt is a 400 naming the field, not echoing it.
Through a real router: smg 1.13.0 carries ``cache_salt`` on /generate, /v1/completions and chat (salts stay
apart) and its answers are the worker's own; sglang-router 0.3.2 drops it on /generate and chat (salts
share cache, the request succeeds) and keeps /generate's ``extra_key``, as engine/fleet/identity.py says."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_testlib import ThreadedServer, wait_idle

from engine.fleet.identity import SALT_ROUTES, identify_router
from engine.fleet.router import RouterProcess, worker_args
from engine.server.args import parse_args
from engine.server.builder import build_engine

pytestmark = pytest.mark.slow

PAGE = 16
PROMPT = [random.Random(24).randrange(3, 300) for _ in range(480)]  # the tiny model has 512 positions
ALIGNED = (len(PROMPT) - 1) // PAGE * PAGE  # the last prompt token is always computed
NONE = {"device": 0, "host": 0, "storage": 0}


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tiny_runner, tmp_path_factory):
    """(engine, httpx.Client) of one hierarchical-cache worker with a file L3, served over HTTP."""
    extra = json.dumps({"file_path": str(tmp_path_factory.mktemp("l3")), "prefetch_threshold": 16})
    flags = [
        "--page-size", str(PAGE), "--max-total-tokens", "2048", "--chunked-prefill-size", "256",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete", "--enable-cache-report",
    ]  # fmt: skip
    engine = build_engine(parse_args(["--model-path", str(tiny_model_dir), *flags]), runner=tiny_runner)
    with ThreadedServer(engine) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield engine, client
    engine.scheduler.stop()


def _generate(client, salt: str | None) -> tuple[list[int], dict]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["output_ids"], out["meta_info"]["cached_tokens_details"]


def _flush(sched):
    sched.require_idle("flush cache")
    sched.cache.reset()


def test_other_salts_miss_every_tier_and_the_same_salt_hits(worker):
    engine, client = worker
    cold, cached = _generate(client, "tenant-a")
    assert cached == NONE
    # L1: tenant-a's pages are on device; another salt recomputes.
    assert _generate(client, "tenant-b") == (cold, NONE)
    ids, cached = _generate(client, "tenant-a")
    assert (ids, cached) == (cold, {"device": ALIGNED, "host": 0, "storage": 0})

    # L2: every device page evicted (write-through backed each up to host).
    wait_idle(engine)
    assert engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30) >= 2 * ALIGNED
    wait_idle(engine)
    assert _generate(client, "tenant-c") == (cold, NONE)
    ids, cached = _generate(client, "tenant-a")
    assert (ids, cached) == (cold, {"device": 0, "host": ALIGNED, "storage": 0})

    # L3: L1 and L2 emptied; the file store holds the pages of every salt computed so far (and no unsalted
    # ones: the salted chains are seeded apart from the plain one).
    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    for other in ("tenant-d", None):
        ids, cached = _generate(client, other)
        assert (ids, cached) == (cold, NONE)
    ids, cached = _generate(client, "tenant-a")
    assert (ids, cached) == (cold, {"device": 0, "host": 0, "storage": ALIGNED})


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_carry_the_salt(worker, route):
    _, client = worker
    if route == "/v1/completions":
        body = {"prompt": PROMPT[:200], "max_tokens": 4, "temperature": 0}
    else:
        body = {"messages": [{"role": "user", "content": "the quick brown fox " * 20}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip

    def cached(salt: str) -> int:
        resp = client.post(route, json={**body, "cache_salt": salt})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    salt = f"openai{route}"
    assert cached(salt) == 0
    assert cached(salt) > 0
    assert cached(salt + "-other") == 0


@pytest.mark.parametrize("salt", ["", 7, "x" * 257])
def test_bad_salt_is_a_400_naming_the_field(worker, salt):
    _, client = worker
    resp = client.post("/generate", json={"input_ids": PROMPT[:20], "cache_salt": salt})
    assert resp.status_code == 400 and "cache_salt" in resp.text
    resp = client.post("/v1/completions", json={"prompt": PROMPT[:20], "cache_salt": salt})
    assert resp.status_code == 400 and "cache_salt" in resp.text
    assert not isinstance(salt, str) or not salt or salt not in resp.text  # a secret: never echoed


@pytest.fixture(scope="module", params=["smg", "sglang-router"])
def router(worker, request):
    """(kind, client) of a real router (KVFleet's flags) in front of the worker: smg 1.13.0, the project's,
    and sglang-router 0.3.2 from its own venv (built on first use by scripts/sglang_router_env.sh, cached).
    Which salt field arrives depends on the router and the route: engine/fleet/identity.py says which, and
    these tests hold it to what the routers do."""
    if request.param == "sglang-router":
        request.getfixturevalue("sglang_router_env")
    _, client = worker
    url = str(client.base_url).rstrip("/")
    with (
        RouterProcess(worker_args([url]), min_workers=1, kind=request.param) as proc,
        httpx.Client(base_url=proc.url, timeout=120) as routed,
    ):
        yield request.param, routed


def _body(client, route: str, text: str, max_tokens: int = 2) -> dict:
    if route == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
    model = client.get("/v1/models").json()["data"][0]["id"]  # the router requires it
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    key = "prompt" if route == "/v1/completions" else "messages"
    body[key] = text if route == "/v1/completions" else [{"role": "user", "content": text}]
    return body


def _routed(client, route: str, tag: str, salt_field: str, salt: str) -> int:
    """Cached prompt tokens of one request through the router carrying ``salt`` in ``salt_field``; the prompt
    is a text (the router takes no token ids on the OpenAI routes) that starts with ``tag``."""
    text = f"{tag}: " + "a lazy dog jumps over the quick fox " * 24
    resp = client.post(route, json={**_body(client, route, text), salt_field: salt})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    if route == "/generate":
        return sum(out["meta_info"]["cached_tokens_details"].values())
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_router_is_identified_with_its_kind_and_version(router):
    kind, client = router
    ident = identify_router(client.get("/get_loads").json())
    assert ident.kind == kind
    assert ident.version == ("1.13.0" if kind == "smg" else "")  # 0.3.2 does not report its version


@pytest.mark.parametrize("route", SALT_ROUTES)
def test_cache_salt_through_the_router_does_what_its_identity_says(router, route):
    """Salts apart where engine/fleet/identity.py says the router carries ``cache_salt`` (smg: every route),
    shared where it says the router drops it (0.3.2: /generate and chat; the request still succeeds)."""
    kind, client = router
    carried = identify_router(client.get("/get_loads").json()).salt_routes[route]
    assert carried is (True if kind == "smg" else route == "/v1/completions")
    tag, salt = f"{kind} {route}", f"routed-{kind}-{route}"
    assert _routed(client, route, tag, "cache_salt", salt) == 0
    other = _routed(client, route, tag, "cache_salt", salt + "-other")
    assert (other == 0) if carried else (other > 0)
    assert _routed(client, route, tag, "cache_salt", salt) > 0


def test_extra_key_on_generate_keeps_salts_apart_through_the_router(router):
    kind, client = router
    tag, salt = f"{kind} extra_key", f"routed-{kind}-extra-key"
    assert _routed(client, "/generate", tag, "extra_key", salt) == 0
    assert _routed(client, "/generate", tag, "extra_key", salt + "-other") == 0
    assert _routed(client, "/generate", tag, "extra_key", salt) > 0


@pytest.mark.parametrize("route", SALT_ROUTES)
def test_outputs_through_the_router_equal_the_workers_own(worker, router, route):
    """Greedy answers through the router are the worker's, byte for byte (text and, on /generate, ids)."""
    _, direct = worker
    kind, client = router
    text = f"{kind} {route} identical: " + "the quick brown fox " * 10
    body = _body(client, route, text, max_tokens=12)
    a, b = direct.post(route, json=body), client.post(route, json=body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    if route == "/generate":
        assert (a.json()["text"], a.json()["output_ids"]) == (b.json()["text"], b.json()["output_ids"])
    elif route == "/v1/completions":
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    else:
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_extra_key_on_generate_is_a_salt_and_must_agree_with_cache_salt(worker):
    _, client = worker
    body = {"input_ids": PROMPT[:20], "sampling_params": {"max_new_tokens": 1}}
    resp = client.post("/generate", json={**body, "extra_key": "k-secret", "cache_salt": "other-secret"})
    assert resp.status_code == 400 and "cache_salt and extra_key differ" in resp.text
    assert "secret" not in resp.text
    resp = client.post("/generate", json={**body, "extra_key": 5})
    assert resp.status_code == 400 and "extra_key" in resp.text
    assert client.post("/generate", json={**body, "extra_key": "k", "cache_salt": "k"}).status_code == 200


def test_through_the_router_a_bad_salt_is_a_400_where_the_salt_arrives(router):
    kind, client = router
    model = client.get("/v1/models").json()["data"][0]["id"]
    resp = client.post(
        "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1, "cache_salt": 5}
    )
    assert resp.status_code == 400 and "cache_salt" in resp.text
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": 5}
    # smg passes the salt on, so the worker refuses it; 0.3.2 drops it, so the request fails open.
    assert client.post("/v1/chat/completions", json=chat).status_code == (400 if kind == "smg" else 200)
