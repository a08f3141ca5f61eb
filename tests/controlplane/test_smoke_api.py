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
