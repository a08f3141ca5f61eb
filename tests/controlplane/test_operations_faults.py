"""The control plane under faults: a launch while the task broker is down, delivery across a worker death."""

import socket

import pytest
from cp_factories import EngineWorkerFactory, StorageProfileFactory

from controlplane.celery import app as celery_app
from controlplane.operations.models import Operation, OperationTarget

pytestmark = pytest.mark.django_db(transaction=True)


def _reset_broker_pools():
    """Drop the app's cached connection and producer pools so the next publish uses conf.broker_url."""
    celery_app.amqp._producer_pool = None
    celery_app._pool = None


@pytest.fixture
def broker_down():
    """Point the Celery app at a port nothing listens on; yields that broker's host:port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: connections are refused
    original = celery_app.conf.broker_url

    def restore():
        celery_app.conf.broker_url = original
        _reset_broker_pools()

    _reset_broker_pools()
    celery_app.conf.broker_url = f"redis://:s3cret@127.0.0.1:{port}/0"
    yield f"127.0.0.1:{port}", restore
    restore()


def launch(client, worker, profile, **headers):
    body = {"kind": "attach", "workers": [worker.pk], "storage_profile": profile.pk, "reason": "enable L3"}
    return client.post("/api/v1/operations/", body, format="json", **headers)


@pytest.mark.parametrize("key", [None, "launch-1"])
def test_launch_while_broker_down_is_a_json_503_and_leaves_nothing_pending(api_as, broker_down, key):
    address, broker_back = broker_down
    worker = EngineWorkerFactory(name="w1")
    profile = StorageProfileFactory(backend="file")
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    client = api_as("operator")

    response = launch(client, worker, profile, **headers)

    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "broker_unavailable"
    assert address in error["message"] and error["detail"]["broker"].endswith(f"@{address}/0")
    assert "s3cret" not in response.content.decode()
    op = Operation.objects.get(pk=error["detail"]["operation"])
    assert op.state == "failed"
    target = OperationTarget.objects.get(operation=op)
    assert target.state == "failed"
    assert f"task broker redis://:**@{address}/0 is unreachable" in target.explanation

    # The broker is back: the same request (same Idempotency-Key too) launches; nothing blocks it with a 409.
    broker_back()
    retry = launch(client, worker, profile, **headers)
    assert retry.status_code == 201, retry.content
    assert "Idempotent-Replayed" not in retry
    assert OperationTarget.objects.get(operation_id=retry.json()["id"]).state == "pending"
