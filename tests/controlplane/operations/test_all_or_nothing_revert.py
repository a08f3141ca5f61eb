"""All-or-nothing that holds, driven step by step in-process against fake workers over real HTTP: every
target an apply was sent to is read live and reverted if it changed, reverts are drained like applies, and
the audit says exactly which workers were changed, reverted or left, and why. One test per bug of issue 11."""

from datetime import timedelta

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory, StorageProfileFactory
from django.conf import settings
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.celery import app as celery_app
from controlplane.operations.models import Operation, OperationTarget
from controlplane.operations.services import operation_create, reap_stuck_targets, target_step
from tests.support.operations import drive

pytestmark = pytest.mark.django_db

FILE_A = {"file_path": "/tmp/kvfleet-l3-a"}
FILE_B = {"file_path": "/tmp/kvfleet-l3-b"}


def registered(fake, name, **kwargs):
    return EngineWorkerFactory(name=name, url=fake.url, admin_key=fake.admin_key, **kwargs)


def targets(op):
    return {t.worker.name: t for t in op.targets.select_related("worker")}


def attach(workers, profile, **kwargs):
    return operation_create(
        kind="attach", workers=workers, storage_profile=profile, actor=None, policy="all_or_nothing", **kwargs
    )


def test_apply_timeout_while_the_engine_completes_is_reverted(fake_worker, settings):
    """Bug: a target whose apply timed out was failed without reading it; the engine had attached."""
    settings.WORKER_APPLY_HTTP_TIMEOUT_S = 0.5
    slow, ok = fake_worker(), fake_worker()
    slow.apply_delay_s = 1.5
    op = drive(
        attach([registered(ok, "ok"), registered(slow, "slow")], StorageProfileFactory(backend="file"))
    )
    t = targets(op)
    assert slow.backend is None and ok.backend is None  # both back to their before state
    assert t["slow"].state == "reverted" and t["slow"].changed is True
    assert "apply failed" in t["slow"].revert_cause and "live state changed" in t["slow"].revert_cause
    assert t["ok"].state == "reverted" and t["ok"].revert_cause == "slow failed"
    assert op.state == "reverted" and op.summary["restored"] == ["ok", "slow"]
    assert op.summary["left_changed"] == {}
    reverts = AuditEvent.objects.filter(operation_id=op.pk, action="revert_attach")
    assert sorted((e.object_repr, e.extra["changed"], e.outcome) for e in reverts) == [
        ("ok", True, "success"),
        ("slow", True, "success"),
    ]
    failure = AuditEvent.objects.get(operation_id=op.pk, action="attach", object_repr="slow")
    assert failure.outcome == "failure" and failure.after["hicache_storage_backend"] == "file"


def test_read_back_mismatch_is_read_live_and_left_unchanged(fake_worker):
    ignoring, ok = fake_worker(), fake_worker()
    ignoring.ignore_writes = True
    op = drive(
        attach([registered(ok, "ok"), registered(ignoring, "ign")], StorageProfileFactory(backend="file"))
    )
    t = targets(op)
    assert t["ign"].state == "reverted" and t["ign"].changed is False
    assert t["ign"].explanation.startswith("unchanged: nothing to revert")
    assert "verification failed" in t["ign"].revert_cause
    assert t["ok"].state == "reverted" and t["ok"].changed is True and ok.backend is None
    assert op.summary["changed"] == ["ok"] and op.summary["restored"] == ["ok"]


