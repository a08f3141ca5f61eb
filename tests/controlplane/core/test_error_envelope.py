"""Every error under /api/ is the JSON envelope, database failures included (never Django's HTML 500)."""

from contextlib import contextmanager

import pytest
from django.db import connection, transaction
from django.test import Client

pytestmark = pytest.mark.django_db


@contextmanager
def _table_missing(table: str):
    """``table`` renamed away for the block: a real "no such table" from the database. Undone by rolling
    back to a savepoint, which on PostgreSQL also ends the aborted state the failed query leaves."""
    savepoint = transaction.savepoint()
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE "{table}" RENAME TO "{table}_away"')
    try:
        yield
    finally:
        transaction.savepoint_rollback(savepoint)


def test_a_database_error_in_a_view_is_a_json_503(api_as):
    with _table_missing("inventory_host"):
        response = api_as("viewer").get("/api/v1/inventory/hosts/")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "database_unavailable" and error["request_id"] == response["X-Request-ID"]


def test_a_lost_session_table_is_a_json_503_for_the_api_and_a_page_for_the_console(personas):
    client = Client(raise_request_exception=False)
    client.force_login(personas["viewer"][0])
    with _table_missing("django_session"):
        api = client.get("/api/v1/inventory/hosts/")
        page = client.get("/")
    assert (api.status_code, api["Content-Type"]) == (503, "application/json")
    assert api.json()["error"]["code"] == "database_unavailable"
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")


def test_an_error_no_view_handled_is_the_json_envelope_under_api(rf):
    """Django's 500 handler (what an exception outside DRF's views reaches) answers JSON under /api/."""
    from controlplane.error_pages import server_error

    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        api = server_error(rf.get("/api/v1/inventory/hosts/"))
        page = server_error(rf.get("/"))
    assert (api.status_code, api["Content-Type"]) == (500, "application/json")
    assert b'"code": "server_error"' in api.content and b"a bug" not in api.content
    assert page.status_code == 500 and page["Content-Type"].startswith("text/html")
