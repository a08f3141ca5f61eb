"""Undo: a worker back to the state an audited change found (its ``before``), through a new drained
operation driven step by step against fake workers over real HTTP. A fleet's first attach is undone by a
detach, a detach by an attach of the profile it had, a config push by a revision holding the values before
it; what cannot be undone, or would change nothing, is refused naming why and launches nothing."""

import pytest
from cp_factories import ConfigRevisionFactory, EngineWorkerFactory, RouterFactory, StorageProfileFactory

from controlplane.audit.models import AuditEvent
from controlplane.operations.models import Operation
from controlplane.operations.services import operation_create
from tests.support.operations import drive

pytestmark = pytest.mark.django_db


def _worker(fake, name="w0", **kwargs):
    return EngineWorkerFactory(name=name, url=fake.url, admin_key=fake.admin_key, **kwargs)


def _record(op: Operation) -> AuditEvent:
    (event,) = AuditEvent.objects.filter(operation_id=op.pk, object_type="inventory.engineworker")
    return event


def _undo(api, event, **body):
    return api.post(f"/api/v1/audit/events/{event.pk}/undo/", {"reason": "wrong tier", **body}, format="json")


def test_the_first_attach_is_undone_by_a_drained_detach(fake_worker, fake_router, api_as):
    fake = fake_worker()
    fake_router.add(fake.url)
    worker = _worker(fake, router=RouterFactory(url=fake_router.url))
    profile = StorageProfileFactory(backend="file", extra_config={"file_path": "/tmp/kvfleet-undo"})
    first = drive(operation_create(kind="attach", workers=[worker], storage_profile=profile, actor=None))
    assert first.state == "succeeded" and fake.backend == "file"
    event = _record(first)
    seen = api_as("viewer").get(f"/api/v1/audit/events/{event.pk}/").json()
    assert seen["undo"] == {"kind": "detach", "worker_id": worker.pk, "worker": "w0",
                            "now": f"file ({profile.name})", "after": "none"}  # fmt: skip
    assert seen["undo_refused"] == "" and seen["revertible"] is False  # revert: the state it left, already

    r = _undo(api_as("operator"), event)
    assert r.status_code == 201, r.content
    undo = drive(Operation.objects.get(pk=r.json()["id"]))
    assert (undo.kind, undo.state, undo.drain) == ("detach", "succeeded", True)
    assert fake.backend is None and fake.url in fake_router.urls()  # detached, and back in its router
    assert undo.reason == f"undo of audit record {event.pk}: wrong tier"
    worker.refresh_from_db()
    assert worker.storage_backend == ""
    again = _undo(api_as("operator"), event)  # it runs the state the record found now
    assert again.status_code == 409 and again.json()["error"]["code"] == "nothing_to_undo"


def test_a_detach_is_undone_by_attaching_the_profile_it_had(fake_worker):
    from controlplane.operations.services.undo import operation_create_undo

    fake = fake_worker()
    profile = StorageProfileFactory(backend="file", extra_config={"file_path": "/tmp/kvfleet-undo-b"})
    worker = _worker(fake)
    drive(operation_create(kind="attach", workers=[worker], storage_profile=profile, actor=None))
    detached = drive(operation_create(kind="detach", workers=[worker], actor=None))
    assert fake.backend is None
    undo = drive(operation_create_undo(event=_record(detached), actor=None, reason="keep L3", drain=False))
    assert (undo.kind, undo.storage_profile_id, undo.state) == ("attach", profile.pk, "succeeded")
    assert fake.backend == "file" and '"/tmp/kvfleet-undo-b"' in fake.backend_extra


def test_a_config_push_is_undone_by_a_revision_of_the_values_before(fake_worker, api_as):
    fake = fake_worker()
    worker = _worker(fake)
    pushed = ConfigRevisionFactory(content={"prefetch_threshold": 32, "hicache_write_policy": "write_back"})
    pushed.profile.head_number = 1
    pushed.profile.save()
    op = drive(operation_create(kind="apply_config", workers=[worker], revision=pushed, actor=None))
    assert fake.config["prefetch_threshold"] == 32
    event = _record(op)
    assert api_as("viewer").get(f"/api/v1/audit/events/{event.pk}/").json()["undo"]["after"] == (
        "prefetch_threshold=256, hicache_write_policy='write_through'"
    )
    r = _undo(api_as("operator"), event, drain=False)
    assert r.status_code == 201, r.content
    undo = drive(Operation.objects.get(pk=r.json()["id"]))
    assert undo.state == "succeeded" and undo.revision.number == 2
    assert undo.revision.content == {"prefetch_threshold": 256, "hicache_write_policy": "write_through"}
    assert (fake.config["prefetch_threshold"], fake.config["hicache_write_policy"]) == (256, "write_through")
    assert AuditEvent.objects.filter(action="commit", object_id=str(undo.revision.pk)).count() == 1


def test_what_cannot_be_undone_says_why_and_launches_nothing(fake_worker, api_as):
    fake = fake_worker()
    worker = _worker(fake)
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=StorageProfileFactory(),
                                actor=None))  # fmt: skip
    event = _record(op)
    api = api_as("operator")
    no_reason = api.post(f"/api/v1/audit/events/{event.pk}/undo/", {}, format="json")
    assert no_reason.status_code == 400 and list(no_reason.json()["error"]["detail"]) == ["reason"]
    typo = _undo(api, event, drian=True)
    assert typo.status_code == 400 and "did you mean 'drain'" in str(typo.json()["error"]["detail"])
    launch = AuditEvent.objects.filter(operation_id=op.pk, object_type="operations.operation").first()
    refused = _undo(api, launch)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "not_undoable"
    assert (
        "an operation's record; undo the record of the worker it changed"
        in refused.json()["error"]["message"]
    )
    assert api_as("viewer").post(f"/api/v1/audit/events/{event.pk}/undo/", {"reason": "x"}).status_code == 403
    assert Operation.objects.count() == 1
