"""The reconciler against fake workers and a fake sglang-router (real HTTP servers; fakes stand in for the
engines and the router's worker API): a switched worker restarted in its old role is taken out of the router
and restarted by its agent in its assigned role, then registered again; a router restarted with its original
worker list is corrected; a URL no worker has raises an alert that closes once it is gone; a worker drained
on purpose stays out. Every repair is an audit record of the system."""

import pytest
from cp_factories import EngineWorkerFactory, HostFactory, RouterFactory
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker, FleetAlert
from controlplane.inventory.services import worker_role_observed
from controlplane.rebalance.models import Rebalance, RebalanceStep, StepState
from controlplane.rebalance.services.reconcile import reconcile_all
from controlplane.workerclient import RouterClient

pytestmark = pytest.mark.django_db


def _listed(fake_router) -> dict:
    """url -> (worker_type, bootstrap_port) as the router lists them."""
    return {e["url"]: e["worker_type"] for e in RouterClient(fake_router.url).list_workers()}


@pytest.fixture
def fleet(fake_worker, fake_router):
    """A PD router over p (prefill), d (decode) and s: moved prefill -> decode by a rebalance (assigned
    decode), all run by an agent, all listed by the router with the types they run."""
    router = RouterFactory(name="pd-main", url=fake_router.url, mode="pd")
    host = HostFactory(name="gpu-host")
    fakes = {
        "p": fake_worker(pd_role="prefill"),
        "d": fake_worker(pd_role="decode"),
        "s": fake_worker(pd_role="decode"),
    }
    workers = {}
    for name, fake in fakes.items():
        workers[name] = EngineWorkerFactory(
            name=name, url=fake.url, admin_key=fake.admin_key, router=router, host=host, role=fake.pd_role,
            last_seen=timezone.now(), assigned_role="decode" if name == "s" else "",
        )  # fmt: skip
        port = 8998 if fake.pd_role == "prefill" else None
        RouterClient(router.url).add_worker(fake.url, worker_type=fake.pd_role, bootstrap_port=port)
    return router, fakes, workers


def test_a_consistent_fleet_needs_no_repair(fleet):
    assert reconcile_all() == []
    assert not AuditEvent.objects.filter(action__startswith="reconcile").exists()


def test_a_switched_worker_restarted_in_its_old_role_is_restarted_in_its_assigned_one(fleet, fake_router):
    router, fakes, workers = fleet
    fakes["s"].pd_role = "prefill"  # crashed; its agent restarted it from its spec, as prefill
    (repair,) = reconcile_all()
    assert repair["action"] == "reconcile_restart"
    assert fakes["s"].url not in _listed(
        fake_router
    )  # no request reaches it in a role the router does not expect
    worker = EngineWorker.objects.get(pk=workers["s"].pk)
    assert worker.desired_role == "decode"  # what its agent's next heartbeat answer carries
    record = AuditEvent.objects.get(action="reconcile_restart")
    assert (record.actor_type, record.object_repr, record.extra["router_id"]) == ("system", "s", router.pk)
    assert record.changes["role"] == ["prefill", "decode"]

    assert reconcile_all() == []  # the restart is under way: nothing more to do
    fakes["s"].pd_role = "decode"  # the agent restarted it as asked and reports the role it runs
    worker_role_observed(worker=worker, role="decode")
    (repair,) = reconcile_all()
    assert repair["action"] == "reconcile_router"
    assert _listed(fake_router)[fakes["s"].url] == "decode"
    assert reconcile_all() == []


def test_a_router_restarted_with_its_original_list_is_corrected(fleet, fake_router):
    router, fakes, workers = fleet
    client = RouterClient(router.url)
    client.remove_worker(fakes["s"].url)
    client.add_worker(fakes["s"].url, worker_type="prefill", bootstrap_port=8998)  # its argv from before
    (repair,) = reconcile_all()
    assert repair["action"] == "reconcile_router" and "listed it as prefill" in repair["why"]
    assert _listed(fake_router)[fakes["s"].url] == "decode"
    assert fake_router.registered[-1] == {"url": fakes["s"].url, "worker_type": "decode"}


