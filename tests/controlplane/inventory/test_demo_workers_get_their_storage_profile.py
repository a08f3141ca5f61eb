"""deploy/localfleet.py creates its Mooncake storage profile before the agent registers the workers: the
registration (agent_register, audited) links each worker of both demo specs to that profile, so the API shows
``storage_profile`` set instead of null."""

import sys

import pytest
from cp_factories import AGENT_HOST

from controlplane.audit.models import AuditEvent
from engine.agent.agent import storage_fields
from engine.agent.spec import load_spec

pytestmark = pytest.mark.django_db
REPO = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "deploy"))
ENV = {
    "MOONCAKE_MASTER": "127.0.0.1:50051",
    "MOONCAKE_TE_META_DATA_SERVER": "http://127.0.0.1:8080/metadata",
    "KVFLEET_WORKER_ADMIN_KEY": "k" * 32,
    "DEMO_HOST_NAME": AGENT_HOST,
}
FLAG = "--hicache-storage-backend-extra-config="


@pytest.mark.parametrize("spec_file", ["fleet.demo.toml", "fleet.pd.toml"])
def test_demo_workers_register_linked_to_the_demo_profile(spec_file, api_as, agent_for):
    from localfleet import mooncake_profile

    created = api_as("admin").post(
        "/api/v1/inventory/storage-profiles/", mooncake_profile(ENV, "demo"), format="json"
    )
    assert created.status_code == 201, created.content
    spec = load_spec(REPO / "deploy" / spec_file, ENV)
    workers = []
    for w in spec.workers:
        extra = next(f[len(FLAG) :] for f in w.flags if f.startswith(FLAG))
        info = {"hicache_storage_backend": "mooncake", "hicache_storage_backend_extra_config": extra}
        workers.append({"name": w.name, "url": w.url, "role": w.role, **storage_fields(info)})
    body = {"host": {"name": AGENT_HOST}, "workers": workers}
    assert agent_for(AGENT_HOST).post("/api/v1/agent/register/", body, format="json").status_code == 200
    rows = api_as("viewer").get("/api/v1/inventory/workers/").json()["results"]
    assert len(rows) == len(spec.workers) >= 2
    assert {r["storage_profile"] for r in rows} == {created.json()["id"]}
    audit = AuditEvent.objects.get(action="register")
    assert {w["storage_profile_id"] for w in audit.after["workers"]} == {created.json()["id"]}
