"""Reverting a multi-worker change: one request restores every worker the record's operation changed to that
state, in one new operation; workers already in it are left out, and without `together` only the record's own
worker is reverted."""

import pytest
from cp_factories import EngineWorkerFactory

from controlplane.audit.services import audit_record
from controlplane.operations.models import Operation

pytestmark = pytest.mark.django_db


def _detached_by_one_operation(names_attached_since):
    """Three workers one detach operation changed; those named have had L3 attached again since."""
    workers = [
        EngineWorkerFactory(name=n, storage_backend="file" if n in names_attached_since else "")
        for n in ("w-a", "w-b", "w-c")
    ]
    events = [
        audit_record(
            action="detach",
            obj=w,
            operation_id=41,
            extra={"restore": {"kind": "detach", "worker_ids": [w.pk]}},
        )
        for w in workers
    ]
    return workers, events


def test_together_reverts_every_worker_its_operation_changed_that_differs_now(api_as):
    workers, events = _detached_by_one_operation({"w-a", "w-b"})
    listed = api_as("operator").get(f"/api/v1/audit/events/{events[0].pk}/").json()
    assert [c["worker"] for c in listed["revert_changes"]] == ["w-a"]
    assert [c["worker"] for c in listed["revert_together_changes"]] == ["w-a", "w-b"]

    r = api_as("operator").post(
        f"/api/v1/audit/events/{events[0].pk}/revert/", {"together": True}, format="json"
    )
    assert r.status_code == 201, r.content
    op = Operation.objects.get(pk=r.json()["id"])
    assert op.kind == "detach"
    assert sorted(t.worker.name for t in op.targets.all()) == ["w-a", "w-b"]


def test_without_together_only_the_records_own_worker_is_reverted(api_as):
    workers, events = _detached_by_one_operation({"w-a", "w-b"})
    r = api_as("operator").post(f"/api/v1/audit/events/{events[1].pk}/revert/", {}, format="json")
    assert r.status_code == 201, r.content
    assert [t.worker.name for t in Operation.objects.get(pk=r.json()["id"]).targets.all()] == ["w-b"]


def test_no_together_offer_when_it_would_change_no_more_workers(api_as):
    workers, events = _detached_by_one_operation({"w-a"})
    listed = api_as("operator").get(f"/api/v1/audit/events/{events[0].pk}/").json()
    assert listed["revert_together_changes"] == []
