"""Each worker's live HiCache config reaches the inventory from what its agent reads in its /server_info: at
register and with every heartbeat that finds it changed, with no operation involved; a bad report is a 400
naming the setting and changes nothing; a worker that cannot be read stays unknown, saying why."""

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory

from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services import worker_hicache

pytestmark = pytest.mark.django_db
URL = "http://10.0.0.7:30000"
LIVE = {
    "prefetch_threshold": 32,
    "hicache_storage_prefetch_policy": "timeout",
    "radix_eviction_policy": "lfu",
}


def _worker(viewer) -> dict:
    (row,) = [w for w in viewer.get("/api/v1/inventory/workers/").json()["results"] if w["url"] == URL]
    return row


def test_register_and_heartbeats_keep_the_reported_config(api_as):
    agent, viewer = api_as("agent"), api_as("viewer")
    worker = {"name": "w0", "url": URL, "role": "mixed", "hicache": {"config": LIVE}}
    assert agent.post("/api/v1/agent/register/", {"host": {"name": AGENT_HOST}, "workers": [worker]},
                      format="json").status_code == 200  # fmt: skip
    row = _worker(viewer)
    assert row["hicache_config"] == LIVE and row["hicache_unreported"] == {}
    registered_at = row["hicache_config_read_at"]
    assert registered_at is not None

    beat = {"host": AGENT_HOST, "workers": [URL], "hicache": {URL: {"config": LIVE}}}
    assert agent.post("/api/v1/agent/heartbeat/", beat, format="json").status_code == 200
    assert _worker(viewer)["hicache_config_read_at"] == registered_at  # unchanged: not written again
    # changed on the worker behind the control plane's back (its own PUT /hicache/config): the next beat
    why = "not reported: SGLang 0.5.23 reports only the extra config it was given"
    changed = {"config": {**LIVE, "prefetch_threshold": 64}, "unreported": {"prefetch_timeout_max": why}}
    assert agent.post("/api/v1/agent/heartbeat/", {**beat, "hicache": {URL: changed}},
                      format="json").status_code == 200  # fmt: skip
    row = _worker(viewer)
    assert row["hicache_config"]["prefetch_threshold"] == 64
    assert row["hicache_unreported"] == {"prefetch_timeout_max": why}
    assert row["hicache_config_read_at"] > registered_at

    # a setting the contract does not have: 400 naming it and the closest real one; nothing written
    typo = {URL: {"config": {"prefetch_treshold": 8}}}
    refused = agent.post("/api/v1/agent/heartbeat/", {**beat, "hicache": typo}, format="json")
    assert refused.status_code == 400
    assert refused.json()["error"]["detail"]["hicache"][URL]["config"] == {
        "prefetch_treshold": ["unknown HiCache setting; did you mean 'prefetch_threshold'?"]
    }
    assert _worker(viewer)["hicache_config"]["prefetch_threshold"] == 64


def test_a_worker_nobody_read_is_read_on_demand_or_stays_unknown_with_why(fake_worker):
    fake = fake_worker()
    fake.config["prefetch_threshold"] = 48
    added = EngineWorkerFactory(name="by-hand", url=fake.url)  # no agent, no operation
    known = worker_hicache(worker=added)
    assert known["config"]["prefetch_threshold"] == 48 and known["why"] == "" and known["read_at"]
    assert EngineWorker.objects.get(pk=added.pk).hicache_config["prefetch_threshold"] == 48
    fake.stop()
    gone = EngineWorkerFactory(name="gone", url=fake.url + "/gone")
    unknown = worker_hicache(worker=gone)
    assert unknown["config"] is None and unknown["read_at"] is None
    assert unknown["why"].startswith("gone did not answer /server_info (")
    assert worker_hicache(worker=added)["config"]["prefetch_threshold"] == 48  # kept: it was read once
