"""Config revisions with If-Match/ETag, hashed API tokens, encrypted worker admin keys, agent registration,
list filtering/ordering/pagination, and audit revert."""

import json
from datetime import timedelta

import pytest
from cp_factories import (
    AGENT_HOST,
    ConfigProfileFactory,
    EngineWorkerFactory,
    HostFactory,
    StorageProfileFactory,
)
from django.db import connection
from django.utils import timezone

from controlplane.accounts.models import ApiToken
from controlplane.accounts.services import token_create
from controlplane.audit.models import AuditEvent
from controlplane.configs.models import ConfigRevision
from controlplane.inventory.models import EngineWorker, Gpu, Host

pytestmark = pytest.mark.django_db


def test_revision_commit_needs_a_fresh_if_match(api_as):
    client = api_as("operator")
    profile = client.post(
        "/api/v1/configs/profiles/", {"name": "prod", "content": {"prefetch_threshold": 128}}, format="json"
    ).json()
    url = f"/api/v1/configs/profiles/{profile['id']}/"
    etag = client.get(url)["ETag"]
    assert etag == f'"cfg-{profile["id"]}-1"'
    body = {"content": {"prefetch_threshold": 64, "hicache_write_policy": "write_back"}, "message": "smaller"}
    missing = client.post(url + "revisions/", body, format="json")
    assert missing.status_code == 428
    ok = client.post(url + "revisions/", body, format="json", HTTP_IF_MATCH=etag)
    assert ok.status_code == 201 and ok.json()["number"] == 2 and ok.json()["parent_number"] == 1
    stale = client.post(
        url + "revisions/", {"content": {"prefetch_threshold": 1}}, format="json", HTTP_IF_MATCH=etag
    )
    assert stale.status_code == 412 and stale.json()["error"]["detail"]["etag"] == f'"cfg-{profile["id"]}-2"'
    same = client.post(url + "revisions/", body, format="json", HTTP_IF_MATCH=ok["ETag"])
    assert same.status_code == 409 and same.json()["error"]["code"] == "no_change"
    bad = client.post(
        url + "revisions/",
        {"content": {"hicache_write_policy": "sometimes"}},
        format="json",
        HTTP_IF_MATCH=ok["ETag"],
    )
    assert bad.status_code == 400 and "hicache_write_policy" in bad.json()["error"]["message"]
    assert [r["number"] for r in client.get(url + "revisions/").json()["results"]] == [2, 1]
    assert client.get(url + "revisions/1/").json()["content"] == {"prefetch_threshold": 128}
    commit = AuditEvent.objects.get(action="commit")
    assert commit.changes["prefetch_threshold"] == [128, 64] and commit.message == "smaller"


def test_revisions_are_immutable():
    revision = ConfigRevision.objects.create(
        profile=ConfigProfileFactory(),
        number=1,
        content={},
        content_sha256="0" * 64,
    )
    revision.content = {"prefetch_threshold": 1}
    with pytest.raises(ValueError, match="immutable"):
        revision.save()


def test_tokens_are_stored_hashed_and_enforced(api_as, personas):
    user = personas["operator"][0]
    token, plaintext = token_create(user=user, name="ro", write_enabled=False, actor=None)
    with connection.cursor() as cursor:
        cursor.execute("SELECT secret_hash FROM accounts_apitoken WHERE id = %s", [token.pk])
        (stored,) = cursor.fetchone()
    secret = plaintext.split(".", 1)[1]
    assert secret not in stored and len(stored) == 64
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/v1/inventory/hosts/").status_code == 200
    refused = client.post("/api/v1/inventory/hosts/", {"name": "x"}, format="json")
    assert refused.status_code == 403 and "read-only" in refused.json()["error"]["message"]
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext[:-1]}x")
    assert client.get("/api/v1/inventory/hosts/").status_code == 401
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/v1/inventory/hosts/").status_code == 401


def test_token_create_returns_plaintext_once_and_revoke_keeps_the_row(api_as):
    created = api_as("admin").post(
        "/api/v1/accounts/tokens/", {"user": "viewer-user", "name": "ci"}, format="json"
    )
    assert created.status_code == 201 and created.json()["token"].startswith("cp_")
    listed = api_as("admin").get("/api/v1/accounts/tokens/").json()["results"]
    assert all("token" not in row and "secret_hash" not in row for row in listed)
    assert api_as("admin").delete(f"/api/v1/accounts/tokens/{created.json()['id']}/").status_code == 204
    assert ApiToken.objects.get(pk=created.json()["id"]).revoked_at is not None


