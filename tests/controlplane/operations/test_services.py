"""Operation state machine driven step by step in-process (no Celery) against fake workers over real HTTP."""

import time
from datetime import timedelta

import pytest
from cp_factories import ConfigRevisionFactory, EngineWorkerFactory, RouterFactory, StorageProfileFactory
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.operations.models import IdempotencyRecord, Operation, OperationTarget
from controlplane.operations.services import (
    InvalidTransition,
    operation_create,
    reap_stuck_targets,
    target_step,
    target_transition,
)

pytestmark = pytest.mark.django_db


def registered(fake, **kwargs):
    return EngineWorkerFactory(url=fake.url, admin_key=fake.admin_key, **kwargs)


def run_to_end(target: OperationTarget, limit_s: float = 10.0) -> OperationTarget:
    deadline = time.monotonic() + limit_s
    while (delay := target_step(target_id=target.pk)) is not None:
        assert time.monotonic() < deadline, "target did not finish"
        time.sleep(delay)
    target.refresh_from_db()
    return target


def test_attach_waits_for_idle_then_applies_and_verifies(fake_worker):
    fake = fake_worker(busy_polls=3)
    worker = registered(fake)
    profile = StorageProfileFactory(backend="file", extra_config={"file_path": "/tmp/l3"})
    op = operation_create(kind="attach", workers=[worker], storage_profile=profile, actor=None)
    target = run_to_end(op.targets.get())
    assert target.state == "succeeded" and target.polls >= 2
    assert fake.backend == "file" and fake.backend_extra == '{"file_path": "/tmp/l3"}'
    assert (
        target.before["hicache_storage_backend"] is None and target.after["hicache_storage_backend"] == "file"
    )
    worker.refresh_from_db()
    assert (worker.storage_backend, worker.storage_profile_id) == ("file", profile.pk)
    assert Operation.objects.get(pk=op.pk).state == "succeeded"
    event = AuditEvent.objects.get(action="attach", object_type="inventory.engineworker")
    assert event.changes["hicache_storage_backend"] == [None, "file"] and event.outcome == "success"


def test_not_idle_answer_is_waited_on_never_forced(fake_worker):
    fake = fake_worker()
    fake.not_idle_puts = 2
    op = operation_create(kind="detach", workers=[registered(fake)], actor=None)
    fake.backend = "file"
    target = run_to_end(op.targets.get())
    assert target.state == "succeeded" and fake.backend is None
    puts = [c for c in fake.calls if c[0] == "DELETE"]
    assert len(puts) == 3  # two refused while "not idle", then the one that applied


def test_running_a_step_twice_is_safe(fake_worker):
    fake = fake_worker()
    revision = ConfigRevisionFactory(content={"hicache_write_policy": "write_back", "prefetch_threshold": 64})
    op = operation_create(kind="apply_config", workers=[registered(fake)], revision=revision, actor=None)
    target = run_to_end(op.targets.get())
    assert target.state == "succeeded" and fake.config["prefetch_threshold"] == 64
    writes = len([c for c in fake.calls if c[0] == "PUT"])
    assert target_step(target_id=target.pk) is None  # duplicate delivery: no-op
    assert len([c for c in fake.calls if c[0] == "PUT"]) == writes
    stale = OperationTarget.objects.get(pk=target.pk)
    stale.state = "verifying"
    assert target_transition(stale, to="succeeded") is False  # compare-and-set lost: nothing written


def test_transition_table_is_enforced(fake_worker):
    op = operation_create(kind="detach", workers=[registered(fake_worker())], actor=None)
    with pytest.raises(InvalidTransition):
        target_transition(op.targets.get(), to="succeeded")


def test_drain_removes_from_router_and_readds(fake_worker, fake_router):
    fake = fake_worker(busy_polls=2)
    router = RouterFactory(url=fake_router.url)
    fake_router.add(fake.url)
    op = operation_create(kind="detach", workers=[registered(fake, router=router)], drain=True, actor=None)
    target = op.targets.get()
    target_step(target_id=target.pk)
    assert fake.url not in fake_router.urls()  # drained while waiting for idle
    target = run_to_end(target)
    assert target.state == "succeeded" and fake.url in fake_router.urls()
    methods = [c[0] for c in fake_router.calls]
    assert "DELETE" in methods and "POST" in methods


