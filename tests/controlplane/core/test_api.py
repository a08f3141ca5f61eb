"""API basics: auth, error shape, request id, schema."""

import pytest

pytestmark = pytest.mark.django_db


def test_anonymous_gets_401_in_the_error_shape(client):
    response = client.get("/api/v1/inventory/workers/")
    assert response.status_code in (401, 403)
    body = response.json()
    assert set(body["error"]) == {"code", "message", "detail", "request_id"}
    assert body["error"]["request_id"] == response["X-Request-ID"]


def test_schema_and_docs_are_served(api_as):
    schema = api_as("viewer").get("/api/schema/")
    assert schema.status_code == 200
    text = schema.content.decode()
    assert "/api/v1/operations/" in text and "Idempotency-Key" in text and "If-Match" in text
    assert api_as("viewer").get("/api/docs/").status_code == 200


def test_the_api_root_lists_every_endpoint_without_a_path_parameter(api_as, client):
    index = api_as("viewer").get("/api/v1/")
    assert index.status_code == 200, index.content
    body = index.json()
    endpoints = body["endpoints"]
    assert endpoints["inventory/workers/"] == {
        "url": "http://testserver/api/v1/inventory/workers/",
        "methods": ["GET", "POST"],
    }
    assert {"operations/", "rebalances/", "capacity/sizing/", "audit/events/"} <= set(endpoints)
    assert not any("<" in route or "(" in route for route in endpoints)
    assert (body["schema"], body["docs"]) == ("http://testserver/api/schema/", "http://testserver/api/docs/")
    # POST-only endpoints say so, read-only ones too
    assert endpoints["capacity/whatif/"]["methods"] == endpoints["agent/heartbeat/"]["methods"] == ["POST"]
    assert endpoints["audit/events/"]["methods"] == endpoints["operations/preview/"]["methods"] == ["GET"]
    for route, entry in endpoints.items():  # each method listed is served, each one left out is not
        answer = api_as("admin").options(entry["url"])
        allowed = {m.strip() for m in answer["Allow"].split(",")} - {"OPTIONS", "HEAD"}
        assert allowed == set(entry["methods"]), route
    for route in ("inventory/workers/", "operations/", "rebalances/", "audit/events/"):
        assert api_as("viewer").get(endpoints[route]["url"]).status_code == 200, route  # each one answers
    assert client.get("/api/v1/").status_code in (401, 403)


@pytest.mark.parametrize("path", ["/api/v1/nosuch/", "/api/nosuch"])
def test_unknown_api_paths_answer_a_json_404_in_the_error_envelope(api_as, path):
    response = api_as("viewer").get(path)
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert (error["code"], error["message"], error["detail"]) == ("not_found", "Not found.", {"path": path})
    assert error["request_id"] == response["X-Request-ID"]


def test_unknown_paths_outside_the_api_keep_the_html_404(client):
    response = client.get("/admin-nosuch/page/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


@pytest.mark.parametrize(
    ("url", "param", "message"),
    [
        ("/api/v1/inventory/hosts/?limit=abc", "limit", "must be an integer >= 1, got 'abc'"),
        ("/api/v1/inventory/hosts/?limit=-1", "limit", "must be an integer >= 1, got '-1'"),
        ("/api/v1/inventory/hosts/?offset=x", "offset", "must be an integer >= 0, got 'x'"),
        ("/api/v1/audit/events/?limit=abc", "limit", "must be an integer >= 1, got 'abc'"),
        ("/api/v1/audit/events/?cursor=garbage", "cursor", "not a cursor this list gave"),
        ("/api/v1/inventory/hosts/?ordering=bogus", "ordering", "unknown field 'bogus'; use one of"),
        ("/api/v1/inventory/hosts/?ordering=name,-bogus", "ordering", "unknown field '-bogus'"),
    ],
)
def test_bad_list_parameters_are_400_naming_the_parameter(api_as, url, param, message):
    response = api_as("viewer").get(url)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "validation_error" and list(error["detail"]) == [param]
    assert message in error["detail"][param][0]


def test_good_list_parameters_still_page_and_order(api_as):
    from cp_factories import HostFactory

    for name in ("h-b", "h-a", "h-c"):
        HostFactory(name=name)
    response = api_as("viewer").get("/api/v1/inventory/hosts/?limit=2&offset=1&ordering=-name")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 3 and [h["name"] for h in body["results"]] == ["h-b", "h-a"]


def test_a_post_without_the_trailing_slash_is_served_not_redirected(api_as):
    from controlplane.inventory.models import Host

    made = api_as("operator").post("/api/v1/inventory/hosts", {"name": "gpu-slash"}, format="json")
    assert made.status_code == 201, made.content  # not a 301 that loses the body
    host = Host.objects.get(name="gpu-slash")
    got = api_as("viewer").get(f"/api/v1/inventory/hosts/{host.pk}")
    assert got.status_code == 200 and got.json()["name"] == "gpu-slash"
    missing = api_as("viewer").get("/api/v1/inventory/nosuch")
    assert missing.status_code == 404
    assert missing.json()["error"]["detail"] == {"path": "/api/v1/inventory/nosuch"}
