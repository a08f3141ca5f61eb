"""A stopped local fleet leaves none of its keys in a Redis it shares (real Redis, the suite's test DB)."""

from __future__ import annotations

import os

import pytest
import redis
from localfleet import LocalFleet, redis_answers

from deploy.demo_keys import delete_fleet_keys

URL = os.environ.get("CONTROLPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
MINE, NEIGHBOUR = "kvfleet-demokeys-4242", "kvfleet-demokeys-42421"


@pytest.fixture
def client():
    if not redis_answers(URL):
        pytest.skip(f"no Redis at {URL}")
    with redis.Redis.from_url(URL) as c:
        yield c
        for name in (MINE, NEIGHBOUR):
            delete_fleet_keys(URL, name, name)


def _fill(client, name: str) -> set[bytes]:
    keys = {f"{name}:tm:w:1:latest", f"{name}:tm:w:1:hist", f"{name}:plan:3:state", name,
            f"{name}\x06\x163", f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}"}  # fmt: skip
    for key in keys:
        client.set(key, "x")
    return {k.encode() for k in keys}


def _left(client, name: str) -> set[bytes]:
    return {k for k in client.scan_iter(match=f"*{name}*", count=500) if name.encode() in k}


def test_delete_fleet_keys_removes_its_prefix_and_queue_and_nothing_else(client):
    _fill(client, MINE)
    neighbour = _fill(client, NEIGHBOUR)  # same digits plus one: a glob without the ':' would match it
    assert delete_fleet_keys(URL, MINE, MINE) == 7
    assert {k for k in _left(client, MINE) if NEIGHBOUR.encode() not in k} == set()
    assert _left(client, NEIGHBOUR) == neighbour


def test_stop_deletes_the_fleets_keys_from_a_redis_it_did_not_start(client, tmp_path):
    fleet = LocalFleet(log_dir=tmp_path)
    fleet.env = {"REDIS_URL": URL, "REDIS_KEY_PREFIX": MINE, "CELERY_QUEUE": MINE}
    fleet._redis()
    assert fleet.procs == []  # it answers: not started here
    _fill(client, MINE)
    fleet.stop()
    assert {k for k in _left(client, MINE) if NEIGHBOUR.encode() not in k} == set()