def test_a_url_no_worker_has_raises_an_alert_that_closes_once_it_is_gone(fleet, fake_router):
    router, fakes, workers = fleet
    RouterClient(router.url).add_worker("http://stranger:1", worker_type="decode")
    reconcile_all()
    reconcile_all()  # seen twice: still one alert
    (alert,) = FleetAlert.objects.filter(resolved_at__isnull=True)
    assert (alert.kind, alert.subject) == ("unknown_worker", "http://stranger:1")
    assert "http://stranger:1" in _listed(fake_router)  # not ours to remove: raised, not repaired
    RouterClient(router.url).remove_worker("http://stranger:1")
    reconcile_all()
    alert.refresh_from_db()
    assert alert.resolved_at is not None
    assert [e.action for e in AuditEvent.objects.filter(action__startswith="alert").order_by("id")] == [
        "alert_open",
        "alert_resolve",
    ]


def test_a_grpc_worker_is_found_by_the_grpc_url_the_router_lists(fleet, fake_router, fake_worker):
    """Registered by its HTTP sidecar's URL, listed by the router as grpc://host:--port: the reconciler
    matches the two (no unknown_worker alert for its entry, no registration of the sidecar's URL)."""
    router, fakes, workers = fleet
    sidecar = fake_worker()  # a regular worker: --grpc-mode serves no PD role
    EngineWorkerFactory(name="g", url=sidecar.url, router=router, last_seen=timezone.now(),
                        command_line=["--grpc-mode", "--port=31000"])  # fmt: skip
    RouterClient(router.url).add_worker("grpc://127.0.0.1:31000")
    assert reconcile_all() == []
    (alert,) = FleetAlert.objects.filter(resolved_at__isnull=True)
    assert (alert.kind, alert.worker.name) == ("not_pd", "g")
    assert sidecar.url not in _listed(fake_router)


def test_a_worker_drained_on_purpose_stays_out_and_an_active_rebalance_is_left_alone(fleet, fake_router):
    router, fakes, workers = fleet
    RouterClient(router.url).remove_worker(fakes["d"].url)
    EngineWorker.objects.filter(pk=workers["d"].pk).update(drained=True)
    assert reconcile_all() == []
    EngineWorker.objects.filter(pk=workers["d"].pk).update(drained=False)
    Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=2, target_prefill=2, target_decode=1, soak_s=1,
        idle_timeout_s=1, state="running",
    )  # fmt: skip
    assert reconcile_all() == []
    assert fakes["d"].url not in _listed(fake_router)


def test_a_step_outcome_sets_the_role_the_worker_keeps():
    from controlplane.rebalance.services.transitions import step_transition

    router = RouterFactory(mode="pd")
    moved, back = (EngineWorkerFactory(router=router, role="prefill") for _ in range(2))
    rb = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=1,
        idle_timeout_s=1, state="running",
    )  # fmt: skip
    for index, (worker, state, to) in enumerate(
        ((moved, "soaking", StepState.SUCCEEDED), (back, "rolling_back", StepState.ROLLED_BACK))
    ):
        step = RebalanceStep.objects.create(
            rebalance=rb, index=index, worker=worker, from_role="prefill", to_role="decode", state=state
        )
        step_transition(step, to=to, explanation="done")
    assert EngineWorker.objects.get(pk=moved.pk).assigned_role == "decode"
    assert EngineWorker.objects.get(pk=back.pk).assigned_role == "prefill"


def test_the_api_lists_the_alerts_a_viewer_may_read_and_refuses_writes(fleet, api_as):
    router, fakes, workers = fleet
    RouterClient(router.url).add_worker("http://stranger:1", worker_type="decode")
    reconcile_all()
    r = api_as("viewer").get("/api/v1/inventory/alerts/", {"open": "true"})
    assert r.status_code == 200, r.content
    (alert,) = r.json()["results"]
    assert (alert["router_name"], alert["kind"], alert["subject"]) == (
        "pd-main",
        "unknown_worker",
        "http://stranger:1",
    )
    assert alert["resolved_at"] is None
    assert api_as("operator").post("/api/v1/inventory/alerts/", {}).status_code == 405
    RouterClient(router.url).remove_worker("http://stranger:1")
    reconcile_all()
    assert api_as("viewer").get("/api/v1/inventory/alerts/", {"open": "true"}).json()["results"] == []
    assert len(api_as("viewer").get("/api/v1/inventory/alerts/").json()["results"]) == 1
