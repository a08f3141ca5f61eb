"""Per-tenant L2 / L3 caps (``l2_max_tokens`` / ``l3_max_pages`` in ``--tenant-keys-file``) on a real
worker over HTTP: a capped tenant never holds more host-pool tokens than its cap (its own older pages make
room, another tenant's stay), it stops being backed up to the file L3 at its page cap, answers stay the same,
and ``/metrics`` and ``/server_info`` show the caps and what they did."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_testlib import ThreadedServer, wait_idle

from engine.server.args import parse_args
from engine.server.builder import build_engine

pytestmark = pytest.mark.slow

PAGE = 16
KEYS = {"capped": "sk-capped-41c2", "free": "sk-free-77d0"}
TENANTS = {
    "capped": {"api_keys": [KEYS["capped"]], "l2_max_tokens": 128, "l3_max_pages": 6},
    "free": {"api_keys": [KEYS["free"]]},
}


def _prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(3, 300) for _ in range(97)]  # 6 whole pages + 1 token


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tiny_runner, tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": TENANTS}))
    extra = json.dumps({"file_path": str(tmp_path_factory.mktemp("l3")), "prefetch_threshold": 16})
    flags = [
        "--model-path", str(tiny_model_dir), "--page-size", str(PAGE), "--max-total-tokens", "2048",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete",
        "--enable-cache-report", "--enable-metrics", "--tenant-keys-file", str(path),
    ]  # fmt: skip
    engine = build_engine(parse_args(flags), runner=tiny_runner)
    with ThreadedServer(engine) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield engine, client
    engine.scheduler.stop()


def _generate(client, tenant: str, prompt: list[int]) -> tuple[list[int], dict]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    resp = client.post("/generate", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"], resp.json()["meta_info"]["cached_tokens_details"]


def _metrics(client, label: str) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("sglang:tenant_") and f'tenant="{label}"' in line and "cached_tokens" not in line:
            out[line.split("{")[0].removeprefix("sglang:")] = float(line.split()[-1])
    return out


def test_a_capped_tenant_stays_under_its_l2_and_l3_caps_and_evicts_only_its_own_pages(worker):
    engine, client = worker
    info = client.get("/server_info").json()
    tenants = {t["name"]: t for t in info["tenants"]}
    assert (tenants["capped"]["l2_max_tokens"], tenants["capped"]["l3_max_pages"]) == (128, 6)
    label = tenants["capped"]["label"]
    first = _generate(client, "capped", _prompt(1))[0]
    free = _generate(client, "free", _prompt(9))[0]
    wait_idle(engine)
    # everything off L1: both tenants' pages are host-only now, the free tenant's the older ones
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    wait_idle(engine)
    for seed in (2, 3):  # each takes the capped tenant over 128 tokens: its own older page goes
        _generate(client, "capped", _prompt(seed))
        wait_idle(engine)
    usage = engine.scheduler.state["tenant_usage"]
    (owned,) = usage.values()
    assert owned["l2_tokens_used"] <= 128 and owned["l2_evicted_tokens"] >= 96
    assert owned["l3_pages_sent"] == 6 and owned["l3_skipped_pages"] >= 6
    # the free tenant's older page was never evicted for the capped one; the capped one's first is gone
    assert _generate(client, "free", _prompt(9)) == (free, {"device": 0, "host": 96, "storage": 0})
    # its first prompt's pages were backed up under the L3 cap: a prefetch brings them back into L2 (making
    # room among its own pages, all off L1 now)
    wait_idle(engine)
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    ids, cached = _generate(client, "capped", _prompt(1))
    assert ids == first and cached == {"device": 0, "host": 0, "storage": 96}
    metrics = _metrics(client, label)
    assert metrics["tenant_l2_cap_tokens"] == 128 and metrics["tenant_l3_cap_pages"] == 6
    assert metrics["tenant_l2_used_tokens"] <= 128 and metrics["tenant_l2_cap_evicted_tokens_total"] >= 96
    assert metrics["tenant_l3_cap_skipped_pages_total"] >= 6 and metrics["tenant_l3_sent_pages"] == 6
