"""Rebalance API: reads (viewer/operator/admin; agents and anonymous refused)."""

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.rebalance.models import Rebalance, RebalanceStep

pytestmark = pytest.mark.django_db


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


def test_agents_and_anonymous_cannot_read(api_as, client):
    rb = _rebalance()
    assert api_as("agent").get(f"/api/v1/rebalances/{rb.pk}/").status_code == 403
    assert client.get("/api/v1/rebalances/").status_code in (401, 403)
