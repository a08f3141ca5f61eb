"""Permission matrix: every role x every write endpoint; each allowed write leaves exactly one audit record,
each refused one leaves none and changes nothing."""

import pytest
from cp_factories import (
    AGENT_HOST,
    ConfigProfileFactory,
    ConfigRevisionFactory,
    EngineWorkerFactory,
    GpuFactory,
    HostFactory,
    RouterFactory,
    StorageProfileFactory,
    UserFactory,
)

from controlplane.audit.models import AuditEvent
from controlplane.operations.models import Operation

pytestmark = pytest.mark.django_db

OPS = {"operator", "admin"}
ADMIN = {"admin"}
AGENT = {"agent", "operator", "admin"}


def _token(personas):
    from controlplane.accounts.services import token_create

    return token_create(user=personas["viewer"][0], name="victim", actor=None)[0]


def _operation():
    from controlplane.operations.services import operation_create

    return operation_create(kind="detach", workers=[EngineWorkerFactory()], actor=None)


def _revertible_event():
    from controlplane.audit.services import audit_record

    worker = EngineWorkerFactory(storage_backend="file")  # attached since: the revert detaches it
    return audit_record(
        action="detach", obj=worker, extra={"restore": {"kind": "detach", "worker_ids": [worker.pk]}}
    )


# name -> (allowed roles, audited, builder(personas) -> (method, url, body, headers))
ENDPOINTS = {
    "host.create": (OPS, True, lambda p: ("post", "/api/v1/inventory/hosts/", {"name": "h-new"}, {})),
    "host.update": (
        OPS,
        True,
        lambda p: ("patch", f"/api/v1/inventory/hosts/{HostFactory().pk}/", {"address": "x"}, {}),
    ),
    "host.delete": (
        OPS,
        True,
        lambda p: ("delete", f"/api/v1/inventory/hosts/{HostFactory().pk}/", None, {}),
    ),
    "gpu.create": (
        OPS,
        True,
        lambda p: (
            "post",
            "/api/v1/inventory/gpus/",
            {"host": HostFactory().pk, "index": 0, "model": "H200", "memory_mib": 1},
            {},
        ),
    ),
    "gpu.delete": (OPS, True, lambda p: ("delete", f"/api/v1/inventory/gpus/{GpuFactory().pk}/", None, {})),
    "router.create": (
        OPS,
        True,
        lambda p: ("post", "/api/v1/inventory/routers/", {"name": "r", "url": "http://r.local:1"}, {}),
    ),
    "router.update": (
        OPS,
        True,
        lambda p: (
            "patch",
            f"/api/v1/inventory/routers/{RouterFactory().pk}/",
            {"policy": "round_robin"},
            {},
        ),
    ),
    "storage.create": (
        OPS,
        True,
        lambda p: (
            "post",
            "/api/v1/inventory/storage-profiles/",
            {"name": "s", "backend": "file", "extra_config": {"file_path": "/x"}},
            {},
        ),
    ),
    "storage.delete": (
        OPS,
        True,
        lambda p: ("delete", f"/api/v1/inventory/storage-profiles/{StorageProfileFactory().pk}/", None, {}),
    ),
    "worker.create": (
        OPS,
        True,
        lambda p: (
            "post",
            "/api/v1/inventory/workers/",
            {"name": "w", "url": "http://w.local:1", "admin_key": "k"},
            {},
        ),
    ),
    "worker.update": (
        OPS,
        True,
        lambda p: ("patch", f"/api/v1/inventory/workers/{EngineWorkerFactory().pk}/", {"role": "decode"}, {}),
    ),
    "worker.delete": (
        OPS,
        True,
        lambda p: ("delete", f"/api/v1/inventory/workers/{EngineWorkerFactory().pk}/", None, {}),
    ),
    "worker.drain": (
        OPS,
        True,
        lambda p: ("post", f"/api/v1/inventory/workers/{_routed_worker(p).pk}/drain/", {}, {}),
    ),
    "worker.undrain": (
        OPS,
        True,
        lambda p: ("post", f"/api/v1/inventory/workers/{_routed_worker(p).pk}/undrain/", {}, {}),
    ),
    "config.create": (
        OPS,
        True,
        lambda p: (
            "post",
            "/api/v1/configs/profiles/",
            {"name": "c", "content": {"prefetch_threshold": 64}},
            {},
        ),
    ),
    "config.update": (
        OPS,
        True,
        lambda p: (
            "patch",
            f"/api/v1/configs/profiles/{ConfigProfileFactory().pk}/",
            {"description": "d"},
            {},
        ),
    ),
    "config.commit": (OPS, True, lambda p: _commit()),
    "operation.create": (
        OPS,
        True,
        lambda p: (
            "post",
            "/api/v1/operations/",
            {"kind": "detach", "workers": [EngineWorkerFactory().pk], "reason": "test"},
            {},
        ),
    ),
    "operation.cancel": (
        OPS,
        True,
        lambda p: ("post", f"/api/v1/operations/{_operation().pk}/cancel/", {}, {}),
    ),
    "audit.revert": (
        OPS,
        True,
        lambda p: ("post", f"/api/v1/audit/events/{_revertible_event().pk}/revert/", {}, {}),
    ),
    "user.create": (
        ADMIN,
        True,
        lambda p: (
            "post",
            "/api/v1/accounts/users/",
            {"username": "new", "password": "long-password-1", "role": "viewer"},
            {},
        ),
    ),
    "user.update": (
        ADMIN,
        True,
        lambda p: ("patch", f"/api/v1/accounts/users/{UserFactory().pk}/", {"role": "operator"}, {}),
    ),
    "token.create": (
        ADMIN,
        True,
        lambda p: ("post", "/api/v1/accounts/tokens/", {"user": "viewer-user", "name": "t"}, {}),
    ),
    "token.revoke": (ADMIN, True, lambda p: ("delete", f"/api/v1/accounts/tokens/{_token(p).pk}/", None, {})),
    "agent.register": (
        AGENT,
        True,
        lambda p: (
            "post",
            "/api/v1/agent/register/",
            {
                "host": {
                    "name": AGENT_HOST,
                    "cpu_count": 2,
                    "memory_bytes": 2**30,
                    "gpus": [{"index": 0, "model": "H200", "memory_mib": 1}],
                },
                "workers": [{"name": "a0", "url": "http://a0.local:1"}],
            },
            {},
        ),
    ),
    # Heartbeats and metric samples are observations, not changes: they are the two unaudited writes.
    "agent.heartbeat": (
        AGENT,
        False,
        lambda p: (
            "post",
            "/api/v1/agent/heartbeat/",
            {"host": HostFactory(name=AGENT_HOST).name, "workers": []},
            {},
        ),
    ),
}


