"""Users and groups changed in the Django admin leave audit records like the API's writes (never the
password hash)."""

import pytest
from cp_factories import UserFactory
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from controlplane.audit.models import AuditEvent

pytestmark = pytest.mark.django_db
User = get_user_model()


@pytest.fixture
def root_client(client):
    root = UserFactory(username="root", is_superuser=True, is_staff=True)
    client.force_login(root)
    return client


def _events(obj) -> list[AuditEvent]:
    return list(
        AuditEvent.objects.filter(object_type=obj._meta.label_lower, object_id=str(obj.pk)).order_by("id")
    )


def test_user_add_change_password_and_delete_in_the_admin_are_audited(root_client):
    viewers = Group.objects.get_or_create(name="viewer")[0]
    added = root_client.post(
        "/admin/auth/user/add/",
        {"username": "ann", "password1": "a-long-pass-9137", "password2": "a-long-pass-9137",
         "usable_password": "true"},
    )  # fmt: skip
    assert added.status_code == 302, added.content[:2000]
    ann = User.objects.get(username="ann")
    changed = root_client.post(
        f"/admin/auth/user/{ann.pk}/change/",
        {"username": "ann", "email": "ann@example.com", "is_active": "", "groups": [viewers.pk],
         "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"},
    )  # fmt: skip
    assert changed.status_code == 302, changed.content[:2000]
    password = root_client.post(
        f"/admin/auth/user/{ann.pk}/password/",
        {"password1": "another-pass-5521", "password2": "another-pass-5521", "usable_password": "true"},
    )
    assert password.status_code == 302
    deleted = root_client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302 and not User.objects.filter(username="ann").exists()

    events = _events(ann)
    assert [e.action for e in events] == ["create", "update", "password_change", "delete"]
    assert all(e.actor_display == "root" and e.message == "Django admin" for e in events)
    assert events[1].changes == {
        "active": [True, False],
        "email": ["", "ann@example.com"],
        "groups": [[], ["viewer"]],
    }
    assert not any("pbkdf2" in str(e.before) + str(e.after) or "md5" in str(e.after) for e in events)


def test_group_permission_changes_in_the_admin_are_audited(root_client):
    from django.contrib.auth.models import Permission

    group = Group.objects.create(name="ops")
    perm = Permission.objects.get(codename="view_host")
    response = root_client.post(
        f"/admin/auth/group/{group.pk}/change/", {"name": "ops", "permissions": [perm.pk]}
    )
    assert response.status_code == 302
    (event,) = _events(group)
    assert event.action == "update"
    assert event.changes == {"permissions": [[], [str(perm)]]}
