"""Agent tokens are bound to one host: register and heartbeat touch only that host's workers; a worker URL
another host owns is a 409 naming the owner; agents send no metrics (the TSDB scrapes the workers);
out-of-range integers are 400s in the JSON envelope."""

import importlib

import pytest
from cp_factories import AGENT_HOST
from django.apps import apps

from controlplane.accounts.models import ApiToken
from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker, Gpu

pytestmark = pytest.mark.django_db


def _register(client, host: str, workers: list[dict]):
    return client.post("/api/v1/agent/register/", {"host": {"name": host}, "workers": workers}, format="json")


def test_agent_tokens_name_their_host_at_issue(api_as):
    admin = api_as("admin")
    missing = admin.post("/api/v1/accounts/tokens/", {"user": "agent-user", "name": "a"}, format="json")
    assert missing.status_code == 400 and missing.json()["error"]["detail"] == {
        "host": ["required for agent tokens"]
    }
    made = admin.post(
        "/api/v1/accounts/tokens/", {"user": "agent-user", "name": "a", "host": "gpu-7"}, format="json"
    )
    assert made.status_code == 201 and made.json()["host"] == "gpu-7"
    viewer = admin.post(
        "/api/v1/accounts/tokens/", {"user": "viewer-user", "name": "v", "host": "gpu-7"}, format="json"
    )
    assert viewer.status_code == 400 and "host" in viewer.json()["error"]["detail"]


def test_an_agent_token_cannot_take_another_hosts_worker(api_as, agent_for):
    owner = agent_for("gpu-a")
    url = "http://10.0.0.1:30000"
    assert _register(owner, "gpu-a", [{"name": "a0", "url": url, "admin_key": "key-a"}]).status_code == 200
    events = AuditEvent.objects.count()

    thief = api_as("agent")  # bound to AGENT_HOST
    moved = _register(thief, AGENT_HOST, [{"name": "stolen", "url": url, "admin_key": "key-x"}])
    assert moved.status_code == 409
    error = moved.json()["error"]
    assert error["code"] == "worker_owned" and "'gpu-a'" in error["message"]
    assert error["detail"] == {"workers": [{"url": url, "owner": "gpu-a"}]}
    other = _register(thief, "gpu-a", [])
    assert other.status_code == 403 and other.json()["error"]["code"] == "wrong_host"

    worker = EngineWorker.objects.get(url=url)
    assert (worker.name, worker.host.name, worker.admin_key) == ("a0", "gpu-a", "key-a")
    assert AuditEvent.objects.count() == events

    # Heartbeat: another host's worker is never marked offline; naming that host is refused.
    _register(thief, AGENT_HOST, [])
    beat = thief.post("/api/v1/agent/heartbeat/", {"host": AGENT_HOST, "offline": [url]}, format="json")
    assert beat.status_code == 200 and EngineWorker.objects.get(url=url).state == "online"
    beat = thief.post("/api/v1/agent/heartbeat/", {"host": "gpu-a", "offline": [url]}, format="json")
    assert beat.status_code == 403 and EngineWorker.objects.get(url=url).state == "online"

    # Metrics: no agent sends any (the TSDB scrapes the workers); the old ingest path is gone.
    gone = owner.post("/api/v1/agent/metrics/", {"worker_url": url, "text": "x 1\n"}, format="json")
    assert gone.status_code == 404


def test_an_operator_may_register_but_not_move_an_owned_worker(api_as, agent_for):
    url = "http://10.0.0.2:30000"
    _register(agent_for("gpu-b"), "gpu-b", [{"name": "b0", "url": url}])
    moved = _register(api_as("operator"), "gpu-c", [{"name": "b0", "url": url}])
    assert moved.status_code == 409 and EngineWorker.objects.get(url=url).host.name == "gpu-b"


def test_an_unbound_agent_token_is_refused_and_the_migration_binds_registered_ones(personas):
    from rest_framework.test import APIClient

    from controlplane.accounts import token_cache
    from controlplane.accounts.services import token_create

    agent_user = personas["agent"][0]
    used, plaintext = token_create(user=agent_user, name="old", actor=None, host="gpu-old")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert _register(client, "gpu-old", []).status_code == 200
    never = token_create(user=agent_user, name="never used", actor=None, host="x")[0]
    # Tokens as they were before binding existed: no host. A queryset update sends no model signal, so it
    # advances the auth epoch itself, as every change through the models does (controlplane.accounts.signals).
    ApiToken.objects.filter(pk__in=[used.pk, never.pk]).update(host_name="")
    token_cache.bump_epoch()
    refused = _register(client, "gpu-old", [])
    assert refused.status_code == 403 and "bound to no host" in refused.json()["error"]["message"]

    migration = importlib.import_module("controlplane.accounts.migrations.0003_apitoken_host_name")
    migration.bind_existing_agent_tokens(apps, None)
    token_cache.bump_epoch()  # the migration's updates, like the one above, send no signal
    assert ApiToken.objects.get(pk=used.pk).host_name == "gpu-old"  # the host it registered
    assert ApiToken.objects.get(pk=never.pk).host_name == ""  # never registered: stays refused
    assert _register(client, "gpu-old", []).status_code == 200


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/inventory/workers/?host_id=10000000000000000000",
        "/api/v1/inventory/workers/?router_id=-10000000000000000000",
        "/api/v1/inventory/gpus/?host=10000000000000000000",
        "/api/v1/operations/?created_by=10000000000000000000",
        "/api/v1/operations/preview/?worker=10000000000000000000",
        "/api/v1/inventory/workers/10000000000000000000/",
    ],
)
def test_integer_overflow_in_query_parameters_is_a_json_400(api_as, url):
    response = api_as("viewer").get(url)
    assert response.status_code in (400, 404) and response["Content-Type"] == "application/json"
    assert "error" in response.json()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("gpus", "memory_mib"), 2**63),
        (("gpus", "index"), 2**40),
        (("workers", "page_size"), 2**63),
        (("workers", "tp_size"), 2**20),
    ],
)
def test_integer_overflow_in_agent_fields_is_a_400_naming_the_field(api_as, path, value):
    where, field = path
    gpu = {"index": 0, "model": "H200", "memory_mib": 1}
    worker = {"name": "o0", "url": "http://10.0.0.9:30000"}
    body = {"host": {"name": AGENT_HOST, "gpus": [gpu]}, "workers": [worker]}
    (gpu if where == "gpus" else worker)[field] = value
    response = api_as("agent").post("/api/v1/agent/register/", body, format="json")
    assert response.status_code == 400, response.content
    detail = response.json()["error"]["detail"]
    inner = detail["host"]["gpus"]["0"] if where == "gpus" else detail["workers"]["0"]
    assert list(inner) == [field]
    assert not Gpu.objects.exists() and not EngineWorker.objects.exists()


def test_a_repeated_gpu_index_is_a_400_naming_the_field(api_as):
    gpu = {"model": "H100", "memory_mib": 81559}
    host = {"name": AGENT_HOST, "gpus": [{"index": 0, **gpu}, {"index": 1, **gpu}, {"index": 1, **gpu}]}
    response = api_as("agent").post("/api/v1/agent/register/", {"host": host}, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert error["detail"] == {"host": {"gpus": ["GPU index repeated: 1"]}}
    assert not Gpu.objects.exists()
