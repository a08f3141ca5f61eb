"""Strict input (controlplane/core/serializers.py, core/filters.py): an unknown or mistyped body key, a
read-only field, a non-JSON boolean or an unknown list filter is a 400 ``validation_error`` naming it (and the
closest real field), and nothing is written; a PATCH that changes nothing writes no audit record."""

import pytest
from cp_factories import ConfigProfileFactory, EngineWorkerFactory, HostFactory, RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.operations.models import Operation
from controlplane.rebalance.models import Rebalance

pytestmark = pytest.mark.django_db
TARGET = {"prefill": 1, "decode": 1}


def refused(response) -> dict:
    """The ``detail`` of a 400 ``validation_error`` in the API's envelope."""
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "validation_error", error
    assert set(error) == {"code", "message", "detail", "request_id"}
    return error["detail"]


def audit_count() -> int:
    return AuditEvent.objects.count()


def test_a_mistyped_nested_slo_key_is_refused_with_the_closest_field(api_as):
    router = RouterFactory(mode="pd")
    body = {"router": router.pk, "target": TARGET, "slo": {"max_ttft": 1}}
    detail = refused(api_as("operator").post("/api/v1/rebalances/", body, format="json"))
    assert detail == {"slo": {"max_ttft": ["unknown field; did you mean 'max_ttft_s'?"]}}
    assert not Rebalance.objects.exists()


def test_an_unknown_top_level_key_is_refused_and_nothing_is_written(api_as):
    router = RouterFactory(policy="cache_aware")
    before = audit_count()
    response = api_as("operator").patch(
        f"/api/v1/inventory/routers/{router.pk}/", {"polcy": "random"}, format="json"
    )
    assert refused(response) == {"polcy": ["unknown field; did you mean 'policy'?"]}
    router.refresh_from_db()
    assert router.policy == "cache_aware" and audit_count() == before


def test_a_key_with_no_close_field_lists_the_fields(api_as):
    router = RouterFactory(mode="pd")
    body = {"router": router.pk, "target": {**TARGET, "extra": 3}}
    detail = refused(api_as("operator").post("/api/v1/rebalances/", body, format="json"))
    assert detail == {"target": {"extra": ["unknown field; known: decode, prefill"]}}


def test_a_read_only_field_in_a_write_is_refused_naming_it(api_as):
    host = HostFactory(name="h1")
    before = audit_count()
    response = api_as("operator").patch(
        f"/api/v1/inventory/hosts/{host.pk}/", {"cpu_count": "two"}, format="json"
    )
    assert refused(response) == {"cpu_count": ["read-only field; it cannot be written"]}
    assert audit_count() == before


def test_an_agent_body_with_an_unknown_nested_key_is_refused(agent_for):
    body = {"host": {"name": "gpu-9", "cpu_cuont": 8}}
    detail = refused(agent_for("gpu-9").post("/api/v1/agent/register/", body, format="json"))
    assert detail == {"host": {"cpu_cuont": ["unknown field; did you mean 'cpu_count'?"]}}


def test_an_unknown_list_filter_is_refused_with_the_closest_filter(api_as):
    EngineWorkerFactory(role="prefill")
    viewer = api_as("viewer")
    detail = refused(viewer.get("/api/v1/inventory/workers/?rol=mixed"))
    assert detail == {"rol": ["unknown query parameter; did you mean 'role'?"]}
    # the real filter, ordering, pagination and format stay accepted
    got = viewer.get("/api/v1/inventory/workers/?role=mixed&ordering=name&limit=5&offset=0&format=json")
    assert got.status_code == 200 and got.json()["count"] == 0


@pytest.mark.parametrize(
    "url",
    ["/api/v1/audit/events/?actionn=update", "/api/v1/operations/?stat=running", "/api/v1/rebalances/?x=1"],
)
def test_every_list_refuses_unknown_query_parameters(api_as, url):
    name = url.split("?")[1].split("=")[0]
    assert name in refused(api_as("viewer").get(url))


def test_a_patch_that_changes_nothing_writes_no_audit_record(api_as):
    router = RouterFactory(policy="random")
    operator = api_as("operator")
    before = audit_count()
    same = operator.patch(f"/api/v1/inventory/routers/{router.pk}/", {"policy": "random"}, format="json")
    empty = operator.patch(f"/api/v1/inventory/routers/{router.pk}/", {}, format="json")
    assert same.status_code == empty.status_code == 200 and audit_count() == before
    changed = operator.patch(
        f"/api/v1/inventory/routers/{router.pk}/", {"policy": "round_robin"}, format="json"
    )
    assert changed.status_code == 200 and audit_count() == before + 1
    assert AuditEvent.objects.latest("id").after["policy"] == "round_robin"


def test_an_unknown_config_content_key_names_the_closest_config_field(api_as):
    profile = ConfigProfileFactory()
    got = api_as("operator").post(
        f"/api/v1/configs/profiles/{profile.pk}/revisions/",
        {"content": {"prefetch_treshold": 128}},
        format="json",
        HTTP_IF_MATCH=profile.etag,
    )
    error = got.json()["error"]
    assert got.status_code == 400 and error["code"] == "bad_content", error
    assert error["detail"] == {
        "content": {"prefetch_treshold": ["unknown config field; did you mean 'prefetch_threshold'?"]}
    }


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None])
def test_an_operation_drain_must_be_a_json_boolean(api_as, value):
    worker = EngineWorkerFactory()
    body = {"kind": "detach", "workers": [worker.pk], "reason": "test", "drain": value}
    detail = refused(api_as("operator").post("/api/v1/operations/", body, format="json"))
    assert detail == {"drain": [f"must be a JSON boolean (true or false), got {value!r}"]}
    assert not Operation.objects.exists()


def test_a_rebalance_rollback_must_be_a_json_boolean(api_as):
    router = RouterFactory(mode="pd")
    body = {"router": router.pk, "target": TARGET, "rollback": "no"}
    detail = refused(api_as("operator").post("/api/v1/rebalances/", body, format="json"))
    assert detail == {"rollback": ["must be a JSON boolean (true or false), got 'no'"]}
    assert not Rebalance.objects.exists()


def test_a_query_string_boolean_keeps_its_text_spelling(api_as):
    got = api_as("viewer").get(
        "/api/v1/capacity/sizing/?bytes_per_token=1000&max_total_tokens=1000&enable_hierarchical_cache=true"
    )
    assert got.status_code == 200, got.json()
    assert "enable_hierarchical_cachee" in refused(
        api_as("viewer").get("/api/v1/capacity/sizing/?bytes_per_token=1000&enable_hierarchical_cachee=true")
    )
