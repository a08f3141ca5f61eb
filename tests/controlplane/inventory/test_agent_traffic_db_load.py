"""Agent traffic at rest costs the database almost nothing: a repeated heartbeat writes no row, a metrics
sample reads no row (the worker's identity and the agent token are cached per process)."""

import pytest
from cp_factories import AGENT_HOST
from django.db import connection
from django.test.utils import CaptureQueriesContext

pytestmark = pytest.mark.django_db
URLS = [f"http://10.0.0.9:{30000 + i}" for i in range(8)]


def _registered(agent):
    workers = [{"name": f"w{i}", "url": url, "role": "mixed"} for i, url in enumerate(URLS)]
    body = {"host": {"name": AGENT_HOST}, "workers": workers}
    assert agent.post("/api/v1/agent/register/", body, format="json").status_code == 200


def test_a_heartbeat_that_changes_nothing_writes_nothing(api_as):
    agent = api_as("agent")
    _registered(agent)
    beat = {"host": AGENT_HOST, "workers": URLS, "roles": dict.fromkeys(URLS, "mixed")}
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


def test_a_metrics_sample_reads_no_inventory_row(api_as):
    """Apart from the fleet summary, which the first sample of each second recomputes for the console."""
    from controlplane.telemetry import store
    from controlplane.telemetry.services import FLEET_GROUP

    agent = api_as("agent")
    _registered(agent)
    sample = {"worker_url": URLS[0], "metrics": {"num_running_reqs": 1}}
    assert agent.post("/api/v1/agent/metrics/", sample, format="json").status_code == 202
    store.open_window(FLEET_GROUP)  # this second's fleet summary is taken
    with CaptureQueriesContext(connection) as queries:
        assert agent.post("/api/v1/agent/metrics/", sample, format="json").status_code == 202
    tables = {t for q in queries for t in ("inventory_engineworker", "inventory_host") if t in q["sql"]}
    assert tables == set()


def test_an_agent_sample_reads_no_row_at_all_and_a_revoke_still_refuses_at_once(personas):
    """The agent token is served from the process's token cache (one Redis read), so a steady sample runs
    no SQL at all; revoking the token advances the auth epoch, and the very next sample is refused."""
    from controlplane.accounts.models import ApiToken
    from controlplane.accounts.services import token_revoke
    from controlplane.telemetry import store
    from controlplane.telemetry.services import FLEET_GROUP

    agent = _client_for(personas["agent"][1])
    _registered(agent)
    sample = {"worker_url": URLS[0], "metrics": {"num_running_reqs": 1}}
    assert agent.post("/api/v1/agent/metrics/", sample, format="json").status_code == 202
    store.open_window(FLEET_GROUP)
    with CaptureQueriesContext(connection) as queries:
        assert agent.post("/api/v1/agent/metrics/", sample, format="json").status_code == 202
    assert [q["sql"] for q in queries] == []
    token_revoke(token=ApiToken.objects.get(user=personas["agent"][0]), actor=None)
    refused = agent.post("/api/v1/agent/metrics/", sample, format="json")
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]


def _client_for(plaintext: str):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client
