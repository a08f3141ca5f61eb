"""The cache isolation self-test through the control plane (``POST /api/v1/inventory/workers/{id}/
check-isolation/``) against a real engine worker process: it runs the agent's check with the worker's
inventory API key, answers both TTFTs, each probe's cached tokens and the verdict, and audits every run
(a worker it cannot check: a 502 naming the worker, audited as a failure)."""

import pytest
from cp_factories import EngineWorkerFactory

from controlplane.audit.models import AuditEvent
from engine.bench.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.django_db]
KEY = "sk-operator-iso-5d1e"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16", "--api-key", KEY]
    with ServerProcess(flags) as worker:
        yield worker.url


def _worker(url: str, key: str):
    worker = EngineWorkerFactory(name="gpu-iso", url=url)
    worker.api_key = key
    worker.save(update_fields=["api_key_encrypted"])
    return worker


def test_an_operator_checks_a_worker_and_gets_both_ttfts_and_the_verdict(api_as, personas, engine_url):
    worker = _worker(engine_url, KEY)
    resp = api_as("operator").post(f"/api/v1/inventory/workers/{worker.pk}/check-isolation/", {"words": 48})
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["ok"] is True and body["verdict"] == "isolated" and body["problems"] == []
    assert body["ttft_other_salt_s"] > 0 and body["ttft_same_salt_s"] > 0
    cold, other, again = body["probes"]
    assert [p["salt"] for p in body["probes"]] == ["A", "B", "A"]
    assert other["cached"] == {"device": 0, "host": 0, "storage": 0} and again["cached"]["device"] > 0
    event = AuditEvent.objects.get(action="check_isolation")
    assert (event.outcome, event.actor, event.object_id) == (
        "success",
        personas["operator"][0],
        str(worker.pk),
    )
    assert event.after["verdict"] == "isolated" and event.after["ttft_other_salt_s"] == other["ttft_s"]
    assert KEY not in str(event.after) + event.message + str(event.extra)


def test_a_worker_that_refuses_the_inventory_key_is_a_502_and_an_audited_failure(api_as, engine_url):
    worker = _worker(engine_url, "sk-stale-key")
    resp = api_as("operator").post(f"/api/v1/inventory/workers/{worker.pk}/check-isolation/", {})
    assert resp.status_code == 502 and "answered 401" in resp.json()["error"]["message"]
    assert "gpu-iso" in resp.json()["error"]["message"]
    event = AuditEvent.objects.get(action="check_isolation")
    assert event.outcome == "failure" and "could not run" in event.message


def test_viewers_cannot_run_it_and_words_out_of_range_name_the_field(api_as):
    worker = _worker("http://127.0.0.1:9", KEY)
    url = f"/api/v1/inventory/workers/{worker.pk}/check-isolation/"
    assert api_as("viewer").post(url, {}).status_code == 403
    resp = api_as("operator").post(url, {"words": 5})
    assert resp.status_code == 400 and "words" in resp.content.decode()
    assert not AuditEvent.objects.filter(action="check_isolation").exists()