def test_worker_admin_key_is_encrypted_at_rest(api_as):
    response = api_as("operator").post(
        "/api/v1/inventory/workers/",
        {"name": "w1", "url": "http://w1.local:30000", "admin_key": "s3cr3t-key"},
        format="json",
    )
    assert response.status_code == 201 and response.json()["has_admin_key"] is True
    assert "admin_key" not in response.json()
    with connection.cursor() as cursor:
        cursor.execute("SELECT admin_key_encrypted FROM inventory_engineworker WHERE name = 'w1'")
        (stored,) = cursor.fetchone()
    assert "s3cr3t-key" not in stored and stored.startswith("gAAAA")
    assert EngineWorker.objects.get(name="w1").admin_key == "s3cr3t-key"
    event = AuditEvent.objects.get(object_type="inventory.engineworker", action="create")
    assert event.after["admin_key_encrypted"] == "***"


def test_worker_api_key_is_write_only_encrypted_and_masked(api_as, agent_for):
    op = api_as("operator")
    created = op.post(
        "/api/v1/inventory/workers/",
        {"name": "w1", "url": "http://w1.local:30000", "api_key": "api-s3cr3t"},
        format="json",
    )
    assert created.status_code == 201 and created.json()["has_api_key"] is True
    pk = created.json()["id"]
    op.patch(f"/api/v1/inventory/workers/{pk}/", {"api_key": "api-s3cr3t-2"}, format="json")
    reads = [created, op.get(f"/api/v1/inventory/workers/{pk}/"), op.get("/api/v1/inventory/workers/")]
    assert reads[1].json()["has_api_key"] is True and "api_key" not in reads[1].json()
    assert not any("api-s3cr3t" in r.content.decode() for r in reads)
    worker = EngineWorker.objects.get(pk=pk)
    assert worker.api_key == "api-s3cr3t-2" and worker.api_key_encrypted.startswith("gAAAA")
    events = AuditEvent.objects.filter(object_type="inventory.engineworker", object_id=str(pk))
    assert {e.action for e in events} == {"create", "update"}
    assert all(e.after["api_key_encrypted"] == "***" for e in events)
    assert all("api-s3cr3t" not in json.dumps([e.before, e.after, e.changes]) for e in events)
    registered = agent_for(AGENT_HOST).post(
        "/api/v1/agent/register/",
        {
            "host": {"name": AGENT_HOST},
            "workers": [{"name": "a0", "url": "http://a0.local:1", "api_key": "ag-k"}],
        },
        format="json",
    )
    assert registered.status_code == 200 and "ag-k" not in registered.content.decode()
    assert EngineWorker.objects.get(name="a0").api_key == "ag-k"


def test_agent_register_is_an_upsert(agent_for):
    body = {
        "host": {
            "name": "gpu-1",
            "address": "10.0.0.5",
            "gpus": [{"index": 0, "model": "H200", "memory_mib": 143771}],
        },
        "workers": [
            {"name": "gpu-1-w0", "url": "http://10.0.0.5:30000", "role": "prefill", "admin_key": "k"}
        ],
    }
    client = agent_for("gpu-1")
    assert client.post("/api/v1/agent/register/", body, format="json").status_code == 200
    body["workers"][0]["role"] = "decode"
    again = client.post("/api/v1/agent/register/", body, format="json")
    assert again.status_code == 200 and again.json()["workers"][0]["role"] == "decode"
    assert EngineWorker.objects.count() == 1 and Gpu.objects.count() == 1
    beat = client.post(
        "/api/v1/agent/heartbeat/", {"host": "gpu-1", "workers": ["http://10.0.0.5:30000"]}, format="json"
    )
    assert beat.json() == {"workers_seen": 1, "restart": [], "request_seq": {}, "flags": []}
    unknown = agent_for("nope").post("/api/v1/agent/heartbeat/", {"host": "nope"}, format="json")
    assert unknown.status_code == 404 and "register first" in unknown.json()["error"]["message"]


def test_heartbeat_marks_workers_the_agent_reports_offline_then_online_again(api_as, agent_for):
    url = "http://10.0.0.6:30000"
    client = agent_for("gpu-9")
    body = {"host": {"name": "gpu-9"}, "workers": [{"name": "gpu-9-w0", "url": url}]}
    assert client.post("/api/v1/agent/register/", body, format="json").status_code == 200

    def state() -> str:
        return api_as("viewer").get("/api/v1/inventory/workers/").json()["results"][0]["state"]

    assert state() == "online"
    beat = client.post("/api/v1/agent/heartbeat/", {"host": "gpu-9", "offline": [url]}, format="json")
    assert beat.status_code == 200 and beat.json() == {
        "workers_seen": 0,
        "restart": [],
        "request_seq": {},
        "flags": [],
    }
    assert state() == "offline"  # its /health failed: the agent restarts it
    client.post("/api/v1/agent/heartbeat/", {"host": "gpu-9", "workers": [url]}, format="json")
    assert state() == "online"


