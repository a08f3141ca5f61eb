"""Issue 4 at the engine level: SmolLM2 engine servers (real processes, real HTTP) sharing L3 through one
real Mooncake master.

A serves a long shared prefix; B, started fresh, serves it from Mooncake with A's exact greedy output; B
detaches (served from L1, L2 and recompute) and re-attaches with the seed's PUT body; a runtime attach onto
a ``layer_first`` host pool is a 400 that changes nothing while start-up corrects it; configuration errors
and an unreachable master stop start-up naming the key or address; a master killed mid-run turns into
recomputed requests and counted storage errors, never a hang.

The tests run in file order and share the module's master and servers; the killed-master test is last.
Every Mooncake segment is the seed's ``"4gb"``: the store maps it lazily, so an engine's resident memory
stays about 1.3 GB (model, pools) and the few pages written here are all the segment memory touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.fleet.mooncake_master import MooncakeMaster
from engine.ports import free_port
from engine.server.metrics import EngineMetrics

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvfleet-admin-test"
PAGE = 16
NEW_TOKENS = 8
REQUEST_TIMEOUT = 120.0
START_TIMEOUT = 300.0  # three SmolLM2 servers starting at once on 2 busy cores took ~90 s
# 332 SmolLM2 tokens: the page-aligned prefix (320) clears the seed's prefetch_threshold of 256.
PREFIX = "".join(
    f"Entry {i}: the harbour of town {i} traded grain, wine and olive oil with the towns along the coast. "
    for i in range(13)
)
PROMPT = PREFIX + "Question: what did the harbour of town 7 trade? Answer:"
# ~250 tokens; with a 512-token L1 serving it evicts PROMPT's KV to L2.
OTHER = "".join(
    f"Day {i} of the voyage: the ship sailed north past island {i} in fair weather. " for i in range(14)
)


def mooncake_extra(master: MooncakeMaster, **override) -> dict:
    """The seed's Mooncake extra config with this run's local master and metadata server."""
    extra = {
        "master_server_address": master.master_address,
        "metadata_server": master.metadata_url,
        "protocol": "tcp",
        "global_segment_size": "4gb",
        "prefetch_threshold": 256,
    }
    extra.update(override)
    return extra


def seed_put_body(master: MooncakeMaster) -> dict:
    """The seed's runtime attach body, verbatim in shape, with local addresses."""
    return {
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config_json": json.dumps(mooncake_extra(master)),
        "hicache_storage_prefetch_policy": "timeout",
    }


def engine_flags(*extra_flags: str) -> list[str]:
    return ["--model-path", "smollm2", "--page-size", str(PAGE), "--max-total-tokens", "512",
            "--enable-hierarchical-cache", "--enable-metrics", "--admin-api-key", ADMIN_KEY,
            *extra_flags]  # fmt: skip


def mooncake_engine_flags(master: MooncakeMaster) -> list[str]:
    return engine_flags(
        "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(mooncake_extra(master)),
        "--hicache-storage-prefetch-policy", "wait_complete",
    )  # fmt: skip


def generate(server: ServerProcess, text: str) -> dict:
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": text, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}},
        timeout=REQUEST_TIMEOUT,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop"), out
    return out


def admin(server: ServerProcess, method: str, path: str, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=60)


def server_info(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


def wait_idle(server: ServerProcess, timeout: float = 60.0) -> None:
    """Until no request runs or waits and no cache I/O (L2/L3 backups, prefetches) is in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server_info(server)
        if info["is_idle"] and not any(info["inflight_cache_io"].values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{server.url} not idle after {timeout}s: {server_info(server)}")


def flush(server: ServerProcess) -> None:
    wait_idle(server)
    r = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text


def metric(server: ServerProcess, name: str) -> float:
    """Sum of a metric's samples in ``/metrics`` (all label sets)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0] == name]
    assert values, f"{name} not exported"
    return sum(values)


def aligned(out: dict) -> int:
    """Tokens of the prompt a cache can hold: full pages of all but the last prompt token."""
    return (out["meta_info"]["prompt_tokens"] - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


@pytest.fixture(scope="module")
def servers(master):
    """A and B (Mooncake at start-up, asking for layer_first), C (layer_first, no L3); started at once."""
    procs = {
        "a": ServerProcess(mooncake_engine_flags(master), timeout=START_TIMEOUT),
        "b": ServerProcess(mooncake_engine_flags(master), timeout=START_TIMEOUT),
        "c": ServerProcess(engine_flags("--hicache-mem-layout", "layer_first"), timeout=START_TIMEOUT),
    }
    with ThreadPoolExecutor(len(procs)) as pool:
        started = {name: pool.submit(p.__enter__) for name, p in procs.items()}
        errors = [f.exception() for f in started.values()]
    try:
        assert not any(errors), errors
        yield procs
    finally:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda p: p.__exit__(None, None, None), procs.values()))