def _routed_worker(personas):
    router = personas["fake_router"]
    router.add("http://routed.local:1")
    return EngineWorkerFactory(url="http://routed.local:1", router=RouterFactory(url=router.url))


def _commit():
    revision = ConfigRevisionFactory()
    profile = revision.profile
    profile.head_number = 1
    profile.save()
    return (
        "post",
        f"/api/v1/configs/profiles/{profile.pk}/revisions/",
        {"content": {"prefetch_threshold": 7}},
        {"HTTP_IF_MATCH": profile.etag},
    )


@pytest.mark.parametrize("role", ["viewer", "operator", "admin", "agent"])
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_role_matrix(role, endpoint, api_as, personas, fake_router):
    allowed, audited, build = ENDPOINTS[endpoint]
    method, url, body, headers = build({**personas, "fake_router": fake_router})
    audit_before = AuditEvent.objects.count()
    ops_before = Operation.objects.count()
    response = getattr(api_as(role), method)(url, body, format="json", **headers)
    if role in allowed:
        assert 200 <= response.status_code < 300, response.content
        assert AuditEvent.objects.count() - audit_before == (1 if audited else 0)
    else:
        assert response.status_code == 403, response.content
        assert response.json()["error"]["code"] == "permission_denied"
        assert AuditEvent.objects.count() == audit_before
        assert Operation.objects.count() == ops_before


def test_every_role_can_read(api_as):
    for role in ("viewer", "operator", "admin"):
        for url in (
            "/api/v1/inventory/workers/",
            "/api/v1/audit/events/",
            "/api/v1/operations/",
            "/api/v1/configs/profiles/",
            "/api/v1/telemetry/fleet/",
        ):
            assert api_as(role).get(url).status_code == 200, (role, url)
    assert api_as("viewer").get("/api/v1/accounts/tokens/").status_code == 403
    assert api_as("agent").get("/api/v1/inventory/workers/").status_code == 403


def test_audit_record_carries_actor_token_and_request_id(api_as):
    response = api_as("operator").post(
        "/api/v1/inventory/hosts/", {"name": "h1"}, format="json", HTTP_X_REQUEST_ID="req-12345678"
    )
    assert response.status_code == 201
    event = AuditEvent.objects.get(action="create", object_type="inventory.host")
    assert (event.actor_display, event.actor_type, event.request_id) == (
        "operator-user",
        "token",
        "req-12345678",
    )
    assert event.after["name"] == "h1" and event.changes["name"] == [None, "h1"]
