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


def test_a_refusing_postgresql_is_not_ready_within_the_check_timeout(client, monkeypatch):
    """Not a borrow from the pool (it waits DB_POOL_TIMEOUT_S, 10 s, past the compose healthcheck's 4 s):
    a connection of its own to a port nothing listens on, answered 503. The pool is made to fail loudly,
    so a borrow would say so instead of OperationalError."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the pooled database is PostgreSQL's (DATABASE_URL)")

    def borrowed(*args, **kwargs):
        raise AssertionError("the readiness check borrowed a pooled connection")

    monkeypatch.setattr(connection, "ensure_connection", borrowed)
    monkeypatch.setattr(connection, "cursor", borrowed)
    port, own = free_port(), connection.settings_dict["PORT"]  # nothing listens on it: refused
    connection.settings_dict["PORT"] = port
    try:
        response = client.get("/readyz")
    finally:
        connection.settings_dict["PORT"] = own
    assert response.status_code == 503 and response.json()["checks"]["database"] == "failed: OperationalError"