@pytest.fixture(scope="module")
def reference(servers) -> dict:
    """A's greedy outputs (A computes PROMPT first, so its pages reach L3 before B asks)."""
    a = servers["a"]
    prompt = generate(a, PROMPT)
    assert prompt["meta_info"]["cached_tokens_details"]["storage"] == 0
    other = generate(a, OTHER)
    wait_idle(a)
    return {"prompt": prompt, "other": other}


def test_fresh_instance_serves_the_prefix_another_computed_from_mooncake(servers, reference):
    a, b = servers["a"], servers["b"]
    assert metric(a, "sglang:backuped_tokens_total") >= aligned(reference["prompt"])
    assert metric(b, "sglang:cached_tokens_total") == 0, "B starts with empty L1/L2"

    out = generate(b, PROMPT)
    details = out["meta_info"]["cached_tokens_details"]
    assert details == {"device": 0, "host": 0, "storage": aligned(out)}
    assert out["output_ids"] == reference["prompt"]["output_ids"]
    assert out["text"] == reference["prompt"]["text"]
    assert metric(b, "sglang:prefetched_tokens_total") == aligned(out)
    assert metric(b, "sglang:hicache_storage_errors_total") == 0


def test_detach_serves_from_l1_l2_and_recompute_then_seed_attach_hits_again(servers, master, reference):
    b = servers["b"]
    expected = reference["prompt"]
    generate(b, PROMPT)  # in B's L1 (from the previous test or recomputed here)
    wait_idle(b)

    r = admin(b, "DELETE", "/hicache/storage-backend")
    assert r.status_code == 200 and "detached" in r.text
    assert admin(b, "GET", "/hicache/storage-backend").json()["hicache_storage_backend"] is None
    assert server_info(b)["hicache"]["hicache_storage_backend"] is None

    l1 = generate(b, PROMPT)
    assert l1["meta_info"]["cached_tokens_details"]["device"] == aligned(l1)
    assert l1["output_ids"] == expected["output_ids"]

    other = generate(b, OTHER)  # needs PROMPT's L1 pages: they move to L2
    assert other["output_ids"] == reference["other"]["output_ids"]
    wait_idle(b)
    l2 = generate(b, PROMPT)
    assert l2["meta_info"]["cached_tokens_details"]["host"] > 0
    assert l2["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert l2["output_ids"] == expected["output_ids"]

    flush(b)
    recomputed = generate(b, PROMPT)
    assert recomputed["meta_info"]["cached_tokens"] == 0, "detached: nothing comes from Mooncake"
    assert recomputed["output_ids"] == expected["output_ids"]

    body = seed_put_body(master)
    wait_idle(b)
    r = admin(b, "PUT", "/hicache/storage-backend", body)
    assert r.status_code == 200 and "attached" in r.text, r.text
    view = admin(b, "GET", "/hicache/storage-backend").json()
    assert view["hicache_storage_backend"] == "mooncake"
    assert view["hicache_storage_backend_extra_config"] == body["hicache_storage_backend_extra_config_json"]
    assert view["hicache_storage_prefetch_policy"] == "timeout"
    live = server_info(b)["hicache"]
    assert live["prefetch_threshold"] == 256 and live["hicache_storage_prefetch_policy"] == "timeout"

    flush(b)
    again = generate(b, PROMPT)
    # the timeout policy may commit a partial prefetch on a loaded machine, hence > 0 rather than all pages
    assert again["meta_info"]["cached_tokens_details"]["storage"] > 0, "pages kept by detach"
    assert again["output_ids"] == expected["output_ids"]


def test_layer_first_corrected_at_start_and_refused_at_runtime(servers, master):
    a, c = servers["a"], servers["c"]
    info = server_info(a)
    assert info["hicache_mem_layout"] == "page_first_direct"  # asked for layer_first
    assert info["hicache"]["hicache_mem_layout"] == "page_first_direct"
    assert "switching hicache_mem_layout to page_first_direct" in a.log_tail(200_000)

    before = server_info(c)
    assert before["hicache"]["hicache_mem_layout"] == "layer_first"
    r = admin(c, "PUT", "/hicache/storage-backend", seed_put_body(master))
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("Failed to attach") and "page_first or page_first_direct" in message
    assert admin(c, "GET", "/hicache/storage-backend").json() == {
        "hicache_storage_backend": None,
        "hicache_storage_backend_extra_config": None,
        "hicache_storage_prefetch_policy": "best_effort",
        "hicache_write_policy": "write_through",
    }
    assert server_info(c)["hicache"] == before["hicache"]
    assert generate(c, "The capital of France is")["text"]


def _launch(extra: dict, env: dict) -> subprocess.Popen:
    flags = engine_flags(
        "--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--port", str(free_port()),
    )  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "engine.launch_server", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_startup_config_errors_and_unreachable_master_name_the_key_or_address(master):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKE_", "SGLANG_HICACHE_MOONCAKE"))}
    dead = f"127.0.0.1:{free_port()}"
    local = {"master_server_address": master.master_address, "metadata_server": master.metadata_url}
    cases = {
        "global_segment_size: cannot parse size '4zb'": {**local, "global_segment_size": "4zb"},
        "master_server_address: no Mooncake master configured": {},
        "protocol: read only when this extra config names master_server_address": {"protocol": "tcp"},
        "segment_size: unknown Mooncake config key": {**local, "segment_size": "4gb"},
        "protocol: expected a string, got int": {**local, "protocol": 5},
        f"Mooncake master {dead} is unreachable": {"master_server_address": dead, "protocol": "tcp"},
    }
    procs = {message: _launch(extra, env) for message, extra in cases.items()}
    for message, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=240)
        finally:
            proc.kill()
        assert proc.returncode == 2, stderr[-2000:]
        error = stderr.strip().splitlines()[-1]
        assert error.startswith("engine.launch_server: error:") and message in error, stderr[-2000:]


