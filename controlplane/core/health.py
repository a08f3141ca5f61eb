"""Liveness and readiness.

- ``GET /healthz``: liveness: the process answers (200 ``{"status": "ok"}``); nothing else is checked, so a
  restart is never triggered by a dependency's outage.
- ``GET /readyz``: readiness: the database answers ``SELECT 1`` and Redis (the channel layer and the Celery
  broker, one server) answers PING, each within ``READY_TIMEOUT_S``. PostgreSQL is checked on a connection
  of its own with that connect timeout, not one borrowed from the pool: a borrow waits ``DB_POOL_TIMEOUT_S``
  (10 s) while the server refuses, past the compose healthcheck's own 4 s, so the check never answered.
  200 ``{"status": "ready", "checks": {"database": "ok", "redis": "ok"}}``, else 503 with ``"status":
  "not_ready"`` and, per failed check, the exception's class (the driver's text can carry the server's
  address and user; it goes to the log).
  Keyless, as a load balancer or the compose healthcheck calls it.
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 2.0


def healthz(request):
    return JsonResponse({"status": "ok"})


def _database() -> None:
    if connection.vendor != "postgresql":  # SQLite: a file, nothing to wait for
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return
    import psycopg

    params = connection.get_connection_params()  # Django's own (its pool options taken out)
    with psycopg.connect(**params, connect_timeout=max(2, round(READY_TIMEOUT_S))) as conn:
        conn.execute("SELECT 1")


def _redis() -> None:
    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=READY_TIMEOUT_S, socket_connect_timeout=READY_TIMEOUT_S
    )
    try:
        client.ping()
    finally:
        client.close()


CHECKS = {"database": _database, "redis": _redis}


def readyz(request):
    checks, ready = {}, True
    for name, check in CHECKS.items():
        try:
            check()
            checks[name] = "ok"
        except Exception as exc:  # any failure means not ready; the class is the answer, the text the log's
            log.warning("readiness: %s failed: %r", name, exc)
            checks[name] = f"failed: {type(exc).__name__}"
            ready = False
    body = {"status": "ready" if ready else "not_ready", "checks": checks}
    return JsonResponse(body, status=200 if ready else 503)
