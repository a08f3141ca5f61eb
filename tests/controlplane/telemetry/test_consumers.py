"""The events websocket (controlplane/telemetry/consumers.py): a message that is not JSON gets a
``control.error`` naming the problem and the socket stays open; a refused socket reaches a real client
(daphne) as close code 4401, not as an HTTP 403 handshake answer."""

import aiohttp
import pytest
from channels.testing import WebsocketCommunicator

from controlplane.asgi import application

WS_WAIT_S = 15  # one websocket reply, on a loaded 2-core CI machine


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_non_json_message_gets_an_error_and_the_socket_stays_open(personas):
    communicator = WebsocketCommunicator(application, f"/ws/v1/events/?token={personas['viewer'][1]}")
    assert (await communicator.connect())[0]
    await communicator.send_to(text_data="subscribe fleet")
    error = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert error["type"] == "control.error"
    assert error["data"]["message"] == (
        'not JSON (Expecting value at character 0): send {"action": "subscribe", "groups": [...]}'
    )
    await communicator.send_to(bytes_data=b'{"action": "subscribe"}')
    error = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert error["data"]["message"] == "binary frame: send JSON text frames"
    # still open: a subscribe after the bad messages works
    await communicator.send_json_to({"action": "subscribe", "groups": ["fleet"]})
    reply = await communicator.receive_json_from(timeout=WS_WAIT_S)
    assert reply["type"] == "control.subscribed" and reply["data"]["groups"] == ["fleet"]
    await communicator.disconnect()


@pytest.mark.asyncio
async def test_an_anonymous_socket_is_closed_with_4401_through_a_real_server(asgi_server):
    url = asgi_server.replace("http://", "ws://") + "/ws/v1/events/"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, origin=asgi_server) as ws:
        message = await ws.receive(timeout=WS_WAIT_S)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 4401


@pytest.mark.asyncio
async def test_a_socket_without_origin_or_token_is_refused_at_the_handshake(asgi_server):
    """No Origin header and no ``?token=``: Channels' origin check answers the handshake with HTTP 403, so
    such a client sees no close code (docs/api.md says both cases)."""
    url = asgi_server.replace("http://", "ws://") + "/ws/v1/events/"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url)
    assert refused.value.status == 403
