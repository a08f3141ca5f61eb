"""Hostile-input and access checks: the launch preview echoes no fetched text; websockets follow the REST
roles, close when their token is revoked, and take token clients without an Origin header."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from cp_factories import (
    ConfigRevisionFactory,
    EngineWorkerFactory,
    StorageProfileFactory,
    UserFactory,
)

from controlplane.asgi import application

pytestmark = pytest.mark.django_db
SECRET = "internal-secret-3f9a"
WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


class _Page(BaseHTTPRequestHandler):
    """Any internal page an operator could point a worker URL at."""

    def do_GET(self):
        status = 200 if self.server.ok else 404
        body = f"<html>{SECRET} {'x' * 600}</html>".encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def pages():
    servers = []
    for ok in (True, False):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
        server.ok = ok
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def test_preview_returns_only_the_parsed_idle_state(api_as, pages):
    html, missing = (
        EngineWorkerFactory(name=n, url=u) for n, u in zip(("a-html", "b-404"), pages, strict=True)
    )
    response = api_as("viewer").get(f"/api/v1/operations/preview/?worker={html.pk}&worker={missing.pk}")
    assert response.status_code == 200 and SECRET not in response.content.decode()
    rows = response.json()
    assert isinstance(rows, list)  # as the schema says: a plain list, not a page
    assert [(r["name"], r["reachable"], r["is_idle"], r["error"]) for r in rows] == [
        ("a-html", False, None, "/server_info is not a worker's JSON object"),
        ("b-404", False, None, "/server_info answered HTTP 404"),
    ]


async def _connect(query: str, origin: bytes | None = None):
    headers = [(b"origin", origin)] if origin else []
    communicator = WebsocketCommunicator(application, f"/ws/v1/events/{query}", headers=headers)
    connected, code = await communicator.connect()
    if not connected:
        # a refused consumer still runs until the server's websocket.disconnect (it listens on the channel
        # layer); left running it is cancelled with the test's event loop, and a cancelled channels_redis
        # receive hung that teardown for the 600 s timeout once in CI
        await communicator.disconnect()
    return communicator, connected, code


async def _close_code(query: str, origin: bytes | None = None) -> int:
    """The code a refused socket gets: it is accepted and closed at once (a close before the accept would
    reach a real client as a bare HTTP 403 handshake answer, without the code)."""
    communicator, connected, _ = await _connect(query, origin)
    assert connected
    closed = await communicator.receive_output(timeout=WS_WAIT_S)
    await communicator.disconnect()
    assert closed["type"] == "websocket.close", closed
    return closed["code"]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_websocket_applies_the_rest_roles(personas):
    # REST denies agents every read: their sockets are refused (4403) with or without an Origin.
    for origin in (None, b"http://127.0.0.1"):
        assert await _close_code(f"?token={personas['agent'][1]}", origin) == 4403
    # A token client without an Origin header (a script) works as the docs say.
    communicator, connected, _ = await _connect(f"?token={personas['viewer'][1]}")
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": ["fleet", "operations"]})
    reply = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert reply["type"] == "control.subscribed" and reply["data"]["groups"] == ["fleet", "operations"]
    await communicator.send_json_to({"action": "subscribe", "groups": ["token.abc"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.error"
    await communicator.disconnect()
    # Without an Origin only a valid token gets in.
    assert await _close_code("?token=cp_000000000000.nope") == 4401


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_revoked_tokens_open_socket_is_closed(personas, api_as):
    from controlplane.accounts.models import ApiToken

    communicator, connected, _ = await _connect(f"?token={personas['viewer'][1]}", b"http://127.0.0.1")
    assert connected
    await communicator.send_json_to({"action": "subscribe", "groups": ["fleet"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.subscribed"

    def revoke():
        token = ApiToken.objects.get(user=personas["viewer"][0])
        return api_as("admin").delete(f"/api/v1/accounts/tokens/{token.pk}/").status_code

    assert await database_sync_to_async(revoke)() == 204
    closed = await communicator.receive_output(timeout=WS_WAIT_S)
    assert closed == {"type": "websocket.close", "code": 4401}
    await communicator.disconnect()  # the server's side of the close: the consumer leaves its groups and ends


def test_the_django_admin_cannot_write_what_must_be_audited(client):
    from controlplane.accounts.models import ApiToken
    from controlplane.accounts.services import token_create
    from controlplane.audit.models import AuditEvent
    from controlplane.configs.models import ConfigRevision
    from controlplane.inventory.models import EngineWorker, StorageProfile
    from controlplane.operations.models import Operation
    from controlplane.operations.services import operation_create

    root = UserFactory(username="root", is_superuser=True, is_staff=True)
    client.force_login(root)
    worker = EngineWorkerFactory(name="w-admin")
    revision = ConfigRevisionFactory()
    profile = StorageProfileFactory()
    op = operation_create(kind="detach", workers=[worker], actor=None, dispatch=False)
    token = token_create(user=root, name="t", actor=None)[0]
    events = AuditEvent.objects.count()

    base = "/admin"
    assert client.get(f"{base}/inventory/engineworker/{worker.pk}/change/").status_code == 200  # view only
    writes = [
        (f"{base}/inventory/engineworker/{worker.pk}/change/", {"name": "renamed", "url": worker.url}),
        (f"{base}/inventory/storageprofile/{profile.pk}/delete/", {"post": "yes"}),
        (f"{base}/inventory/storageprofile/add/", {"name": "x", "backend": "file"}),
        (f"{base}/configs/configrevision/{revision.pk}/delete/", {"post": "yes"}),
        (f"{base}/configs/configprofile/{revision.profile.pk}/change/", {"name": "renamed"}),
        (f"{base}/operations/operation/{op.pk}/delete/", {"post": "yes"}),
        (f"{base}/accounts/apitoken/{token.pk}/change/", {"revoked_at_0": "2026-01-01"}),
    ]
    for url, body in writes:
        assert client.post(url, body).status_code == 403, url
    assert EngineWorker.objects.get(pk=worker.pk).name == "w-admin"
    assert StorageProfile.objects.filter(pk=profile.pk).exists() and StorageProfile.objects.count() == 1
    assert (
        ConfigRevision.objects.filter(pk=revision.pk).exists() and Operation.objects.filter(pk=op.pk).exists()
    )
    assert ApiToken.objects.get(pk=token.pk).revoked_at is None
    assert AuditEvent.objects.count() == events
