"""Cache pages reach L3 in prefix order (issues 11 and 15), on a real SmolLM2 worker over HTTP with the file
L3 backend: after a runtime attach, pages already in L2 are backed up at once; under ``write_back`` a hot
shared system prefix (never an eviction victim itself) reaches L3 with the first evicted leaf under it. Each
is checked the way a user would: flush L1 and L2, resend, and read ``cached_tokens_details.storage``.

The tests share one worker and run in file order (the first attaches the backend the second uses).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer kvfleet-admin-test"}
PAGE = 16
SYSTEM = "".join(  # ~270 SmolLM2 tokens shared by every prompt
    f"Rule {i}: the assistant answers questions about harbour {i} politely and names its sources. "
    for i in range(14)
)


def _question(i: int) -> str:  # ~100 tokens, distinct per i
    return f"Question {i}: " + " ".join(f"cargo{i}x{j} arrived on day {j} of month {i}." for j in range(12))


@pytest.fixture(scope="module")
def worker():
    flags = ["--model-path", "smollm2", "--max-total-tokens", "1024", "--page-size", str(PAGE),
             "--enable-hierarchical-cache", "--hicache-storage-prefetch-policy", "wait_complete",
             "--admin-api-key", "kvfleet-admin-test", "--enable-metrics"]  # fmt: skip
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _generate(client: httpx.Client, text: str) -> dict:
    resp = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4}})
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def _when_idle(client: httpx.Client, method: str, path: str, timeout: float = 60.0) -> None:
    """Call an idle-gated route until it succeeds (it is a 400 while cache I/O such as backups runs)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = client.request(method, path, headers=ADMIN)
        if resp.status_code == 200:
            return
        assert resp.status_code == 400 and "not idle" in resp.text, resp.text
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.05)


def _counter(client: httpx.Client, name: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_pages_in_l2_reach_l3_right_after_a_runtime_attach(worker, tmp_path_factory):
    prompt = SYSTEM + _question(0)
    _generate(worker, prompt)  # write_through: into L1 and L2; no L3 attached yet
    hit = _generate(worker, prompt)["cached_tokens"]
    body = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": json.dumps(
            {"file_path": str(tmp_path_factory.mktemp("l3")), "prefetch_threshold": PAGE}
        ),
        "hicache_write_policy": "write_back",
    }
    deadline = time.monotonic() + 60
    while (resp := worker.put("/hicache/storage-backend", json=body, headers=ADMIN)).status_code != 200:
        assert "not idle" in resp.text and time.monotonic() < deadline, resp.text
        time.sleep(0.05)
    _when_idle(worker, "POST", "/flush_cache")  # L1 and L2 gone: only L3 can serve the prompt now
    again = _generate(worker, prompt)
    assert hit > 400 and again["cached_tokens_details"]["storage"] == hit


def test_write_back_puts_the_shared_prefix_into_l3(worker):
    _when_idle(worker, "POST", "/hicache/storage-backend/clear")
    _when_idle(worker, "POST", "/flush_cache")
    evicted = _counter(worker, "sglang:evicted_tokens_total")
    i = 1
    while _counter(worker, "sglang:evicted_tokens_total") == evicted:  # fill L1 until leaves are evicted
        assert i < 40, "no eviction"
        _generate(worker, SYSTEM + _question(i))
        i += 1
    shared = _generate(worker, SYSTEM + _question(1000))["cached_tokens"]  # the system prompt, from L1
    _when_idle(worker, "POST", "/flush_cache")
    cold = _generate(worker, SYSTEM + _question(1001))
    assert shared >= 256 and cold["cached_tokens_details"]["storage"] == shared
