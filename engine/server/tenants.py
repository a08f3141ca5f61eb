"""Tenants by API key (``--tenant-keys-file``): each key's requests get their tenant's cache key space.

The file is JSON: ``{"tenants": {NAME: {"api_keys": [KEY, ...], "cache_group": GROUP, "max_requests": N,
"l2_max_tokens": T, "l3_max_pages": P}}}``.
``api_keys`` (at least one, each unique across tenants) authenticate the tenant's requests as
``Authorization: Bearer KEY`` (both routers, smg and sglang-router, forward that header unchanged).
``cache_group`` (default: the tenant's name) is what the cache salt derives from: tenants never share
cached KV unless the operator gives them one group. ``max_requests`` (optional, >= 1) caps the tenant's
inference requests in flight on this worker (from arrival to the last byte): one more is a 429 naming the
tenant and its limit.
``l2_max_tokens`` / ``l3_max_pages`` (optional, >= 1) cap the group's occupancy of this worker's host pool
(tokens) and what it sends to L3 (pages): over its cap a group evicts its own L2 pages first, or is not
backed up (``engine/cache/tenant_caps.py``); tenants sharing a group must give it the same caps.

A tenant's request runs in the salt :func:`tenant_salt` derives from its group and the body's own
``cache_salt`` (which splits the tenant's space further), so no body salt of any key maps into another
tenant's space (the ``--api-key`` holder's body salts are derived too, under no group). The worker's
``--api-key`` stays valid for the shared (unsalted) space and for the operator routes; with a tenants
file every inference request needs one of the keys (401 otherwise). Keys are looked up by their SHA-256,
kept nowhere else, and never logged, counted or echoed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from engine.server.http_utils import HTTPError, bearer_token, error_response, require_api_key

# Routes whose requests run in a tenant's key space (the inference routes and the model list).
TENANT_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models"})
INFERENCE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
TENANT_FIELDS = ("api_keys", "cache_group", "max_requests", "l2_max_tokens", "l3_max_pages")


class TenantConfigError(ValueError):
    """The tenants file is unreadable or malformed; the message names the file and the field."""


def _digest(*parts: str | None) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def tenant_salt(group: str | None, cache_salt: str | None) -> str:
    """The cache salt of a request of tenant group ``group`` (None: the ``--api-key`` holder) carrying body
    salt ``cache_salt`` (or none), the same on every worker for the same pair: the group's own salt (a
    64-hex-digit SHA-256) or, with a body salt, ``<group salt>/<SHA-256 of both>``, so the cache counts
    every key space of a group against the group's caps (``engine.cache.tenant_caps.salt_owner``)."""
    base = _digest("kvfleet-tenant", group, None)
    return base if cache_salt is None else f"{base}/{_digest('kvfleet-tenant', group, cache_salt)}"


def salt_label(salt: str | None) -> str:
    """A salt's metric label: 12 hex digits of a digest of it (never the salt), ``none`` for no salt."""
    return "none" if salt is None else _digest("kvfleet-salt-label", salt)[:12]


@dataclass(frozen=True)
class Tenant:
    name: str
    group: str
    max_requests: int | None = None
    l2_max_tokens: int | None = None
    l3_max_pages: int | None = None

    @property
    def label(self) -> str:
        """The metric label of this tenant's requests that carry no body salt."""
        return salt_label(tenant_salt(self.group, None))


