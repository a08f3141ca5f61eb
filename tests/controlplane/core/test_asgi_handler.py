"""HTTP through the ASGI application: each request's middleware and view run on the process's bounded
request threads (no thread per request), API answers keep their JSON envelope and headers, and static files
(streamed) are served whole."""

import threading

import pytest
from asgiref.testing import ApplicationCommunicator
from django.conf import settings

from controlplane.asgi import application


async def _get(path: str, token: str = "") -> tuple[int, dict, bytes]:
    headers = [(b"host", b"127.0.0.1")] + ([(b"authorization", f"Bearer {token}".encode())] if token else [])
    scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": path, "raw_path": path.encode()}
    scope |= {"query_string": b"", "headers": headers, "client": ("127.0.0.1", 1)}
    app = ApplicationCommunicator(application, scope)
    await app.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await app.receive_output(30)
    body = b""
    while True:  # the last message of a streamed response has no body
        message = await app.receive_output(30)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return start["status"], dict(start["headers"]), body


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_requests_run_on_a_bounded_pool_of_request_threads(personas):
    token = personas["viewer"][1]
    for _ in range(3):  # the pool's threads exist after the first requests
        assert (await _get("/healthz"))[0] == 200
    before = threading.active_count()
    for _ in range(20):
        status, headers, body = await _get("/api/v1/inventory/hosts/", token)
        assert status == 200 and b'"results"' in body
        assert headers[b"X-Request-ID"] and headers[b"API-Version"] == b"1"
    assert threading.active_count() - before <= settings.ASGI_THREADS
    names = {t.name for t in threading.enumerate()}
    assert any(name.startswith("http-request") for name in names)


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_an_unauthenticated_api_call_and_a_static_file_through_asgi():
    status, _, body = await _get("/api/v1/inventory/hosts/")
    assert status == 401 and b'"error"' in body
    status, headers, body = await _get("/static/frontend/favicon.svg")
    assert status == 200 and body.startswith(b"<svg") and int(headers[b"Content-Length"]) == len(body)
