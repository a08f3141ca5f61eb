"""Closing the websockets of credentials that stop being valid: a user deactivated or deleted (every socket
of theirs, ``user.<id>``), a console session logged out (its sockets, ``session.<digest>``). API tokens are
closed by ``services.token_revoke``. Each sends ``control.revoked`` once the change is committed; the
consumer closes the socket with 4401."""

from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

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
