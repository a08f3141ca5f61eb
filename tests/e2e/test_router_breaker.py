"""One client's bad requests must not become everyone's outage: a real router in front of a real SmolLM2
worker. Sixty prompts longer than the context are each a 400 from the worker. With sglang-router 0.3.2's
defaults they open its circuit breaker (other clients then get 503 "all circuits open"); smg 1.13.0 counts a
4xx as a success, so its breaker stays closed even with its defaults; with KVFleet's ROUTER_FLAGS (what the
demo and compose start) every other client is still served by both. The control plane reads the breaker
state from the router's Prometheus endpoint (both export ``smg_worker_cb_state``), as the console shows it."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from controlplane.inventory.models import Router
from controlplane.inventory.selectors import router_breakers
from engine.bench.launcher import ServerProcess
from engine.fleet.router import ROUTER_FLAGS, router_command, worker_args
from engine.ports import free_port

pytestmark = pytest.mark.slow
CONTEXT = 128
TOO_LONG = " ".join(f"word{i}" for i in range(3 * CONTEXT))  # well over CONTEXT tokens
SP = {"max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def worker():
    flags = ["--model-path", "smollm2", "--context-length", str(CONTEXT), "--max-total-tokens", "1024"]
    with ServerProcess(flags) as server:
        yield server


def _router(worker_url: str, flags: tuple[str, ...], kind: str):
    port, prometheus_port = free_port(), free_port()
    argv = router_command(worker_args([worker_url]), port, prometheus_port, flags=flags, kind=kind)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/workers", timeout=2).json().get("workers"):
                break
        except (httpx.HTTPError, ValueError):
            pass
        assert proc.poll() is None, "router exited"
        time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError("router did not list the worker within 60 s")
    return proc, url, Router(name="r", url=url, metrics_url=f"http://127.0.0.1:{prometheus_port}/metrics")


def _flood_then_serve(router_url: str) -> tuple[list[int], int]:
    """60 over-long prompts from one client (8 at a time), then one ordinary request from another."""

    def bad(_):
        return httpx.post(
            f"{router_url}/generate", json={"text": TOO_LONG, "sampling_params": SP}, timeout=60
        )

    with ThreadPoolExecutor(8) as pool:
        codes = [r.status_code for r in pool.map(bad, range(60))]
    good = httpx.post(f"{router_url}/generate", json={"text": "Hello", "sampling_params": SP}, timeout=60)
    return codes, good.status_code


@pytest.mark.parametrize(
    ("kind", "flags", "served", "breaker"),
    [
        ("smg", (), 200, "closed"),
        ("smg", ROUTER_FLAGS, 200, "closed"),
        ("sglang-router", (), 503, "open"),
        ("sglang-router", ROUTER_FLAGS, 200, "closed"),
    ],
    ids=["smg-defaults", "smg-kvfleet-flags", "sglang-router-defaults", "sglang-router-kvfleet-flags"],
)
def test_client_errors_do_not_open_the_routers_breaker(worker, kind, flags, served, breaker, request):
    if kind == "sglang-router":
        request.getfixturevalue("sglang_router_env")
    proc, url, record = _router(worker.url, flags, kind)
    try:
        codes, good = _flood_then_serve(url)
        assert set(codes) <= {400, 503} and codes.count(400) >= 10  # the worker refused each over-long prompt
        assert good == served
        state = router_breakers(record)
        assert state["reachable"] is True
        assert [(w["url"], w["state"]) for w in state["workers"]] == [(worker.url, breaker)]
        assert state["open"] == (1 if breaker == "open" else 0)
        assert (
            httpx.get(f"{worker.url}/health", timeout=5).status_code == 200
        )  # the worker was fine all along
    finally:
        proc.terminate()
        proc.wait(timeout=20)
