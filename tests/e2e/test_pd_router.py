"""PD end to end: SmolLM2 prefill (P) and decode (D) workers behind the real router (smg) in PD mode, KV
moved over Mooncake's TransferEngine (TCP), against an aggregated worker with the same flags.

One module-scoped fleet (aggregated A, P1, D, router R1) serves every test; the 2P1D test adds P2 and a second
router and kills P2 with SIGKILL, so it runs last.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.bench.pd_peer import PeerProcess
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = pytest.mark.slow

COMMON = ["--model-path", "smollm2", "--page-size", "16", "--enable-metrics", "--random-seed", "0"]
P_FLAGS = [*COMMON, "--max-total-tokens", "384", "--enable-hierarchical-cache", "--hicache-ratio", "4"]
D_FLAGS = [*COMMON, "--max-total-tokens", "2048", "--disaggregation-mode", "decode"]
D_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
FAIL_BOUND_S = 30.0  # a request whose P died ends within this (heartbeat 2 s x 2 misses, plus scheduling)
SP = {"max_new_tokens": 10, "temperature": 0}
START_S = 600.0  # a worker's start-up (model load) on a loaded 2-core machine


def _prefill(bootstrap_port: int) -> ServerProcess:
    return ServerProcess(
        [
            *P_FLAGS,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ],
        timeout=START_S,
    )


def _start(*procs):
    """Enter each ServerProcess in turn (in parallel they only compete for the same cores)."""
    for proc in procs:
        proc.__enter__()
    return procs


def _router(prefills: list[tuple[str, int]], decode: str, *extra: str) -> RouterProcess:
    workers = ["--pd-disaggregation", "--policy", "cache_aware"]
    for url, bp in prefills:
        workers += ["--prefill", url, str(bp)]
    return RouterProcess([*workers, "--decode", decode], extra=extra)


@pytest.fixture(scope="module")
def pd_fleet():
    bp = free_port()
    agg, p1, d = ServerProcess(P_FLAGS, timeout=START_S), _prefill(bp), ServerProcess(D_FLAGS, START_S, D_ENV)
    try:
        _start(agg, p1, d)
        with _router([(p1.url, bp)], d.url) as router:
            yield {"agg": agg, "p1": p1, "bp1": bp, "d": d, "router": router.url}
    finally:
        for proc in (agg, p1, d):
            proc.__exit__(None, None, None)


def _gen(url: str, text: str, **extra) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"text": text, "sampling_params": SP, **extra}, timeout=120)


def _used_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sglang:num_used_tokens{"):
            return float(line.split()[-1])
    raise AssertionError("sglang:num_used_tokens missing")


def _wait_clean(*urls: str, timeout: float = FAIL_BOUND_S) -> None:
    """Each worker is idle and holds no KV slot for a request (pool usage back to baseline)."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while not (httpx.get(f"{url}/server_info", timeout=10).json()["is_idle"] and _used_tokens(url) == 0):
            assert time.monotonic() < deadline, f"{url} still busy or holding KV after {timeout} s"
            time.sleep(0.2)


def _prefill_holds_unsent_kv(url: str) -> bool:
    """A prefill worker's scheduler still holds a request (queued, bootstrapping, in its prefill or sending
    its KV), not only the HTTP answer of one whose KV is already with the decode."""
    info = httpx.get(f"{url}/server_info", timeout=10).json()
    return info["num_waiting_reqs"] + info["num_running_reqs"] + info["num_pd_transfer_reqs"] > 0


def _text(i: int, n: int = 90) -> str:
    rng = random.Random(i)
    words = ["alpha", "river", "stone", "cloud", "maple", "signal", "copper", "lantern", "harbor", "violet"]
    return f"Story {i}: " + " ".join(rng.choice(words) for _ in range(n))


def _sse(resp: httpx.Response) -> list[dict]:
    frames = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            frames.append(json.loads(line[6:]))
    return frames


