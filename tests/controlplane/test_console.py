"""Console pages are served by Django: login required, every page renders for each role."""

import pytest
from cp_factories import EngineWorkerFactory

pytestmark = pytest.mark.django_db

PAGES = ["/", "/storage/", "/operations/", "/operations/new/", "/audit/", "/operations/1/"]


def test_pages_need_login(client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_pages_render_and_gate_write_controls(client, personas, role):
    client.force_login(personas[role][0])
    worker = EngineWorkerFactory()
    for url in [*PAGES, f"/workers/{worker.pk}/"]:
        response = client.get(url)
        assert response.status_code == 200, url
    fleet = client.get("/").content.decode()
    assert ('id="launch-selected"' in fleet) is (role == "operator")
    assert 'data-testid="role">' + role in fleet


def test_login_form_logs_in(client, personas):
    response = client.post("/login/", {"username": "operator-user", "password": "pw-for-tests-1"})
    assert response.status_code == 302 and response["Location"] == "/"