def test_router_readd_failure_is_reverted_and_audited(fake_worker, fake_router):
    """Bug: applied and verified, router re-add failed: the change stayed and was audited as a failure."""
    a, b = fake_worker(), fake_worker()
    router = RouterFactory(url=fake_router.url)
    for fake in (a, b):
        fake_router.add(fake.url)
    fake_router.fail_adds = 1
    workers = [registered(a, "a", router=router), registered(b, "b", router=router)]
    op = drive(attach(workers, StorageProfileFactory(backend="file"), drain=True))
    assert a.backend is None and b.backend is None
    t = targets(op)
    assert t["a"].state == "reverted" and t["a"].changed is True
    assert "re-adding to router" in t["a"].revert_cause and t["b"].state == "cancelled"
    assert op.state == "reverted" and op.summary["restored"] == ["a"] and op.summary["left_changed"] == {}
    assert fake_router.urls() == {a.url, b.url}
    failed = AuditEvent.objects.get(operation_id=op.pk, action="attach", object_repr="a")
    assert failed.outcome == "failure" and failed.extra["changed"] is True  # a failure of a change that took
    revert = AuditEvent.objects.get(operation_id=op.pk, action="revert_attach", object_repr="a")
    assert revert.changes["hicache_storage_backend"] == ["file", None] and revert.outcome == "success"


def test_revert_is_drained_like_an_apply(fake_worker, fake_router):
    """Bug: reverts ran with the worker back in the router, so under traffic they never became idle."""
    ok, busy = fake_worker(), fake_worker(busy_polls=-1)
    router = RouterFactory(url=fake_router.url)
    fake_router.add(ok.url)
    fake_router.add(busy.url)
    workers = [registered(ok, "ok", router=router), registered(busy, "busy", router=router)]
    op = drive(attach(workers, StorageProfileFactory(backend="file"), drain=True, idle_timeout_s=1.0))
    t = targets(op)
    assert t["busy"].state == "failed" and t["ok"].state == "reverted" and ok.backend is None
    removals = [c for c in fake_router.calls if c[0] == "DELETE"]
    assert len(removals) == 3  # ok drained for the apply and again for its revert; busy once
    assert ok.url in fake_router.urls() and busy.url in fake_router.urls()


def test_same_backend_new_config_is_detach_then_attach(fake_worker):
    """Bug: same backend name, new extra config: never sent, and the inventory recorded the new profile."""
    fake = fake_worker()
    fake.backend, fake.backend_extra = "file", '{"file_path": "/tmp/kvfleet-l3-a"}'
    old, new = (
        StorageProfileFactory(backend="file", extra_config=FILE_A),
        StorageProfileFactory(backend="file", extra_config=FILE_B),
    )
    worker = registered(fake, "w", storage_backend="file", storage_profile=old)
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=new, actor=None))
    assert op.state == "succeeded" and fake.backend_extra == '{"file_path": "/tmp/kvfleet-l3-b"}'
    assert [c[0] for c in fake.calls if c[0] in ("PUT", "DELETE")] == ["DELETE", "PUT"]
    worker.refresh_from_db()
    assert worker.storage_profile_id == new.pk


def test_inventory_never_records_a_profile_the_engine_did_not_take(fake_worker):
    fake = fake_worker()
    fake.ignore_writes = True
    old = StorageProfileFactory(backend="file", extra_config=FILE_A)
    fake.backend, fake.backend_extra = "file", '{"file_path": "/tmp/kvfleet-l3-a"}'
    worker = registered(fake, "w", storage_backend="file", storage_profile=old)
    profile = StorageProfileFactory(backend="file", extra_config=FILE_B)
    op = drive(operation_create(kind="attach", workers=[worker], storage_profile=profile, actor=None))
    assert op.state == "failed" and "extra config is" in op.targets.get().explanation
    worker.refresh_from_db()
    assert worker.storage_profile_id == old.pk