def test_server_info_types_the_workers(pd_fleet):
    p = httpx.get(f"{pd_fleet['p1'].url}/server_info").json()
    d = httpx.get(f"{pd_fleet['d'].url}/server_info").json()
    assert (p["disaggregation_mode"], p["disaggregation_bootstrap_port"]) == ("prefill", pd_fleet["bp1"])
    assert p["disaggregation_transfer_backend"] == "mooncake" and d["disaggregation_mode"] == "decode"


def test_generate_through_router_equals_aggregated_with_p_side_l1_and_l2_hits(pd_fleet):
    router, agg = pd_fleet["router"], pd_fleet["agg"].url
    x = _text(1)
    others = [_text(i) for i in range(2, 6)]
    # X computed, then hit in P's L1; then pushed out of L1 (into L2) by others; then hit in P's L2.
    order = [x, x, *others, x]
    details = []
    for text in order:
        want = _gen(agg, text).json()
        got = _gen(router, text)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want["output_ids"]
        details.append(got.json()["meta_info"]["cached_tokens_details"])  # P's, reported by D
    assert details[0] == {"device": 0, "host": 0, "storage": 0}
    assert details[1]["device"] > 0
    assert details[-1]["host"] > 0
    _wait_clean(pd_fleet["p1"].url, pd_fleet["d"].url)


