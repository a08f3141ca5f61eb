"""A per-process cache of resolved agent API tokens, so that an agent's requests do not read the database
to authenticate (two queries per request before: the token with its user, and the user's role groups).
Only agent tokens are cached (``selectors.token_get_by_plaintext``): operators' and viewers' requests are
few, and read their token from the database as before.

An entry maps a token prefix to the token row, its user and the user's role as read from the database,
with the digest of the secret that resolved it. It is used only while the *auth epoch* in Redis
(``<REDIS_KEY_PREFIX>:auth:epoch``) is the one it was read under, and for at most ``MAX_AGE_S``: every
committed change to a token, a user or a user's groups increments the epoch
(``controlplane.accounts.signals``), so a revoke, a deactivation or a role change is seen by every process
on its next request. Each lookup costs one Redis GET. When Redis cannot be read, nothing is cached and the
caller reads the database as before. A change made around the models (a queryset ``update()``, SQL) sends
no signal: it is seen once the entry is ``MAX_AGE_S`` old, or at once after ``bump_epoch()``.

A token's validity (revoked, expired, user inactive) is checked by the caller on every request from the
cached row, so an expiry needs no epoch change. Callers get copies of the cached objects: a request may set
attributes on its ``request.user`` without another request seeing them.
"""

import copy
import hmac
import logging
import threading
import time

from django.conf import settings

from controlplane.accounts.models import ApiToken

log = logging.getLogger(__name__)
MAX_AGE_S = 60.0
MAX_ENTRIES = 100_000

_entries: dict[str, tuple[str, int, float, ApiToken]] = {}
_lock = threading.Lock()


def _epoch_key() -> str:
    return f"{settings.REDIS_KEY_PREFIX}:auth:epoch"


def _client():
    from controlplane.telemetry.store import client

    return client()


def current_epoch() -> int | None:
    """The auth epoch in Redis (0 before any change), or None when Redis cannot be read."""
    try:
        return int(_client().get(_epoch_key()) or 0)
    except Exception as exc:  # noqa: BLE001 - no cache then; the database still answers
        log.warning("auth epoch unreadable, tokens read from the database: %r", exc)
        return None


def bump_epoch() -> None:
    """Invalidate every process's cached tokens (call once a change to tokens, users or groups is
    committed). Also clears this process's cache, so it holds even while Redis is unreachable here."""
    clear()
    try:
        _client().incr(_epoch_key())
    except Exception as exc:  # noqa: BLE001 - other processes' entries still expire after MAX_AGE_S
        log.error("could not advance the auth epoch: %r", exc)


def get(prefix: str, digest: str, epoch: int) -> ApiToken | None:
    """A copy of the cached token for ``prefix`` (with a copy of its user) when it was resolved from the same
    secret digest under ``epoch`` less than ``MAX_AGE_S`` ago; else None."""
    with _lock:
        hit = _entries.get(prefix)
    if hit is None or hit[1] != epoch or hit[2] < time.monotonic() or not hmac.compare_digest(hit[0], digest):
        return None
    token = copy.copy(hit[3])
    token.user = copy.copy(hit[3].user)
    return token


def put(prefix: str, digest: str, epoch: int, token: ApiToken) -> None:
    """Remember ``token`` (with its user, and the user's role already resolved on it) under ``epoch``."""
    stored = copy.copy(token)
    stored.user = copy.copy(token.user)
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[prefix] = (digest, epoch, time.monotonic() + MAX_AGE_S, stored)


def touched(prefix: str, when) -> None:
    """Record in the cached row that the token's ``last_used_at`` was written (``when``)."""
    with _lock:
        hit = _entries.get(prefix)
        if hit is not None:
            hit[3].last_used_at = when


def clear() -> None:
    with _lock:
        _entries.clear()
