"""Reads for accounts: a user's role, token lookup by presented value."""

import hashlib
import hmac

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from rest_framework.exceptions import PermissionDenied

from controlplane.accounts import token_cache
from controlplane.accounts.models import ApiToken, Role

_ROLE_ORDER = (Role.ADMIN, Role.OPERATOR, Role.VIEWER, Role.AGENT)
TOKEN_PREFIX = "cp_"


# ``user_role``'s answer, memoised on the user instance (one query per request); ``forget_role`` drops it
ROLE_MEMO = "kvfleet_role"


def user_role(user) -> str | None:
    """The user's role: superusers are admin; otherwise the strongest role group they belong to."""
    if not user or not user.is_authenticated:
        return None
    if user.is_superuser:
        return Role.ADMIN
    cached = getattr(user, ROLE_MEMO, False)  # a request's user is a lazy proxy: getattr reaches the user
    if cached is not False:
        return cached
    names = set(user.groups.values_list("name", flat=True))
    role = next((r.value for r in _ROLE_ORDER if r.value in names), None)
    setattr(user, ROLE_MEMO, role)
    return role


def forget_role(user) -> None:
    """Drop the role ``user_role`` memoised on this ``user`` instance (its groups changed)."""
    setattr(user, ROLE_MEMO, False)


def token_digest(secret: str) -> str:
    pepper = settings.TOKEN_PEPPER or f"kvfleet-token-pepper:{settings.SECRET_KEY}"
    return hmac.new(pepper.encode(), secret.encode(), hashlib.sha256).hexdigest()


def token_get_by_plaintext(value: str) -> ApiToken | None:
    """Resolve `cp_<prefix>.<secret>` to an active token (with its user, and the user's role resolved),
    comparing digests in constant time. Agent tokens (the fleet's heartbeats and samples, most requests) are
    served from ``token_cache`` while the auth epoch is unchanged (one Redis read), else read from the
    database and cached; every other token is read from the database on each request."""
    if not value.startswith(TOKEN_PREFIX) or "." not in value:
        return None
    prefix, secret = value[len(TOKEN_PREFIX) :].split(".", 1)
    digest = token_digest(secret)
    epoch = token_cache.current_epoch()
    token = token_cache.get(prefix, digest, epoch) if epoch is not None else None
    if token is None:
        token = ApiToken.objects.select_related("user").filter(prefix=prefix).first()
        if token is None or not hmac.compare_digest(token.secret_hash, digest):
            return None
        if epoch is not None and user_role(token.user) == Role.AGENT:  # the copies carry the role
            token_cache.put(prefix, digest, epoch, token)
    return token if token.is_active and token.user.is_active else None


def agent_host_scope(user, auth) -> str | None:
    """The host an agent-API caller may touch: the bound host name of an agent token; None (any host) for
    operators and admins. Raises PermissionDenied (403) for an agent without a host-bound token."""
    if user_role(user) != Role.AGENT:
        return None
    host = auth.host_name if isinstance(auth, ApiToken) else ""
    if not host:
        raise PermissionDenied(
            "this agent token is bound to no host; issue a new agent token with 'host' set"
        )
    return host


def user_list() -> QuerySet:
    return get_user_model().objects.prefetch_related("groups").order_by("username")


def token_list() -> QuerySet:
    return ApiToken.objects.select_related("user")
