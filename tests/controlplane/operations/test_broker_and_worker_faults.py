"""The control plane under faults: a launch while the task broker is down, delivery across a worker death and
across Redis restarts."""

import contextlib
import time

import pytest
import redis
from cp_factories import EngineWorkerFactory, StorageProfileFactory
from django.conf import settings

from controlplane.audit.models import AuditEvent
from controlplane.celery import app as celery_app
from controlplane.operations.models import Operation, OperationTarget
from controlplane.operations.tasks import target_step_task
from engine.ports import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def _reset_broker_pools():
    """Drop the app's cached connection and producer pools so the next publish uses conf.broker_url."""
    celery_app.amqp._producer_pool = None
    celery_app._pool = None


@contextlib.contextmanager
def use_broker(url: str):
    """Publish from this process to `url` inside the block."""
    original = celery_app.conf.broker_url
    _reset_broker_pools()
    celery_app.conf.broker_url = url
    try:
        yield
    finally:
        celery_app.conf.broker_url = original
        _reset_broker_pools()


@pytest.fixture
def broker_down():
    """Point the Celery app at a port nothing listens on; yields (that broker's host:port, restore())."""
    port = free_port()  # nothing listens on it: connections are refused
    with contextlib.ExitStack() as stack:
        stack.enter_context(use_broker(f"redis://:s3cret@127.0.0.1:{port}/0"))
        yield f"127.0.0.1:{port}", stack.close