def test_agent_register_stores_the_attached_l3_backend_and_its_profile(api_as, agent_for):
    mooncake = {"master_server_address": "10.0.0.1:50051", "protocol": "tcp"}
    profile = StorageProfileFactory(name="mc-a", backend="mooncake", extra_config=mooncake)
    StorageProfileFactory(
        name="mc-b", backend="mooncake", extra_config={"master_server_address": "10.0.0.2:50051"}
    )
    StorageProfileFactory(name="files-1", backend="file", extra_config={})
    StorageProfileFactory(name="files-2", backend="file", extra_config={})
    workers = [
        {"name": "g-w0", "url": "http://10.0.0.7:30000", "storage_backend": "mooncake",
         "storage_extra_config": {"protocol": "tcp", "master_server_address": "10.0.0.1:50051"}},
        {"name": "g-w1", "url": "http://10.0.0.7:30001", "storage_backend": "mooncake",
         "storage_extra_config": {"master_server_address": "10.9.9.9:50051"}},
        {"name": "g-w2", "url": "http://10.0.0.7:30002", "storage_backend": "file",
         "storage_extra_config": None},
        {"name": "g-w3", "url": "http://10.0.0.7:30003", "storage_backend": ""},
    ]  # fmt: skip
    agent = agent_for("g")
    done = agent.post("/api/v1/agent/register/", {"host": {"name": "g"}, "workers": workers}, format="json")
    assert done.status_code == 200, done.content
    listed = api_as("viewer").get("/api/v1/inventory/workers/").json()["results"]
    seen = {w["name"]: (w["storage_backend"], w["storage_profile"]) for w in listed}
    assert seen == {
        "g-w0": ("mooncake", profile.pk),  # backend + extra config identify one profile
        "g-w1": ("mooncake", None),  # no profile for that master
        "g-w2": ("file", None),  # two profiles fit: not identified
        "g-w3": ("", None),
    }
    workers[0]["storage_backend"] = ""  # detached since: the next registration clears both
    agent.post("/api/v1/agent/register/", {"host": {"name": "g"}, "workers": workers[:1]}, format="json")
    assert EngineWorker.objects.filter(name="g-w0").values_list(
        "storage_backend", "storage_profile"
    ).get() == (
        "",
        None,
    )


