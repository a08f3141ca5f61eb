"""A Mooncake master that stops answering while a SmolLM2 worker uses it (issue 15): SIGSTOPped, it keeps
its connections and accepts new ones but answers nothing, so each store call waits out the client's RPC
timeout (~30 s). An admin clear or detach against it must not stall serving: /health and /generate answer
while the clear waits on the store (before, the clear ran on the scheduler thread and every request waited
behind it), and the worker ends attached and usable once the master is back (real processes over HTTP)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.mooncake_master import MooncakeMaster

pytestmark = pytest.mark.slow

KEY = "kvfleet-admin-test"
ADMIN = {"Authorization": f"Bearer {KEY}"}
TWO = {"max_new_tokens": 2, "ignore_eos": True}  # sampled: EOS could end it after one token
GEN = {"text": "Tell me about the harbour. " * 8, "sampling_params": TWO}


@pytest.fixture
def worker_and_master():
    with MooncakeMaster() as master:
        extra = {"master_server_address": master.master_address, "metadata_server": master.metadata_url,
                 "protocol": "tcp", "global_segment_size": "16mb", "local_buffer_size": "4mb"}  # fmt: skip
        flags = ["--model-path", "smollm2", "--max-total-tokens", "1024", "--enable-hierarchical-cache",
                 "--hicache-mem-layout", "page_first", "--page-size", "16", "--admin-api-key", KEY,
                 "--hicache-storage-backend", "mooncake",
                 "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
        with ServerProcess(flags) as server:
            try:
                yield server, master
            finally:
                os.kill(master.process.pid, signal.SIGCONT)


def _in_background(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(resp=fn()), daemon=True)
    thread.start()
    return thread, out


def _wait_quiet(client: httpx.Client) -> None:
    """Until nothing runs and no cache I/O is in flight: a backup still going to the master as it stops would
    hold the worker busy, and the idle-gated clear/detach would be refused rather than wait on the store."""
    deadline = time.monotonic() + 120
    while True:
        info = client.get("/server_info").json()
        if info["is_idle"] and not any(info["inflight_cache_io"].values()):
            return
        assert time.monotonic() < deadline, f"worker never quiet: {info['inflight_cache_io']}"
        time.sleep(0.05)


def test_clear_and_detach_against_a_stopped_master_leave_the_worker_serving(worker_and_master):
    server, master = worker_and_master
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.post("/generate", json=GEN).status_code == 200
        threshold = client.get("/hicache/config", headers=ADMIN).json()["prefetch_threshold"]
        _wait_quiet(client)
        os.kill(master.process.pid, signal.SIGSTOP)
        clear, cleared = _in_background(lambda: client.post("/hicache/storage-backend/clear", headers=ADMIN))

        def clear_running() -> bool:  # an idle-gated admin call is refused while the clear waits on the store
            resp = client.put("/hicache/config", json={"prefetch_threshold": threshold}, headers=ADMIN)
            return resp.status_code == 400 and "a clear of storage backend 'mooncake' is running" in resp.text

        deadline = time.monotonic() + 60
        while not clear_running():
            assert time.monotonic() < deadline, "the clear was not seen running"
            time.sleep(0.05)
        assert client.get("/health").status_code == 200
        gen = client.post("/generate", json={**GEN, "text": "Another question about ships."})
        assert gen.status_code == 200 and gen.json()["meta_info"]["completion_tokens"] == 2
        assert clear.is_alive()  # served while the clear still waited on the stopped master
        os.kill(master.process.pid, signal.SIGCONT)
        clear.join(120)
        resp = cleared["resp"]
        assert resp.status_code == 200 or (resp.status_code == 400 and master.master_address in resp.text)
        assert (
            client.get("/hicache/storage-backend", headers=ADMIN).json()["hicache_storage_backend"]
            == "mooncake"
        )
        assert client.post("/hicache/storage-backend/clear", headers=ADMIN).status_code == 200

        _wait_quiet(client)
        os.kill(master.process.pid, signal.SIGSTOP)
        detach, detached = _in_background(lambda: client.delete("/hicache/storage-backend", headers=ADMIN))
        assert client.get("/health").status_code == 200
        detach.join(120)
        assert detached["resp"].status_code == 200, detached["resp"].text
        assert client.get("/hicache/storage-backend", headers=ADMIN).json()["hicache_storage_backend"] is None
        assert client.post("/generate", json=GEN).status_code == 200