def wait_for(predicate, what: str, limit_s: float = 60.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def launch(client, worker, profile, **headers):
    body = {"kind": "attach", "workers": [worker.pk], "storage_profile": profile.pk, "reason": "enable L3"}
    body["idle_timeout_s"] = 30
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
    assert address in error["message"] and error["detail"]["broker"] == f"redis://{address}/0"
    assert "s3cret" not in response.content.decode()
    op = Operation.objects.get(pk=error["detail"]["operation"])
    assert op.state == "failed"
    target = OperationTarget.objects.get(operation=op)
    assert target.state == "failed"
    assert f"task broker redis://{address}/0 is unreachable" in target.explanation

    # The broker is back: the same request (same Idempotency-Key too) launches; nothing blocks it with a 409.
    # Its step goes to a queue no worker consumes (the suite's Celery worker would run it against a fake URL).
    broker_back()
    original_queue = celery_app.conf.task_default_queue
    unconsumed = f"{original_queue}-unconsumed"
    queue = redis.Redis.from_url(celery_app.conf.broker_url)
    queue.delete(unconsumed)
    celery_app.conf.task_default_queue = unconsumed
    try:
        retry = launch(client, worker, profile, **headers)
    finally:
        celery_app.conf.task_default_queue = original_queue
    assert retry.status_code == 201, retry.content
    assert "Idempotent-Replayed" not in retry
    assert OperationTarget.objects.get(operation_id=retry.json()["id"]).state == "pending"
    assert queue.llen(unconsumed) == 1  # the step was published: one message waits on the broker
    queue.delete(unconsumed)


def test_step_tasks_are_acked_after_the_step_and_redelivered_within_a_bounded_time():
    assert target_step_task.acks_late and target_step_task.reject_on_worker_lost
    held_s = settings.OPERATION_POLL_INTERVAL_S + settings.CELERY_TASK_TIME_LIMIT
    visibility = celery_app.conf.broker_transport_options["visibility_timeout"]
    assert held_s < visibility <= 2 * held_s + 1  # a held step is never redelivered early; a lost one is soon
    options = celery_app.conf.broker_transport_options
    assert options["unacked_restore_interval"] * options["unacked_restore_throttle"] <= visibility / 10 + 1


def test_the_reaper_acts_only_once_no_step_can_be_redelivered():
    """A step taken before its target's deadline whose worker died comes back within a visibility timeout
    plus one sweep and runs within the hard limit: the reaper's grace covers exactly that (no less, or it
    settles a target its redelivered step is about to finish; no more, since a lost one waits for it)."""
    options = celery_app.conf.broker_transport_options
    sweep = options["unacked_restore_interval"] * options["unacked_restore_throttle"]
    redelivered_and_run = options["visibility_timeout"] + sweep + settings.CELERY_TASK_TIME_LIMIT
    assert redelivered_and_run <= settings.OPERATION_REAPER_GRACE_S <= redelivered_and_run + 1


@pytest.mark.slow
def test_a_step_whose_celery_worker_was_killed_is_redelivered_and_finishes(
    api_as, fake_worker, own_redis, spawn_celery_worker
):
    # Short HTTP timeouts give a short step bound, so a visibility timeout of ceil(2 * (0.1 + 6)) = 13 s,
    # swept every 1 s.
    env = {"WORKER_HTTP_TIMEOUT_S": "0.5", "WORKER_APPLY_HTTP_TIMEOUT_S": "1"}
    fake = fake_worker()
    fake.apply_delay_s = 30  # the attach is made, its answer hangs: worker "a" dies mid-step
    worker = EngineWorkerFactory(name="w1", url=fake.url, admin_key=fake.admin_key)
    profile = StorageProfileFactory(
        backend="mooncake", extra_config={"master_server_address": "127.0.0.1:50051"}
    )
    with use_broker(own_redis["url"]):
        first = spawn_celery_worker("a", own_redis["url"], **env)
        response = launch(api_as("operator"), worker, profile)
        assert response.status_code == 201, response.content
        target = OperationTarget.objects.get(operation_id=response.json()["id"])
        wait_for(lambda: any(c[0] == "PUT" for c in fake.calls), "the attach request", limit_s=90)
        first.kill()
        first.wait(10)
        target.refresh_from_db()
        assert (target.state, target.apply_sent, fake.backend) == ("applying", True, "mooncake")

        spawn_celery_worker("b", own_redis["url"], **env)
        op = wait_for(
            lambda: (o := Operation.objects.get(pk=target.operation_id)).state != "running" and o,
            "the redelivered step to finish the operation",
            limit_s=90,
        )
    target.refresh_from_db()
    assert op.state == "succeeded", list(op.targets.values("state", "explanation"))
    assert (target.state, target.changed, target.explanation) == ("succeeded", True, "applied and verified")
    assert [c for c in fake.calls if c[0] == "PUT"] == [("PUT", "/hicache/storage-backend")]  # not re-sent
    audit = AuditEvent.objects.get(operation_id=op.pk, object_type="inventory.engineworker")
    assert audit.outcome == "success" and audit.after["hicache_storage_backend"] == "mooncake"


@pytest.mark.slow
def test_the_celery_worker_survives_a_redis_restart(api_as, fake_worker, own_redis, spawn_celery_worker):
    busy = fake_worker(busy_polls=-1)  # busy: its target polls, so a step message is held when Redis dies
    fresh = fake_worker()
    w1 = EngineWorkerFactory(name="w1", url=busy.url, admin_key=busy.admin_key)
    w2 = EngineWorkerFactory(name="w2", url=fresh.url, admin_key=fresh.admin_key)
    profile = StorageProfileFactory(
        backend="mooncake", extra_config={"master_server_address": "127.0.0.1:50051"}
    )
    with use_broker(own_redis["url"]):
        celery = spawn_celery_worker("a", own_redis["url"])
        response = launch(api_as("operator"), w1, profile)
        assert response.status_code == 201, response.content
        target = OperationTarget.objects.get(operation_id=response.json()["id"])
        wait_for(
            lambda: OperationTarget.objects.get(pk=target.pk).state == "waiting_for_idle", "idle polling"
        )
        own_redis["proc"].kill()
        own_redis["proc"].wait(10)
        own_redis["start"]()  # same port, empty

        response = launch(api_as("operator"), w2, profile)
        assert response.status_code == 201, response.content
        op = wait_for(
            lambda: (o := Operation.objects.get(pk=response.json()["id"])).state != "running" and o,
            "an operation launched after the restart to finish",
        )
        assert celery.poll() is None, "the Celery worker exited"
    assert op.state == "succeeded", list(op.targets.values("state", "explanation"))
    assert fresh.backend == "mooncake"


@pytest.mark.slow
@pytest.mark.parametrize("own_redis", ["persistent"], indirect=True)
def test_a_queued_step_survives_a_redis_restart_and_finishes(
    api_as, fake_worker, own_redis, spawn_celery_worker
):
    """Redis as KVFleet starts it (append-only file): a step queued while no Celery worker runs, once written
    to the file, is still there after a SIGKILL and restart, and a worker started afterwards finishes the
    operation. With the earlier settings (no persistence) the restarted Redis was empty and the operation
    waited for the reaper."""
    fake = fake_worker()
    worker = EngineWorkerFactory(name="w1", url=fake.url, admin_key=fake.admin_key)
    profile = StorageProfileFactory(
        backend="mooncake", extra_config={"master_server_address": "127.0.0.1:50051"}
    )
    with use_broker(own_redis["url"]):
        response = launch(api_as("operator"), worker, profile)
        assert response.status_code == 201, response.content
        queue = redis.Redis.from_url(own_redis["url"])
        assert queue.llen(celery_app.conf.task_default_queue) == 1  # the first step waits: no worker yet
        # everysec may hold a write back while the previous fsync runs: SIGKILL once the file has it
        wait_for(lambda: queue.info("persistence")["aof_buffer_length"] == 0, "the append-only file written")
        own_redis["proc"].kill()
        own_redis["proc"].wait(10)
        own_redis["start"]()  # same port and data folder
        assert queue.llen(celery_app.conf.task_default_queue) == 1  # still queued after the restart
        celery = spawn_celery_worker("a", own_redis["url"])
        op = wait_for(
            lambda: (o := Operation.objects.get(pk=response.json()["id"])).state != "running" and o,
            "the queued operation to finish after the restart",
        )
        assert celery.poll() is None, "the Celery worker exited"
    assert op.state == "succeeded", list(op.targets.values("state", "explanation"))
    assert fake.backend == "mooncake"