def test_drain_without_router_is_refused_or_warned(fake_worker, api_as):
    fake = fake_worker()
    worker = registered(fake, "lone")
    client = api_as("operator")
    body = {"kind": "detach", "workers": [worker.pk], "drain": True, "reason": "test"}
    refused = client.post("/api/v1/operations/", body, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_router"
    assert "lone" in refused.json()["error"]["message"] and Operation.objects.count() == 0
    preview = client.get(f"/api/v1/operations/preview/?worker={worker.pk}&drain=true").json()
    assert preview[0]["router"] is None and "no router" in preview[0]["warnings"][0]
    op = operation_create(kind="detach", workers=[worker], drain=True, no_router="warn", actor=None)
    target = op.targets.get()
    target_step(target_id=target.pk)
    target.refresh_from_db()
    assert target.explanation == "applied and verified; not drained: no router (no_router=warn)"
    launch = AuditEvent.objects.get(operation_id=op.pk, action="detach", object_type="operations.operation")
    assert launch.extra["undrained_no_router"] == ["lone"]


def test_only_cache_io_in_flight_is_idle_soon(fake_worker):
    fake = fake_worker()
    fake.io_polls = 3
    op = operation_create(kind="detach", workers=[registered(fake, "w")], actor=None, idle_timeout_s=60)
    target = op.targets.get()
    target_step(target_id=target.pk)
    target.refresh_from_db()
    assert target.explanation == "waiting for idle: idle soon: only cache I/O in flight (backups=3)"
    assert drive(op).state == "succeeded"


def test_launch_record_outcome_is_updated_when_the_operation_ends(fake_worker):
    op = drive(operation_create(kind="detach", workers=[registered(fake_worker(), "w")], actor=None))
    launch = AuditEvent.objects.get(operation_id=op.pk, action="detach", object_type="operations.operation")
    assert op.state == "succeeded" and launch.outcome == "success"


def test_the_reaper_leaves_an_apply_whose_step_is_being_redelivered(fake_worker):
    """Issue 15: the Celery worker holding an applying target's step died; Redis hands the step out again once
    the visibility timeout passes. The reaper leaves the target alone until then (a fixed 30 s grace reaped it
    at 90 s, the step came back at 181 s) and the redelivered step finishes it from the live state."""
    fake = fake_worker()
    profile = StorageProfileFactory(backend="file", extra_config=FILE_A)
    op = operation_create(kind="attach", workers=[registered(fake, "w")], storage_profile=profile, actor=None)
    fake.backend, fake.backend_extra = "file", '{"file_path": "/tmp/kvfleet-l3-a"}'  # the engine took it
    options = celery_app.conf.broker_transport_options
    # The step moved the target to applying and sent the attach, then its worker died; now, a visibility
    # timeout and a sweep later, the step is being redelivered.
    taken = timezone.now() - timedelta(
        seconds=options["visibility_timeout"] + options["unacked_restore_interval"]
    )
    OperationTarget.objects.filter(operation=op).update(
        state="applying",
        apply_sent=True,
        before={"hicache_storage_backend": None},
        deadline_at=taken + timedelta(seconds=settings.OPERATION_APPLY_TIMEOUT_S),
    )
    assert reap_stuck_targets() == 0
    assert op.targets.get().state == "applying"
    assert target_step(target_id=op.targets.get().pk) is None  # the redelivered step
    op.refresh_from_db()
    target = op.targets.get()
    assert (target.state, target.explanation) == ("succeeded", "applied and verified")
    assert [c for c in fake.calls if c[0] == "PUT"] == []  # it read the live state, sent nothing again
    assert op.state == "succeeded"


def test_reaper_reads_the_live_state_of_a_lost_apply(fake_worker):
    """Issue 15: the task died after the attach went out; the reaper reads the worker and finishes it."""
    fake = fake_worker()
    profile = StorageProfileFactory(backend="file", extra_config=FILE_A)
    op = operation_create(kind="attach", workers=[registered(fake, "w")], storage_profile=profile, actor=None)
    # The engine took the attach; the task that sent it was killed.
    fake.backend, fake.backend_extra = "file", '{"file_path": "/tmp/kvfleet-l3-a"}'
    OperationTarget.objects.filter(operation=op).update(
        state="applying", apply_sent=True, before={"hicache_storage_backend": None}
    )
    past = timezone.now() - timedelta(seconds=settings.OPERATION_REAPER_GRACE_S + 1)  # no step can come back
    OperationTarget.objects.filter(operation=op).update(deadline_at=past)
    assert reap_stuck_targets() == 1
    op.refresh_from_db()
    target = op.targets.get()
    assert target.state == "succeeded" and target.after["hicache_storage_backend"] == "file"
    assert op.state == "succeeded" and op.targets.get().worker.storage_profile_id == profile.pk