def test_workers_of_one_router_never_all_leave_it_at_once(fake_worker, fake_router):
    """A drained operation over every worker behind one router drains them one at a time: the second
    waits, saying why, until the first is back in the router, so the router always has a worker to send
    requests to (a router with none answers them 503)."""
    router = RouterFactory(url=fake_router.url)
    fakes = [fake_worker(busy_polls=2), fake_worker(busy_polls=2)]
    for fake in fakes:
        fake_router.add(fake.url)
    workers = [registered(f, router=router, role="mixed") for f in fakes]
    op = operation_create(kind="detach", workers=workers, drain=True, actor=None)
    first, second = op.targets.order_by("pk")
    target_step(target_id=first.pk)
    assert target_step(target_id=second.pk) is not None
    second.refresh_from_db()
    assert second.state == "pending" and not second.drained
    assert "waiting to drain: every other mixed worker of router" in second.explanation
    assert fake_router.urls() == {fakes[1].url}  # the second still serves
    first = run_to_end(first)
    assert first.state == "succeeded" and set(fake_router.urls()) == {f.url for f in fakes}
    second = run_to_end(second)
    assert second.state == "succeeded" and set(fake_router.urls()) == {f.url for f in fakes}
    deletes = [path for method, path in fake_router.calls if method == "DELETE"]
    assert len(deletes) == 2


def test_unreachable_worker_fails_with_reason(fake_worker):
    fake = fake_worker()
    worker = registered(fake)
    fake.stop()
    op = operation_create(kind="detach", workers=[worker], actor=None)
    target = run_to_end(op.targets.get())
    assert target.state == "failed" and "cannot read worker state" in target.explanation
    assert Operation.objects.get(pk=op.pk).state == "failed"


def test_failing_worker_apply_is_reported(fake_worker):
    fake = fake_worker()
    fake.fail_admin = True
    op = operation_create(
        kind="attach", workers=[registered(fake)], storage_profile=StorageProfileFactory(), actor=None
    )
    target = run_to_end(op.targets.get())
    assert target.state == "failed" and "500" in target.explanation


def test_reaper_fails_targets_stuck_past_deadline(fake_worker):
    op = operation_create(kind="detach", workers=[registered(fake_worker())], actor=None)
    OperationTarget.objects.filter(operation=op).update(deadline_at=timezone.now() - timedelta(minutes=5))
    assert reap_stuck_targets(grace_s=30) == 1
    target = op.targets.get()
    assert target.state == "failed" and target.explanation.startswith("reaped: stuck in pending")
    assert Operation.objects.get(pk=op.pk).state == "failed"


def test_worker_in_a_running_operation_is_refused(api_as):
    worker = EngineWorkerFactory()
    first = api_as("operator").post(
        "/api/v1/operations/", {"kind": "detach", "workers": [worker.pk], "reason": "test"}, format="json"
    )
    assert first.status_code == 201
    second = api_as("operator").post(
        "/api/v1/operations/", {"kind": "detach", "workers": [worker.pk], "reason": "test"}, format="json"
    )
    assert second.status_code == 409 and second.json()["error"]["code"] == "worker_busy"


def test_idempotency_key_replays_and_rejects_a_different_body(api_as):
    worker, other = EngineWorkerFactory(), EngineWorkerFactory()
    client = api_as("operator")
    body = {"kind": "detach", "workers": [worker.pk], "reason": "test"}
    first = client.post("/api/v1/operations/", body, format="json", HTTP_IDEMPOTENCY_KEY="launch-1")
    again = client.post("/api/v1/operations/", body, format="json", HTTP_IDEMPOTENCY_KEY="launch-1")
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"] and again["Idempotent-Replayed"] == "true"
    assert Operation.objects.count() == 1
    changed = client.post(
        "/api/v1/operations/",
        {"kind": "detach", "workers": [other.pk], "reason": "test"},
        format="json",
        HTTP_IDEMPOTENCY_KEY="launch-1",
    )
    assert changed.status_code == 422 and Operation.objects.count() == 1
    assert changed.reason_phrase == "Unprocessable Entity"


@pytest.mark.django_db(transaction=True)
def test_idempotency_key_conflict_status_line_under_daphne_names_the_status(asgi_server, personas):
    """Under daphne the status line carries Twisted's phrase, which has none for 422: it said "HTTP/1.1 422
    Unknown Status" until the ASGI entry point filled in the standard phrases."""
    import httpx

    user, token = personas["operator"]
    worker = EngineWorkerFactory()
    IdempotencyRecord.objects.create(
        user=user, key="launch-1", request_sha256="0" * 64, status_code=201, response_body={"id": 0}
    )
    body = {"kind": "detach", "workers": [worker.pk], "reason": "test"}
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "launch-1"}
    changed = httpx.post(asgi_server + "/api/v1/operations/", json=body, headers=headers)
    assert changed.status_code == 422, changed.text
    assert changed.reason_phrase == "Unprocessable Entity"
    assert changed.json()["error"]["code"] == "idempotency_key_mismatch"
    assert not Operation.objects.exists()


