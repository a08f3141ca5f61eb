"""Error format (docs/api.md "Conventions"): a write with a bad field is 400 `validation_error`-style with
`detail` naming that field; a GET of a resource that does not apply to the object is 409 (`not_pd`)."""

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.rebalance.models import Rebalance

pytestmark = pytest.mark.django_db
TARGET = {"prefill": 1, "decode": 1}


def test_non_pd_router_is_a_400_naming_router_on_post_and_a_409_on_get(api_as):
    regular = RouterFactory(mode="regular")
    posted = api_as("operator").post(
        "/api/v1/rebalances/", {"router": regular.pk, "target": TARGET}, format="json"
    )
    error = posted.json()["error"]
    assert posted.status_code == 400 and error["code"] == "validation_error", error
    assert error["detail"]["router"] == ["not a PD router (mode regular)"]
    got = api_as("viewer").get(f"/api/v1/inventory/routers/{regular.pk}/recommendation/")
    assert got.status_code == 409 and got.json()["error"]["code"] == "not_pd"
    assert not Rebalance.objects.exists()


def test_attach_without_storage_profile_names_the_field(api_as):
    worker = EngineWorkerFactory()
    got = api_as("operator").post(
        "/api/v1/operations/", {"kind": "attach", "workers": [worker.pk], "reason": "test"}, format="json"
    )
    error = got.json()["error"]
    assert got.status_code == 400 and error["code"] == "missing_storage_profile"
    assert error["detail"] == {"storage_profile": ["required for attach"]}


@pytest.mark.parametrize("field", ["max_ttft_s", "max_itl_s"])
@pytest.mark.parametrize("value", [0, -0.5])
def test_rebalance_slo_limits_must_be_positive(api_as, field, value):
    router = RouterFactory(mode="pd")
    body = {"router": router.pk, "target": TARGET, "slo": {field: value}}
    got = api_as("operator").post("/api/v1/rebalances/", body, format="json")
    error = got.json()["error"]
    assert got.status_code == 400 and error["code"] == "validation_error", error
    assert error["detail"]["slo"][field] == ["must be greater than 0 (seconds)"]
    assert not Rebalance.objects.exists()


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        ("", "required: one or more worker ids (?worker=1&worker=2)"),
        ("?drain=true", "required: one or more worker ids (?worker=1&worker=2)"),
        ("?worker=abc", "must be integer ids >= 1, got 'abc'"),
        ("?worker=0", "must be integer ids >= 1, got '0'"),
        ("?worker=987654", "unknown worker ids: [987654]"),
    ],
)
def test_the_launch_preview_names_the_worker_field(api_as, query, problem):
    got = api_as("viewer").get(f"/api/v1/operations/preview/{query}")
    error = got.json()["error"]
    assert got.status_code == 400 and error["code"] == "validation_error", error
    assert error["detail"] == {"worker": [problem]} and error["message"] == f"worker: {problem}"
