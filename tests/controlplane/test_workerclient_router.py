"""``RouterClient`` against a real smg 1.13.0 and a real engine worker: smg removes a worker in two steps
(DELETE answers 202, then it lists the worker as ``draining`` for about 5 s), so the client's listing leaves a
draining worker out, a re-add right after the removal waits for the entry to go and registers the worker
again, and a repeated add is safe. The router names itself (kind and version)."""

import time

import httpx
import pytest

from controlplane.workerclient import RouterClient
from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    with (
        ServerProcess(["--model-path", str(tiny_model_dir), "--page-size", "16"]) as worker,
        RouterProcess(worker_args([worker.url]), min_workers=1) as router,
    ):
        yield worker.url, router.url


def _raw(router_url: str) -> list[dict]:
    return httpx.get(f"{router_url}/workers", timeout=5).json()["workers"]


def _wait_ready(client: RouterClient, url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = client.find_worker(url)
        if entry is not None and entry.get("status") == "ready":
            return entry
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready in the router within {timeout} s")


def test_the_router_names_itself(fleet):
    ident = RouterClient(fleet[1], timeout=5).identify()
    assert (ident.kind, ident.version, ident.salt_dropped) == ("smg", "1.13.0", [])


def test_a_removed_worker_is_unlisted_at_once_and_can_be_added_back_right_away(fleet):
    worker, router = fleet
    client = RouterClient(router, timeout=5)
    assert client.remove_worker(worker) is True
    assert [w["status"] for w in _raw(router)] == ["draining"]  # smg still lists it, selected no more
    assert client.list_workers() == [] and client.find_worker(worker) is None
    assert client.remove_worker(worker) is False  # safe to repeat
    client.add_worker(worker)  # waits for the draining entry to go, then posts
    entry = _wait_ready(client, worker)
    assert entry["worker_type"] == "regular" and entry["is_healthy"]
    routed = httpx.post(f"{router}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert routed.status_code == 200, routed.text


def test_adding_a_worker_twice_is_safe(fleet):
    worker, router = fleet
    client = RouterClient(router, timeout=5)
    client.add_worker(worker)  # listed already: nothing to do
    assert len(_raw(router)) == 1
    client.remove_worker(worker)
    client.add_worker(worker)
    client.add_worker(worker)  # its registration may still be under way: smg's 409 is taken as done
    _wait_ready(client, worker)
    assert [w["url"] for w in _raw(router)] == [worker]
