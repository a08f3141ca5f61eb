"""A "Mooncake master" that accepts TCP connections but never answers (issue 15): start-up fails at once
naming the address instead of hanging, and a runtime attach to it is a 400 naming the address while the
SmolLM2 worker keeps serving /health and /generate (real processes over HTTP)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

ADMIN_KEY = "kvfleet-admin-test"
HICACHE = ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first", "--page-size", "16"]


@pytest.fixture(scope="module")
def silent_master():
    """A listening socket nobody reads: the kernel completes the handshakes, nothing ever answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as sock:
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _extra(address: str) -> str:
    return json.dumps(
        {"master_server_address": address, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
         "global_segment_size": "16mb", "local_buffer_size": "4mb"}
    )  # fmt: skip


def test_start_up_against_a_silent_master_fails_naming_it(silent_master):
    flags = ["--model-path", "smollm2", "--max-total-tokens", "1024", *HICACHE,
             "--hicache-storage-backend", "mooncake",
             "--hicache-storage-backend-extra-config", _extra(silent_master)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "engine.launch_server", *flags], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert silent_master in done.stderr and "does not answer" in done.stderr


def test_runtime_attach_to_a_silent_master_is_a_400_and_the_worker_keeps_serving(silent_master):
    flags = ["--model-path", "smollm2", "--max-total-tokens", "1024", *HICACHE, "--admin-api-key", ADMIN_KEY]
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        result: dict = {}

        def attach():
            result["resp"] = client.put(
                "/hicache/storage-backend",
                json={"hicache_storage_backend": "mooncake",
                      "hicache_storage_backend_extra_config_json": _extra(silent_master)},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )  # fmt: skip

        thread = threading.Thread(target=attach)
        thread.start()
        assert client.get("/health").status_code == 200
        gen = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert gen.status_code == 200
        thread.join(60)
        resp = result["resp"]
        assert resp.status_code == 400 and silent_master in resp.text and "does not answer" in resp.text
        assert client.get("/server_info").json()["hicache"]["hicache_storage_backend"] is None
        assert client.get("/health_generate").status_code == 200
