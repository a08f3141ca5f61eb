"""Audit rows are append-only in the database (triggers on SQLite and PostgreSQL), not only in the ORM."""

import pytest
from cp_factories import UserFactory
from django.db import DatabaseError, transaction

from controlplane.audit.append_only import set_purge_allowed
from controlplane.audit.models import AuditEvent, Outcome
from controlplane.audit.services import audit_outcome_resolve, audit_record

pytestmark = pytest.mark.django_db


@pytest.fixture
def no_purge():
    set_purge_allowed(False)
    yield
    set_purge_allowed(True)


def refused(fn) -> bool:
    try:
        with transaction.atomic():
            fn()
    except DatabaseError as exc:
        return "append-only" in str(exc)
    return False


def test_update_and_delete_are_refused_by_the_database(no_purge):
    event = audit_record(action="update", object_type="x", object_id="1", message="kept")
    rows = AuditEvent.objects.filter(pk=event.pk)
    assert refused(lambda: rows.update(message="rewritten"))
    assert refused(lambda: rows.update(outcome=Outcome.FAILURE))  # a success record stays a success
    assert refused(lambda: rows.delete())
    assert AuditEvent.objects.get(pk=event.pk).message == "kept"


def test_deleting_a_user_keeps_the_actor_in_the_row(no_purge):
    user = UserFactory(username="alice")
    event = audit_record(action="update", object_type="x", object_id="1", actor=user)
    user_id = user.pk
    user.delete()
    row = AuditEvent.objects.get(pk=event.pk)
    assert (row.actor_id, row.actor_display) == (user_id, "alice")


def test_only_a_pending_outcome_is_resolved_once(no_purge):
    event = audit_record(
        action="detach", object_type="operations.operation", object_id="7", operation_id=7, outcome="pending"
    )
    assert audit_outcome_resolve(operation_id=7, action="detach", outcome=Outcome.SUCCESS) == 1
    assert AuditEvent.objects.get(pk=event.pk).outcome == "success"
    assert audit_outcome_resolve(operation_id=7, action="detach", outcome=Outcome.FAILURE) == 0
    assert refused(lambda: AuditEvent.objects.filter(pk=event.pk).update(outcome=Outcome.FAILURE))
