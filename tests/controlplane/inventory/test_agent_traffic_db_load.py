"""Agent traffic at rest costs the database almost nothing: a repeated heartbeat writes no row (agents send
no metrics: the TSDB scrapes the workers), the HiCache config each worker reports included."""

import pytest
from cp_factories import AGENT_HOST
from django.db import connection
from django.test.utils import CaptureQueriesContext

pytestmark = pytest.mark.django_db
URLS = [f"http://10.0.0.9:{30000 + i}" for i in range(8)]
HICACHE = {"config": {"prefetch_threshold": 32, "hicache_write_policy": "write_through"}, "unreported": {}}


def _registered(agent):
    workers = [
        {"name": f"w{i}", "url": url, "role": "mixed", "hicache": HICACHE} for i, url in enumerate(URLS)
    ]
    body = {"host": {"name": AGENT_HOST}, "workers": workers}
    assert agent.post("/api/v1/agent/register/", body, format="json").status_code == 200


def test_a_heartbeat_that_changes_nothing_writes_nothing(api_as):
    agent = api_as("agent")
    _registered(agent)
    beat = {"host": AGENT_HOST, "workers": URLS, "roles": dict.fromkeys(URLS, "mixed")}
    beat["hicache"] = dict.fromkeys(URLS, HICACHE)
    assert agent.post("/api/v1/agent/heartbeat/", beat, format="json").status_code == 200
    with CaptureQueriesContext(connection) as queries:
        answer = agent.post("/api/v1/agent/heartbeat/", beat, format="json")
    assert answer.status_code == 200 and answer.json()["workers_seen"] == 8
    writes = [q["sql"] for q in queries if q["sql"].split()[0] in ("UPDATE", "INSERT", "DELETE")]
    assert writes == []
    # a change is still written at once: a worker reported offline
    offline = {**beat, "workers": URLS[1:], "offline": URLS[:1]}
    assert agent.post("/api/v1/agent/heartbeat/", offline, format="json").json()["workers_seen"] == 7
    listed = api_as("viewer").get("/api/v1/inventory/workers/", {"state": "offline"}).json()["results"]
    assert [w["url"] for w in listed] == URLS[:1]


def _client_for(plaintext: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client
