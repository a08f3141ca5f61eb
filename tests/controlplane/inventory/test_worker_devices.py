"""A tensor-parallel worker spans tp devices: the agent registers the GPU indexes its ranks hold, the
inventory keeps them (one per rank, GPUs of its host, never two workers on one), and the API returns them."""

import pytest
from cp_factories import AGENT_HOST

from controlplane.inventory.models import EngineWorker

pytestmark = pytest.mark.django_db

GPU = {"model": "H100", "memory_mib": 81559}
HOST = {"name": AGENT_HOST, "gpus": [{"index": i, **GPU} for i in range(4)]}


def _register(client, workers: list[dict], host: dict = HOST):
    return client.post("/api/v1/agent/register/", {"host": host, "workers": workers}, format="json")


def _worker(name: str, port: int, tp: int, devices: list[int]) -> dict:
    return {"name": name, "url": f"http://10.0.0.9:{port}", "tp_size": tp, "devices": devices}


def test_a_tp2_worker_is_stored_with_the_two_gpus_its_ranks_hold(api_as):
    agent = api_as("agent")
    done = _register(agent, [_worker("tp2", 30000, 2, [2, 3]), _worker("tp1", 30001, 1, [0])])
    assert done.status_code == 200, done.content
    stored = {w.name: (w.tp_size, w.devices) for w in EngineWorker.objects.all()}
    assert stored == {"tp2": (2, [2, 3]), "tp1": (1, [0])}
    listed = api_as("viewer").get("/api/v1/inventory/workers/").json()["results"]
    assert {w["name"]: (w["tp_size"], w["devices"]) for w in listed} == stored
    # a CPU worker's ranks hold no GPU: [] is kept as "none"
    cpu = _register(agent, [_worker("cpu", 30002, 2, [])], host={"name": AGENT_HOST})
    assert cpu.status_code == 200 and EngineWorker.objects.get(name="cpu").devices == []


@pytest.mark.parametrize(
    ("devices", "words"),
    [([0], "1 device(s) for tp_size 2: one per rank"), ([1, 1], "device index repeated: [1, 1]")],
)
def test_devices_that_do_not_match_the_ranks_are_a_400_naming_the_field(api_as, devices, words):
    response = _register(api_as("agent"), [_worker("bad", 30000, 2, devices)])
    assert response.status_code == 400, response.content
    assert response.json()["error"]["detail"] == {"workers": {"0": {"devices": [words]}}}
    assert not EngineWorker.objects.exists()


def test_a_gpu_the_host_lacks_or_another_worker_holds_is_a_400_naming_it(api_as):
    agent = api_as("agent")
    missing = _register(agent, [_worker("far", 30000, 2, [3, 4])])
    assert missing.status_code == 400, missing.content
    error = missing.json()["error"]
    assert error["message"] == f"workers[0].devices: host '{AGENT_HOST}' has no GPU 4"
    assert error["detail"] == {"workers": {"0": {"devices": [f"host '{AGENT_HOST}' has no GPU 4"]}}}
    shared = _register(agent, [_worker("a", 30000, 2, [0, 1]), _worker("b", 30001, 2, [1, 2])])
    assert shared.status_code == 400
    assert shared.json()["error"]["detail"]["workers"] == {
        "1": {"devices": ["two workers cannot hold one device: GPU 1 is held by 'a'"]}
    }
    assert not EngineWorker.objects.exists()


def test_the_worker_api_refuses_devices_that_do_not_fit_its_tp_size(api_as):
    op = api_as("operator")
    made = op.post(
        "/api/v1/inventory/workers/",
        {"name": "hand", "url": "http://10.0.0.9:30000", "tp_size": 2, "devices": [0, 1]},
        format="json",
    )
    assert made.status_code == 201, made.content
    url = f"/api/v1/inventory/workers/{made.json()['id']}/"
    shrunk = op.patch(url, {"tp_size": 4}, format="json")
    assert shrunk.status_code == 400
    assert shrunk.json()["error"]["detail"] == {"devices": ["2 device(s) for tp_size 4: one per rank"]}
    assert op.patch(url, {"tp_size": 4, "devices": [0, 1, 2, 3]}, format="json").status_code == 200
    assert EngineWorker.objects.get(name="hand").devices == [0, 1, 2, 3]