@dataclass
class Tenants:
    """The tenants of one worker, looked up by the SHA-256 of a bearer token; counts requests in flight."""

    by_key_digest: dict[str, Tenant]
    _inflight: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, path: str) -> Tenants:
        """Parse the tenants file; raises ``TenantConfigError`` naming the problem (never a key)."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise TenantConfigError(f"{path}: {exc.strerror}") from None
        except ValueError as exc:
            raise TenantConfigError(f"{path}: not JSON ({exc})") from None
        tenants = raw.get("tenants") if isinstance(raw, dict) else None
        if not isinstance(tenants, dict) or not tenants:
            raise TenantConfigError(f'{path}: needs {{"tenants": {{NAME: {{"api_keys": [...]}}}}}}')
        by_digest: dict[str, Tenant] = {}
        for name, spec in tenants.items():
            where = f"{path}: tenants.{name}"
            if not isinstance(spec, dict):
                raise TenantConfigError(f"{where} must be an object")
            if unknown := sorted(set(spec) - set(TENANT_FIELDS)):
                raise TenantConfigError(
                    f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(TENANT_FIELDS)})"
                )
            keys = spec.get("api_keys")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise TenantConfigError(f"{where}.api_keys must be a non-empty list of non-empty strings")
            group = spec.get("cache_group", name)
            if not isinstance(group, str) or not group:
                raise TenantConfigError(f"{where}.cache_group must be a non-empty string")
            limits = {}
            for limit in ("max_requests", "l2_max_tokens", "l3_max_pages"):
                value = spec.get(limit)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise TenantConfigError(f"{where}.{limit} must be an integer >= 1")
                limits[limit] = value
            tenant = Tenant(name, group, **limits)
            for key in keys:
                digest = hashlib.sha256(key.encode()).hexdigest()
                if digest in by_digest:
                    raise TenantConfigError(
                        f"{where}.api_keys: a key is listed twice (tenants must not share keys)"
                    )
                by_digest[digest] = tenant
        loaded = cls(by_digest)
        try:
            loaded.caps()  # tenants of one group agree on its caps
        except TenantConfigError as exc:
            raise TenantConfigError(f"{path}: {exc}") from None
        return loaded

    def caps(self) -> dict[str, tuple[int | None, int | None]]:
        """``{group salt: (l2_max_tokens, l3_max_pages)}`` for every group with a cap (keyed as the cache
        counts owners). Raises ``TenantConfigError`` when tenants of one group give it different caps."""
        caps: dict[str, tuple[int | None, int | None]] = {}
        for tenant in self.tenants:
            pair = (tenant.l2_max_tokens, tenant.l3_max_pages)
            if pair == (None, None):
                continue
            salt = tenant_salt(tenant.group, None)
            if caps.setdefault(salt, pair) != pair or any(
                t.group == tenant.group and (t.l2_max_tokens, t.l3_max_pages) != pair for t in self.tenants
            ):
                raise TenantConfigError(
                    f"tenants.{tenant.name}: tenants of cache_group {tenant.group!r} give it different "
                    "l2_max_tokens / l3_max_pages"
                )
        return caps

    @property
    def tenants(self) -> list[Tenant]:
        return sorted(set(self.by_key_digest.values()), key=lambda t: t.name)

    def find(self, token: str | None) -> Tenant | None:
        if not token:
            return None
        return self.by_key_digest.get(hashlib.sha256(token.encode()).hexdigest())

    @contextmanager
    def slot(self, tenant: Tenant) -> Iterator[bool]:
        """Hold one of ``tenant``'s request slots; yields False (holding none) when its cap is reached."""
        with self._lock:
            n = self._inflight.get(tenant.name, 0)
            ok = tenant.max_requests is None or n < tenant.max_requests
            if ok:
                self._inflight[tenant.name] = n + 1
        try:
            yield ok
        finally:
            if ok:
                with self._lock:
                    self._inflight[tenant.name] -= 1


class TenantGate:
    """ASGI middleware (with a tenants file): finds the tenant of a request to ``TENANT_PATHS`` by its
    bearer key, puts it on ``request.state.tenant`` and, for inference, holds one of its slots until the
    response has ended (a stream: its last frame); a tenant at ``max_requests`` gets a 429 at once."""

    def __init__(self, app, tenants: Tenants, on_rejected=None):
        self.app = app
        self.tenants = tenants
        self.on_rejected = on_rejected  # called with the tenant's label when its cap refuses a request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in TENANT_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        tenant = self.tenants.find(bearer_token(headers.get(b"authorization", b"").decode("latin-1")))
        if tenant is None:
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        if scope["path"] not in INFERENCE_PATHS:
            return await self.app(scope, receive, send)
        with self.tenants.slot(tenant) as ok:
            if not ok:
                if self.on_rejected is not None:
                    self.on_rejected(tenant.label)
                message = (
                    f"tenant {tenant.name!r} has {tenant.max_requests} requests in flight, its max_requests "
                    "(--tenant-keys-file); retry when one has finished"
                )
                return await error_response(429, message)(scope, receive, send)
            await self.app(scope, receive, send)


def authorize(request: Request) -> Tenant | None:
    """The tenant of an inference request (None: the shared space). Without a tenants file: the
    ``--api-key`` check (``HTTPError(401)``). With one: a tenant key, or else the ``--api-key``, is
    required (401 naming neither key)."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is not None:
        return tenant
    engine = request.app.state.engine
    if engine.tenants is not None and not engine.args.api_key:
        raise HTTPError(401, "Unauthorized: missing or wrong API key (this worker serves tenants' keys)")
    require_api_key(request)
    return None


def request_salt(engine, tenant: Tenant | None, cache_salt: str | None) -> str | None:
    """The salt a request of ``engine`` runs in. Without a tenants file: its body's ``cache_salt``. With
    one: its tenant's (:func:`tenant_salt`); an ``--api-key`` request stays in the shared space, or with a
    body salt gets one derived apart from every tenant's, so no body salt reaches a tenant's space."""
    if engine.tenants is None or (tenant is None and cache_salt is None):
        return cache_salt
    return tenant_salt(tenant.group if tenant else None, cache_salt)
