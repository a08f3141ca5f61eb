"""Operations end to end through a real Celery worker (subprocess, local Redis) and fake workers over HTTP."""

import time

import pytest
from cp_factories import EngineWorkerFactory, StorageProfileFactory

from controlplane.audit.models import AuditEvent
from controlplane.operations.models import Operation

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def wait_finished(op_id: int, limit_s: float = 30.0) -> Operation:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        op = Operation.objects.get(pk=op_id)
        if op.state != "running":
            return op
        time.sleep(0.1)
    raise AssertionError(
        f"operation {op_id} still running: {list(op.targets.values('state', 'explanation'))}"
    )


def three_workers(fake_worker):
    fakes = [fake_worker(), fake_worker(), fake_worker(busy_polls=-1)]
    workers = [
        EngineWorkerFactory(name=f"w{i}", url=f.url, admin_key=f.admin_key) for i, f in enumerate(fakes, 1)
    ]
    return fakes, workers


def launch(api_as, workers, policy):
    profile = StorageProfileFactory(
        backend="mooncake", extra_config={"master_server_address": "127.0.0.1:50051"}
    )
    response = api_as("operator").post(
        "/api/v1/operations/",
        {
            "kind": "attach",
            "workers": [w.pk for w in workers],
            "storage_profile": profile.pk,
            "policy": policy,
            "idle_timeout_s": 1.5,
            "reason": "enable L3",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def test_all_or_nothing_reverts_the_two_that_succeeded(celery_worker_process, api_as, fake_worker):
    fakes, workers = three_workers(fake_worker)
    op = wait_finished(launch(api_as, workers, "all_or_nothing"))
    states = {t.worker.name: t for t in op.targets.select_related("worker")}
    assert op.state == "reverted", (op.explanation, op.summary)
    assert states["w3"].state == "failed" and "not idle within 1.5s" in states["w3"].explanation
    assert states["w1"].state == states["w2"].state == "reverted"
    assert "w3 failed" in op.explanation and "reverted: w1, w2" in op.explanation
    assert [f.backend for f in fakes] == [None, None, None]  # w1/w2 detached again, w3 never touched
    assert not [c for c in fakes[2].calls if c[0] in ("PUT", "DELETE")]
    reverts = AuditEvent.objects.filter(action="revert_attach", operation_id=op.pk)
    assert sorted(e.object_repr for e in reverts) == ["w1", "w2"]
    assert all(e.after["hicache_storage_backend"] is None for e in reverts)


def test_best_effort_reports_the_one_failure(celery_worker_process, api_as, fake_worker):
    fakes, workers = three_workers(fake_worker)
    op = wait_finished(launch(api_as, workers, "best_effort"))
    assert op.state == "partially_failed"
    assert list(op.summary["failures"]) == ["w3"] and op.summary["succeeded"] == ["w1", "w2"]
    assert [f.backend for f in fakes] == ["mooncake", "mooncake", None]
    audit = AuditEvent.objects.filter(
        operation_id=op.pk, action="attach", object_type="inventory.engineworker"
    )
    assert sorted((e.object_repr, e.outcome) for e in audit) == [
        ("w1", "success"),
        ("w2", "success"),
        ("w3", "failure"),
    ]


def test_cancel_stops_a_waiting_target(celery_worker_process, api_as, fake_worker):
    busy = fake_worker(busy_polls=-1)
    worker = EngineWorkerFactory(url=busy.url, admin_key=busy.admin_key)
    client = api_as("operator")
    op_id = client.post(
        "/api/v1/operations/",
        {"kind": "detach", "workers": [worker.pk], "idle_timeout_s": 60, "reason": "test"},
        format="json",
    ).json()["id"]
    time.sleep(0.5)
    assert (
        client.post(
            f"/api/v1/operations/{op_id}/cancel/", {"reason": "wrong worker"}, format="json"
        ).status_code
        == 202
    )
    op = wait_finished(op_id, limit_s=10)
    assert op.state == "cancelled" and op.targets.get().state == "cancelled"
    assert not [c for c in busy.calls if c[0] == "DELETE"]