def test_killed_master_turns_into_recompute_and_counted_errors(servers, master, reference):
    b = servers["b"]
    wait_idle(b)
    errors_before = metric(b, "sglang:hicache_storage_errors_total")
    master.kill()
    flush(b)

    started = time.monotonic()
    out = generate(b, PROMPT)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == reference["prompt"]["output_ids"]
    other = generate(b, OTHER)
    assert other["output_ids"] == reference["other"]["output_ids"]
    wait_idle(b, timeout=60)
    assert time.monotonic() - started < 90, "a dead store must not stall the scheduler"

    assert metric(b, "sglang:hicache_storage_errors_total") > errors_before
    assert httpx.get(f"{b.url}/health", timeout=10).status_code == 200
    assert server_info(b)["hicache"]["hicache_storage_backend"] == "mooncake"


def test_hit_query_on_a_dead_store_is_a_counted_storage_error():
    """The backend's own error count reaches ``sglang:hicache_storage_errors_total``: a hit query on a dead
    store returns 0 hits without raising, so the cache alone would see a plain miss."""
    with MooncakeMaster() as own_master:
        extra = mooncake_extra(own_master, global_segment_size="16mb", local_buffer_size="4mb")
        config = HiCacheConfig(
            ratio=4.0, storage_backend="mooncake", extra_config=extra, prefetch_policy="wait_complete"
        )
        cache = HiRadixCache(DeviceKVPool(64, 4, 2, 2, 4), config, model_name="m")
        metrics = EngineMetrics("m", lambda: {"cache_stats": cache.stats.snapshot(), "hicache": {}})
        try:
            cache.update_policies(prefetch_threshold=4)
            own_master.kill()
            tokens = list(range(100, 132))
            cache.prefetch_from_storage("r", cache.match_prefix(tokens).last_host_node, tokens)
            deadline = time.monotonic() + 30
            while not cache.check_prefetch_progress("r"):
                assert time.monotonic() < deadline, "prefetch did not finish"
                time.sleep(0.01)
            assert cache.pop_prefetch_loaded_tokens("r") == 0
            stats = cache.stats.snapshot()
            assert stats["storage_errors"] == 0 and stats["backend_errors"] >= 1
            exported = f'sglang:hicache_storage_errors_total{{model_name="m"}} {stats["backend_errors"]:.1f}'
            assert exported in metrics.render().decode()

            cache.drain_io()
            cache.storage.detach()
            assert cache.stats.snapshot()["backend_errors"] == stats["backend_errors"], "kept after detach"
        finally:
            cache.close()
