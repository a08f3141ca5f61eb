"""Closing the websockets of credentials that stop being valid: a user deactivated or deleted (every socket
of theirs, ``user.<id>``), a console session logged out (its sockets, ``session.<digest>``). API tokens are
closed by ``services.token_revoke``. Each sends ``control.revoked`` once the change is committed; the
consumer closes the socket with 4401.

Any committed change to a token, a user, a user's groups or a group also advances the auth epoch
(``token_cache.bump_epoch``), so no process keeps authenticating from a cached copy of the old rows."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from controlplane.accounts import token_cache
from controlplane.accounts.models import ApiToken
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import session_group, user_group

User = get_user_model()


def _revoke(group: str, reason: str) -> None:
    emit_on_commit(group, "control.revoked", {"reason": reason})


@receiver(post_save, sender=User, dispatch_uid="accounts.close_inactive_user_sockets")
def close_sockets_of_inactive_user(sender, instance, update_fields=None, **kwargs):
    if not instance.is_active and (update_fields is None or "is_active" in update_fields):
        _revoke(user_group(instance.pk), "user deactivated")


@receiver(post_delete, sender=User, dispatch_uid="accounts.close_deleted_user_sockets")
def close_sockets_of_deleted_user(sender, instance, **kwargs):
    _revoke(user_group(instance.pk), "user deleted")


@receiver(user_logged_out, dispatch_uid="accounts.close_logged_out_session_sockets")
def close_sockets_of_logged_out_session(sender, request, user, **kwargs):
    key = getattr(getattr(request, "session", None), "session_key", None)
    if key:
        _revoke(session_group(key), "logged out")


_NOT_AUTH_FIELDS = frozenset({"last_login", "last_used_at"})


def _auth_changed(sender, update_fields=None, **kwargs) -> None:
    if update_fields is not None and set(update_fields) <= _NOT_AUTH_FIELDS:
        return  # a login or a token's use time: nothing that authentication reads
    # Now (this process, and a change whose transaction another test or caller never commits) and again
    # at commit: a request elsewhere may cache the old rows between the first bump and the commit.
    token_cache.bump_epoch()
    transaction.on_commit(token_cache.bump_epoch)


for _model in (ApiToken, User, Group):
    post_save.connect(_auth_changed, sender=_model, dispatch_uid=f"auth_epoch_save_{_model.__name__}")
    post_delete.connect(_auth_changed, sender=_model, dispatch_uid=f"auth_epoch_del_{_model.__name__}")
m2m_changed.connect(_auth_changed, sender=User.groups.through, dispatch_uid="accounts.auth_epoch_groups")
