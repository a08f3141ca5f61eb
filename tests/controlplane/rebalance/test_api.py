"""Rebalance API reads (viewer/operator/admin; agents and anonymous refused), websocket pushes, and the
router client's PD registration."""

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.asgi import application
from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import Rebalance, RebalanceStep
from controlplane.rebalance.services import rebalance_abort
from controlplane.workerclient import RouterClient

pytestmark = pytest.mark.django_db
WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


def _rebalance() -> Rebalance:
    router = RouterFactory(name="pd-router", mode="pd")
    worker = EngineWorkerFactory(name="p0", router=router, role="prefill")
    rb = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=5,
        idle_timeout_s=60, reason="decode-heavy",
    )  # fmt: skip
    RebalanceStep.objects.create(rebalance=rb, index=0, worker=worker, from_role="prefill", to_role="decode")
    return rb


def test_list_and_detail_show_counts_state_and_steps(api_as):
    rb = _rebalance()
    listed = api_as("viewer").get("/api/v1/rebalances/")
    assert listed.status_code == 200
    assert [r["id"] for r in listed.json()["results"]] == [rb.pk]
    detail = api_as("viewer").get(f"/api/v1/rebalances/{rb.pk}/").json()
    assert detail["before"] == {"prefill": 2, "decode": 1} and detail["target"] == {"prefill": 1, "decode": 2}
    assert detail["state"] == "planned" and detail["router_name"] == "pd-router"
    (step,) = detail["steps"]
    assert (step["worker_name"], step["from_role"], step["to_role"], step["state"]) == (
        "p0",
        "prefill",
        "decode",
        "pending",
    )
    assert step["devices"] == 1 and detail["moved_devices"] == 1


def test_a_step_moving_a_tp2_worker_moves_two_devices(api_as):
    rb = _rebalance()
    EngineWorker.objects.filter(name="p0").update(tp_size=2)
    d1 = EngineWorkerFactory(name="d1", router=rb.router, role="decode", tp_size=2)
    RebalanceStep.objects.create(rebalance=rb, index=1, worker=d1, from_role="decode", to_role="prefill")
    detail = api_as("viewer").get(f"/api/v1/rebalances/{rb.pk}/").json()
    assert [(s["worker_name"], s["devices"]) for s in detail["steps"]] == [("p0", 2), ("d1", 2)]
    assert detail["moved_devices"] == 4


def test_agents_and_anonymous_cannot_read(api_as, client):
    rb = _rebalance()
    assert api_as("agent").get(f"/api/v1/rebalances/{rb.pk}/").status_code == 403
    assert client.get("/api/v1/rebalances/").status_code in (401, 403)


def test_router_re_add_of_a_pd_worker_keeps_its_type_and_bootstrap_port(fake_worker, fake_router):
    """sglang-router 0.3.2 registers a worker posted with only its URL as "regular" (a PD router never
    picks it): add_worker reads the role from the worker's /server_info (operations' drain re-add too)."""
    prefill, decode, plain = fake_worker(pd_role="prefill"), fake_worker(pd_role="decode"), fake_worker()
    client = RouterClient(fake_router.url)
    for worker in (prefill, decode, plain):
        client.add_worker(worker.url)
    assert fake_router.registered == [
        {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": 8998},
        {"url": decode.url, "worker_type": "decode"},
        {"url": plain.url},
    ]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_progress_is_pushed_to_the_rebalance_groups(personas):
    rb = await database_sync_to_async(_rebalance)()
    await database_sync_to_async(Rebalance.objects.filter(pk=rb.pk).update)(state="awaiting_approval")
    rb.state = "awaiting_approval"
    communicator = WebsocketCommunicator(
        application,
        f"/ws/v1/events/?token={personas['viewer'][1]}",
        headers=[(b"origin", b"http://127.0.0.1")],
    )
    assert (await communicator.connect())[0]
    await communicator.send_json_to({"action": "subscribe", "groups": [f"rebalance.{rb.pk}", "rebalances"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.subscribed"
    await database_sync_to_async(rebalance_abort)(rb=rb, actor=personas["operator"][0], reason="stop")
    seen = [await communicator.receive_json_from(timeout=WS_WAIT_S) for _ in range(3)]
    await communicator.disconnect()
    step = next(m for m in seen if m["type"] == "rebalance.step_changed")["data"]
    assert (step["worker"], step["from"], step["state"]) == ("p0", "pending", "cancelled")
    cancelled = await database_sync_to_async(rb.steps.get)()
    assert cancelled.started_at is None  # it never ran: no Started time on the page
    states = [m["data"] for m in seen if m["type"] == "rebalance.state_changed"]
    assert len(states) == 2  # once to rebalance.<id>, once to rebalances
    assert all(
        (s["rebalance_id"], s["from"], s["state"], s["allowed_actions"])
        == (rb.pk, "awaiting_approval", "aborted", [])
        for s in states
    )