def test_streaming_and_openai_routes_through_router_equal_aggregated(pd_fleet):
    router, agg = pd_fleet["router"], pd_fleet["agg"].url
    text = _text(7, 40)
    want = _gen(agg, text).json()["output_ids"]
    with httpx.stream(
        "POST", f"{router}/generate", json={"text": text, "sampling_params": SP, "stream": True}, timeout=120
    ) as resp:
        assert resp.status_code == 200
        frames = _sse(resp)
    assert frames[-1]["output_ids"] == want

    comp = {"model": "smollm2", "prompt": text, "max_tokens": 10, "temperature": 0}
    chat = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 10,
        "temperature": 0,
    }
    for route, body, pick in (
        ("/v1/completions", comp, lambda c: c.get("text", "")),
        (
            "/v1/chat/completions",
            chat,
            lambda c: (c.get("message") or c.get("delta") or {}).get("content") or "",
        ),
    ):
        expected = pick(httpx.post(f"{agg}{route}", json=body, timeout=120).json()["choices"][0])
        got = httpx.post(f"{router}{route}", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert pick(got.json()["choices"][0]) == expected and expected
        with httpx.stream("POST", f"{router}{route}", json={**body, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            streamed = "".join(pick(f["choices"][0]) for f in _sse(resp) if f.get("choices"))
        assert streamed == expected
    _wait_clean(pd_fleet["p1"].url, pd_fleet["d"].url)


def test_n_samples_through_router_equal_aggregated_streamed_or_not(pd_fleet):
    """The router sends n > 1 as lists of n rooms; each sample is its own PD request."""
    router, agg = pd_fleet["router"], pd_fleet["agg"].url
    text = _text(8, 30)
    want = _gen(agg, text).json()["output_ids"]
    got = httpx.post(
        f"{router}/generate", json={"text": text, "sampling_params": {**SP, "n": 2}}, timeout=120
    )
    assert got.status_code == 200, got.text
    assert [r["output_ids"] for r in got.json()] == [want, want]
    comp = {"model": "smollm2", "prompt": text, "max_tokens": 10, "temperature": 0, "n": 2}
    expected = httpx.post(f"{agg}/v1/completions", json={**comp, "n": 1}, timeout=120).json()
    expected_text = expected["choices"][0]["text"]
    answer = httpx.post(f"{router}/v1/completions", json=comp, timeout=120)
    assert answer.status_code == 200, answer.text
    assert [c["text"] for c in answer.json()["choices"]] == [expected_text, expected_text]
    with httpx.stream("POST", f"{router}/v1/completions", json={**comp, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        texts: dict[int, str] = {}
        for frame in _sse(resp):
            for c in frame.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: expected_text, 1: expected_text}
    _wait_clean(pd_fleet["p1"].url, pd_fleet["d"].url)


def test_logprobs_through_router_equal_aggregated(pd_fleet):
    """P computes the prompt's logprobs and the first token's, D the rest; the router merges P's
    input_token_logprobs into D's answer, D reports the top ones P sent it. Chat logprobs come from D alone.
    A seeded sample equals the aggregated worker's."""
    router, agg = pd_fleet["router"], pd_fleet["agg"].url
    fields = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    want = _gen(agg, _text(40), **fields).json()
    got = _gen(router, _text(40), **fields)
    assert got.status_code == 200, got.text
    got = got.json()
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        mine, theirs = got["meta_info"][key], want["meta_info"][key]
        assert [t for _, t, _ in mine] == [t for _, t, _ in theirs], key
        assert mine[0][0] is None if key.startswith("input") else mine[0][0] is not None
        assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(mine[1:], theirs[1:], strict=True)) < 1e-4
    for key in ("output_top_logprobs", "input_top_logprobs"):  # D sends P's input ones (Mooncake's channel)
        top = got["meta_info"][key]
        assert [e and [t for _, t, _ in e] for e in top] == [
            e and [t for _, t, _ in e] for e in want["meta_info"][key]
        ], key
    seeded = {"text": _text(42, 20), "sampling_params": {"max_new_tokens": 8, "temperature": 1.0,
                                                         "sampling_seed": 5}}  # fmt: skip
    outs = [httpx.post(f"{u}/generate", json=seeded, timeout=120).json()["output_ids"] for u in (agg, router)]
    assert outs[0] == outs[1]  # P's generator state moves to D with the KV
    body = {"model": "smollm2", "messages": [{"role": "user", "content": _text(41, 20)}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    chat = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json() for url in (agg, router)]
    a, b = (c["choices"][0]["logprobs"]["content"] for c in chat)
    assert [x["token"] for x in a] == [x["token"] for x in b] and len(a) == 6
    assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(a, b, strict=True)) < 1e-4
    _wait_clean(pd_fleet["p1"].url, pd_fleet["d"].url)


def test_constrained_output_through_router_matches_its_grammar_and_aggregated(pd_fleet):
    """P picks the first token under the grammar; D rebuilds the grammar from it and goes on: the output
    matches the regex / schema and equals the aggregated worker's (greedy)."""
    router, agg = pd_fleet["router"], pd_fleet["agg"].url
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    cases = [
        ({"regex": r"[A-Z][a-z]{2,9}, [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,9}, [0-9]{4}", t)),
        ({"json_schema": json.dumps(schema)}, lambda t: isinstance(json.loads(t)["city"], str)),
    ]
    for constraint, check in cases:
        sp = {"max_new_tokens": 40, "temperature": 0, **constraint}
        body = {"text": "The capital of France and a year:", "sampling_params": sp}
        want = httpx.post(f"{agg}/generate", json=body, timeout=120).json()
        got = httpx.post(f"{router}/generate", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert check(got.json()["text"]) and got.json()["output_ids"] == want["output_ids"]
    chat = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    got = httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=120)
    assert got.status_code == 200, got.text
    assert isinstance(json.loads(got.json()["choices"][0]["message"]["content"])["city"], str)
    bad = httpx.post(
        f"{router}/generate", json={"text": "x", "sampling_params": {"regex": "[a-"}}, timeout=120
    )
    assert bad.status_code == 400 and "sampling_params.regex" in bad.text
    _wait_clean(pd_fleet["p1"].url, pd_fleet["d"].url)


def test_client_disconnect_on_d_releases_pages_on_both_sides(pd_fleet):
    body = {"text": _text(11), "sampling_params": {"max_new_tokens": 200, "temperature": 0}, "stream": True}
    with httpx.stream("POST", f"{pd_fleet['router']}/generate", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # the first token arrived: D is decoding; hang up
    _wait_clean(pd_fleet["d"].url, pd_fleet["p1"].url)


def test_bad_bootstrap_values_unknown_room_dead_port_and_page_size_mismatch(pd_fleet):
    d, p1 = pd_fleet["d"].url, pd_fleet["p1"].url
    text = _text(21, 20)
    bad = _gen(d, text, bootstrap_host="127.0.0.1", bootstrap_port=70000, bootstrap_room=1)
    assert bad.status_code == 400 and "bootstrap_port" in bad.text
    missing = _gen(d, text)
    assert missing.status_code == 400 and "bootstrap_room" in missing.text
    peer = PeerProcess(
        "mooncake",
        "prefill",
        {"size": 64, "page_size": 8, "layers": 2, "heads": 1, "head_dim": 8},
        bootstrap_port=0,
    )
    dead = free_port()
    cases = {  # what D is told (bootstrap port, room) -> what its error must name
        "unknown room": (pd_fleet["bp1"], 424242, "bootstrap room 424242 is unknown"),
        "dead port": (dead, 1, f"127.0.0.1:{dead} unreachable"),
        "page size": (peer.bootstrap_port, 2, "page_size mismatch"),
    }
    try:
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            futures = {
                name: pool.submit(
                    _gen, d, text, bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room
                )
                for name, (port, room, _) in cases.items()
            }
            for name, (_, _, message) in cases.items():
                resp = futures[name].result()
                assert resp.status_code == 500, (name, resp.text)
                assert message in resp.json()["error"]["message"], (name, resp.text)
    finally:
        peer.close()
    _wait_clean(d, p1)


def test_2p1d_both_prefills_serve_and_a_killed_prefill_fails_only_its_requests(pd_fleet):
    bp2 = free_port()
    (p2,) = _start(_prefill(bp2))
    router = _router(
        [(pd_fleet["p1"].url, pd_fleet["bp1"]), (p2.url, bp2)],
        pd_fleet["d"].url,
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "1",
        "--disable-retries",  # a retry would re-pair the failed request with P1 and hide the failure
    )
    url = router.url
    try:
        texts = [_text(100 + i) for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert all(r.status_code == 200 for r in pool.map(lambda t: _gen(url, t), texts))
        p2_info = httpx.get(f"{p2.url}/metrics").text
        assert any(
            line.startswith("sglang:num_requests_total{") and float(line.split()[-1]) > 0
            for line in p2_info.splitlines()
        ), "P2 took no request"

        # Long requests in flight, one more each round until P2's scheduler holds one (the router picks the
        # prefill, so any fixed number may all land on P1); then SIGKILL P2. Not merely "not idle": a request
        # whose KV already reached D counts until P2's HTTP answer is sent, and under load the kill could land
        # in that tail, after which D finishes the request (the test passed alone and failed in a CI run).
        long_sp = {"max_new_tokens": 60, "temperature": 0}
        pool = concurrent.futures.ThreadPoolExecutor(24)
        started = time.monotonic()
        futures = []
        while not _prefill_holds_unsent_kv(p2.url):
            assert len(futures) < 24 and time.monotonic() - started < 60, "P2 never got a request"
            body = {"text": _text(200 + len(futures)), "sampling_params": long_sp}
            futures.append(pool.submit(httpx.post, f"{url}/generate", json=body, timeout=120))
            time.sleep(0.2)  # pacing between submissions, not a wait for a state
        p2.proc.kill()
        results = [f.result() for f in futures]
        pool.shutdown()
        failed = [r for r in results if r.status_code != 200]
        assert failed, "no request was on the killed prefill"
        assert time.monotonic() - started < 60 + FAIL_BOUND_S
        _wait_clean(
            pd_fleet["d"].url, pd_fleet["p1"].url
        )  # D freed the pages it had reserved for P2's requests
        assert f"prefill bootstrap 127.0.0.1:{bp2} failed heartbeat" in pd_fleet["d"].log_tail(200_000)

        deadline = time.monotonic() + 30  # the router's health check drops P2; later requests go to P1
        while True:
            after = _gen(url, _text(300))
            if after.status_code == 200:
                break
            assert time.monotonic() < deadline, after.text
        for i in range(3):
            resp = _gen(url, _text(301 + i))
            assert resp.status_code == 200, resp.text
            assert resp.json()["output_ids"] == _gen(pd_fleet["agg"].url, _text(301 + i)).json()["output_ids"]
        _wait_clean(pd_fleet["d"].url, pd_fleet["p1"].url)
    finally:
        router.close()
        p2.__exit__(None, None, None)
