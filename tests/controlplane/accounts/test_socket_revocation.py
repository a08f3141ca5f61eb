"""Open websockets end with the credentials they were opened with: a console session's sockets close when
it logs out, every socket of a user closes when the user is deactivated (a token's when it is revoked:
test_security.py)."""

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from controlplane.asgi import application

WS_WAIT_S = 15  # one websocket push, on a loaded 2-core CI machine


async def _subscribed(headers: list, query: str = "") -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(application, f"/ws/v1/events/{query}", headers=headers)
    connected, code = await communicator.connect()
    assert connected, code
    await communicator.send_json_to({"action": "subscribe", "groups": ["fleet"]})
    assert (await communicator.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.subscribed"
    return communicator


def _console_login(user) -> tuple[Client, list]:
    client = Client()
    client.force_login(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    return client, [(b"origin", b"http://127.0.0.1"), (b"cookie", cookie)]


async def _closed(communicator: WebsocketCommunicator) -> dict:
    closed = await communicator.receive_output(timeout=WS_WAIT_S)
    await communicator.disconnect()
    return closed


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_logging_out_closes_that_sessions_sockets_only(personas):
    viewer = personas["viewer"][0]
    client, headers = await database_sync_to_async(_console_login)(viewer)
    _, other_headers = await database_sync_to_async(_console_login)(viewer)  # a second browser
    socket = await _subscribed(headers)
    other = await _subscribed(other_headers)

    response = await database_sync_to_async(client.post)("/logout/")
    assert response.status_code == 302

    assert await _closed(socket) == {"type": "websocket.close", "code": 4401}
    await other.send_json_to({"action": "subscribe", "groups": ["fleet"]})  # still open and served
    assert (await other.receive_json_from(timeout=WS_WAIT_S))["type"] == "control.subscribed"
    await other.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_deactivating_a_user_closes_all_their_sockets(personas, api_as):
    viewer = personas["viewer"][0]
    _, headers = await database_sync_to_async(_console_login)(viewer)
    console = await _subscribed(headers)
    script = await _subscribed([], f"?token={personas['viewer'][1]}")

    def deactivate():
        return api_as("admin").patch(f"/api/v1/accounts/users/{viewer.pk}/", {"is_active": False}).status_code

    assert await database_sync_to_async(deactivate)() == 200
    assert await _closed(console) == {"type": "websocket.close", "code": 4401}
    assert await _closed(script) == {"type": "websocket.close", "code": 4401}