def test_agent_register_stores_cpu_count_and_memory_bytes(api_as, agent_for):
    agent, viewer = agent_for("gpu-2"), api_as("viewer")
    body = {"host": {"name": "gpu-2", "cpu_count": 96, "memory_bytes": 2_164_372_918_272}}
    first = agent.post("/api/v1/agent/register/", body, format="json")
    assert first.status_code == 200, first.content
    assert (first.json()["host"]["cpu_count"], first.json()["host"]["memory_bytes"]) == (
        96,
        2_164_372_918_272,
    )
    event = AuditEvent.objects.get(action="register", object_type="inventory.host")
    assert event.after["host"]["cpu_count"] == 96 and event.after["host"]["memory_bytes"] == 2_164_372_918_272

    # Without the fields (an older agent) the upsert keeps what was reported before, with one more record.
    again = agent.post(
        "/api/v1/agent/register/", {"host": {"name": "gpu-2", "address": "10.0.0.9"}}, format="json"
    )
    assert again.status_code == 200 and again.json()["host"]["cpu_count"] == 96
    assert Host.objects.get(name="gpu-2").memory_bytes == 2_164_372_918_272
    assert AuditEvent.objects.filter(action="register", object_type="inventory.host").count() == 2

    # A host added by hand has neither; the fields are read-only there (the agent measures them): sending
    # them is a 400 naming each, and nothing is created.
    refused = api_as("operator").post(
        "/api/v1/inventory/hosts/", {"name": "gpu-3", "cpu_count": 8, "memory_bytes": 1}, format="json"
    )
    assert refused.status_code == 400 and refused.json()["error"]["detail"] == {
        "cpu_count": ["read-only field; it cannot be written"],
        "memory_bytes": ["read-only field; it cannot be written"],
    }
    assert not Host.objects.filter(name="gpu-3").exists()
    by_hand = api_as("operator").post("/api/v1/inventory/hosts/", {"name": "gpu-3"}, format="json")
    assert by_hand.status_code == 201
    assert (by_hand.json()["cpu_count"], by_hand.json()["memory_bytes"]) == (None, None)
    agent_for("gpu-4").post(
        "/api/v1/agent/register/", {"host": {"name": "gpu-4", "cpu_count": 8}}, format="json"
    )
    listed = viewer.get("/api/v1/inventory/hosts/?ordering=-cpu_count&cpu_count__gte=8").json()["results"]
    assert [(h["name"], h["cpu_count"], h["memory_bytes"]) for h in listed] == [
        ("gpu-2", 96, 2_164_372_918_272),
        ("gpu-4", 8, None),
    ]
    big = viewer.get("/api/v1/inventory/hosts/?memory_bytes__gte=1000000000000").json()["results"]
    assert [h["name"] for h in big] == ["gpu-2"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_count", -4),
        ("cpu_count", 0),
        ("cpu_count", 2.5),
        ("cpu_count", "8"),
        ("memory_bytes", -1),
        ("memory_bytes", 1.5e12),
        ("memory_bytes", True),
        ("memory_bytes", 2**63),
    ],
)
def test_agent_register_refuses_a_bad_cpu_count_or_memory_bytes(agent_for, field, value):
    client = agent_for("gpu-5")
    good = {"name": "gpu-5", "cpu_count": 16, "memory_bytes": 68_719_476_736}
    assert client.post("/api/v1/agent/register/", {"host": good}, format="json").status_code == 200
    stored = Host.objects.get(name="gpu-5")
    events = AuditEvent.objects.count()
    bad = {"host": {**good, field: value}, "workers": [{"name": "w5", "url": "http://10.0.0.5:30000"}]}
    response = client.post("/api/v1/agent/register/", bad, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "validation_error" and list(error["detail"]["host"]) == [field]
    after = Host.objects.get(name="gpu-5")
    assert (after.cpu_count, after.memory_bytes, after.last_seen) == (16, 68_719_476_736, stored.last_seen)
    assert AuditEvent.objects.count() == events and not EngineWorker.objects.exists()


def test_worker_list_filters_orders_and_paginates(api_as):
    for i, role in enumerate(["prefill", "decode", "decode", "mixed"]):
        EngineWorkerFactory(name=f"n{i}", role=role)
    client = api_as("viewer")
    decode = client.get("/api/v1/inventory/workers/?role=decode&ordering=-name").json()
    assert [w["name"] for w in decode["results"]] == ["n2", "n1"] and decode["count"] == 2
    page = client.get("/api/v1/inventory/workers/?limit=2&offset=2&ordering=name").json()
    assert [w["name"] for w in page["results"]] == ["n2", "n3"] and page["count"] == 4


def test_audit_log_filters_and_revert_creates_an_operation(api_as):
    from controlplane.audit.services import audit_record

    worker = EngineWorkerFactory(name="wx", storage_backend="file")  # attached since the detach it records
    event = audit_record(
        action="detach", obj=worker, extra={"restore": {"kind": "detach", "worker_ids": [worker.pk]}}
    )
    audit_record(action="create", obj=HostFactory())
    client = api_as("operator")
    rows = client.get("/api/v1/audit/events/?action=detach").json()["results"]
    assert [r["id"] for r in rows] == [event.pk] and rows[0]["revertible"] is True
    assert rows[0]["revert_changes"] == [
        {"worker_id": worker.pk, "worker": "wx", "now": "file", "after": "none"}
    ]
    reverted = client.post(f"/api/v1/audit/events/{event.pk}/revert/", {"reason": "roll back"}, format="json")
    assert reverted.status_code == 201 and reverted.json()["kind"] == "detach"
    plain = AuditEvent.objects.get(action="create", object_type="inventory.host")
    refused = client.post(f"/api/v1/audit/events/{plain.pk}/revert/", {}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "not_revertible"
    with pytest.raises(ValueError, match="append-only"):
        plain.delete()


def test_revert_to_a_state_every_worker_already_runs_is_not_offered_and_refused(api_as):
    """A detach record whose worker is still detached: the revert would change nothing."""
    from controlplane.audit.services import audit_record

    worker = EngineWorkerFactory(name="wy", storage_backend="")
    event = audit_record(
        action="detach", obj=worker, extra={"restore": {"kind": "detach", "worker_ids": [worker.pk]}}
    )
    client = api_as("operator")
    row = client.get(f"/api/v1/audit/events/{event.pk}/").json()
    assert row["revertible"] is False and row["revert_changes"] == []
    refused = client.post(f"/api/v1/audit/events/{event.pk}/revert/", {}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "nothing_to_revert"
    from controlplane.operations.models import Operation

    assert not Operation.objects.exists()
