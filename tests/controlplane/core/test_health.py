"""Liveness (/healthz) and readiness (/readyz: the database and Redis, each checked for real)."""

import pytest

from engine.ports import free_port

pytestmark = pytest.mark.django_db


def test_ready_when_the_database_and_redis_answer(client):
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}}


def test_not_ready_while_redis_refuses_and_live_all_the_same(client, settings):
    port = free_port()  # nothing listens on it: connections are refused
    settings.REDIS_URL = f"redis://:secret-pass@127.0.0.1:{port}/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready" and body["checks"]["database"] == "ok"
    assert body["checks"]["redis"].startswith("failed: ") and "secret-pass" not in response.content.decode()
    assert client.get("/healthz").status_code == 200


def test_not_ready_while_the_database_refuses(client, monkeypatch):
    from django.db import OperationalError

    from controlplane.core import health

    def refused():
        raise OperationalError("connection to server at 127.0.0.1 refused")

    monkeypatch.setitem(health.CHECKS, "database", refused)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"] == {"database": "failed: OperationalError", "redis": "ok"}


def test_a_refusing_postgresql_is_not_ready_within_the_check_timeout(client):
    """Not a borrow from the pool (it waits DB_POOL_TIMEOUT_S, 10 s, past the compose healthcheck's 4 s):
    a real connect to a port nothing listens on, answered 503 well inside that (a loaded 2-core box)."""
    import time

    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the pooled database is PostgreSQL's (DATABASE_URL)")
    port, own = free_port(), connection.settings_dict["PORT"]  # nothing listens on it: refused
    connection.settings_dict["PORT"] = port
    try:
        started = time.monotonic()
        response = client.get("/readyz")
        took = time.monotonic() - started
    finally:
        connection.settings_dict["PORT"] = own
    assert response.status_code == 503 and response.json()["checks"]["database"] == "failed: OperationalError"
    assert took < 8, took  # the pool's borrow took 10 s
