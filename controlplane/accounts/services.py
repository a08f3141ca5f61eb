"""Writes for accounts: users with a role, token issue and revoke. Each write leaves one audit record."""

import secrets
from datetime import datetime

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from controlplane.accounts import token_cache
from controlplane.accounts.models import ApiToken, Role
from controlplane.accounts.selectors import TOKEN_PREFIX, forget_role, token_digest, user_role
from controlplane.audit.services import audit_record
from controlplane.core.broadcast import emit_on_commit
from controlplane.core.events import token_group
from controlplane.core.exceptions import ApplicationError


def _user_snapshot(user) -> dict:
    return {
        "username": user.get_username(),
        "email": user.email,
        "role": user_role(user),
        "active": user.is_active,
    }


def _set_role(user, role: str) -> None:
    if role not in Role.values:
        raise ApplicationError(
            f"unknown role {role!r}; choose one of {', '.join(Role.values)}", code="bad_role"
        )
    user.groups.set([Group.objects.get_or_create(name=role)[0]])
    forget_role(user)


@transaction.atomic
def user_create(*, username: str, password: str, role: str, email: str = "", actor) -> object:
    User = get_user_model()
    if User.objects.filter(username=username).exists():
        raise ApplicationError(f"user {username!r} already exists", code="duplicate")
    user = User(username=username, email=email)
    user.set_password(password)
    user.full_clean()
    user.save()
    _set_role(user, role)
    audit_record(action="create", obj=user, after=_user_snapshot(user), actor=actor)
    return user


@transaction.atomic
def user_update(
    *, user, actor, role: str | None = None, is_active: bool | None = None, email: str | None = None
):
    before = _user_snapshot(user)
    if role is not None:
        _set_role(user, role)
    if is_active is not None:
        user.is_active = is_active
    if email is not None:
        user.email = email
    user.save()
    audit_record(action="update", obj=user, before=before, after=_user_snapshot(user), actor=actor)
    return user


@transaction.atomic
def token_create(
    *,
    user,
    name: str,
    actor,
    write_enabled: bool = True,
    expires_at: datetime | None = None,
    host: str = "",
) -> tuple[ApiToken, str]:
    """Issue a token; returns (token, plaintext). The plaintext is never stored and shown only once.

    A token of an ``agent`` user must name its ``host`` (an inventory host name, which need not exist yet):
    its register, heartbeat and metrics calls may touch only that host and its workers. Other roles take no
    host. Raises ApplicationError (400) naming ``host`` or ``expires_at``.
    """
    if expires_at is not None and expires_at <= timezone.now():
        raise ApplicationError("expires_at must be in the future", code="bad_expiry")
    is_agent = user_role(user) == Role.AGENT
    if is_agent and not host:
        raise ApplicationError(
            "an agent token must name the host it serves",
            code="host_required",
            detail={"host": ["required for agent tokens"]},
        )
    if host and not is_agent:
        raise ApplicationError(
            f"only agent tokens are bound to a host; {user.get_username()!r} is not an agent",
            code="bad_host",
            detail={"host": ["only for agent tokens"]},
        )
    prefix = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=prefix,
        secret_hash=token_digest(secret),
        write_enabled=write_enabled,
        expires_at=expires_at,
        host_name=host,
    )
    audit_record(action="token_create", obj=token, after=token.audit_snapshot(), actor=actor)
    return token, f"{TOKEN_PREFIX}{prefix}.{secret}"


@transaction.atomic
def token_revoke(*, token: ApiToken, actor) -> ApiToken:
    if token.revoked_at is not None:
        raise ApplicationError("token already revoked", code="already_revoked")
    before = token.audit_snapshot()
    token.revoked_at = timezone.now()
    token.save(update_fields=["revoked_at"])
    audit_record(action="token_revoke", obj=token, before=before, after=token.audit_snapshot(), actor=actor)
    # Open websockets of this token close once the revoke is committed.
    emit_on_commit(token_group(token.prefix), "control.revoked", {"prefix": token.prefix})
    return token


def token_touch(token: ApiToken) -> None:
    """Record use at most once a minute (avoids a write on every request)."""
    now = timezone.now()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > 60:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
        token_cache.touched(token.prefix, now)