def test_bad_operation_input_changes_nothing(api_as):
    client = api_as("operator")
    worker = EngineWorkerFactory()
    audit_before = AuditEvent.objects.count()
    missing = client.post(
        "/api/v1/operations/", {"kind": "attach", "workers": [worker.pk], "reason": "t"}, format="json"
    )
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "missing_storage_profile"
    unknown = client.post(
        "/api/v1/operations/", {"kind": "detach", "workers": [99999], "reason": "t"}, format="json"
    )
    assert unknown.status_code == 400 and "workers" in unknown.json()["error"]["detail"]
    assert Operation.objects.count() == 0 and AuditEvent.objects.count() == audit_before


def test_a_launch_without_a_reason_is_refused_naming_reason(api_as):
    """The API asks for the reason the launch form requires; none, or only blanks, changes nothing."""
    client = api_as("operator")
    worker = EngineWorkerFactory()
    audit_before = AuditEvent.objects.count()
    for body in ({}, {"reason": "   "}):
        r = client.post(
            "/api/v1/operations/", {"kind": "detach", "workers": [worker.pk], **body}, format="json"
        )
        assert r.status_code == 400 and list(r.json()["error"]["detail"]) == ["reason"], r.content
    assert Operation.objects.count() == 0 and AuditEvent.objects.count() == audit_before


def test_preview_reports_idle_state(api_as, fake_worker):
    idle, busy = fake_worker(), fake_worker(busy_polls=-1)
    w1, w2 = registered(idle, name="a-idle"), registered(busy, name="b-busy")
    response = api_as("viewer").get(f"/api/v1/operations/preview/?worker={w1.pk}&worker={w2.pk}")
    rows = {r["name"]: r for r in response.json()}
    assert rows["a-idle"]["is_idle"] is True and rows["b-busy"]["is_idle"] is False
    assert rows["b-busy"]["num_running_reqs"] == 2
    assert rows["b-busy"]["num_http_reqs"] == 3  # what keeps a worker with nothing queued from idling


def test_drain_and_undrain_endpoints_talk_to_the_router(api_as, fake_router):
    worker = EngineWorkerFactory(url="http://10.1.1.1:30000", router=RouterFactory(url=fake_router.url))
    fake_router.add(worker.url)
    client = api_as("operator")
    assert client.post(f"/api/v1/inventory/workers/{worker.pk}/drain/").json() == {
        "worker": worker.pk,
        "router": fake_router.url,
        "removed": True,
    }
    assert worker.url not in fake_router.urls()
    assert client.post(f"/api/v1/inventory/workers/{worker.pk}/drain/").json()["removed"] is False
    assert client.post(f"/api/v1/inventory/workers/{worker.pk}/undrain/").json()["added"] is True
    assert worker.url in fake_router.urls()
    lone = EngineWorkerFactory()
    refused = client.post(f"/api/v1/inventory/workers/{lone.pk}/drain/")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_router"
    # a --grpc-mode worker: registered by its HTTP sidecar's URL, listed by the router as grpc://host:--port
    grpc = EngineWorkerFactory(
        url="http://10.1.1.2:30001", router=worker.router, command_line=["--grpc-mode", "--port=30000"]
    )
    fake_router.add("grpc://10.1.1.2:30000")
    assert client.post(f"/api/v1/inventory/workers/{grpc.pk}/drain/").json()["removed"] is True
    assert "grpc://10.1.1.2:30000" not in fake_router.urls()
    assert client.post(f"/api/v1/inventory/workers/{grpc.pk}/undrain/").json()["added"] is True
    assert fake_router.registered[-1] == {"url": "grpc://10.1.1.2:30000"}  # regular: no /server_info asked
    assert client.post(f"/api/v1/inventory/workers/{grpc.pk}/undrain/").json()["added"] is False


def test_celery_task_options_stay_declared():
    from controlplane.operations.tasks import target_step_task

    assert target_step_task.acks_late is True and target_step_task.reject_on_worker_lost is True
