"""Shared HTTP helpers: bounded JSON body parsing, OpenAI-style error bodies, SSE framing, bearer-key checks,
running a request's work until its client disconnects, and interleaving several streams."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

T = TypeVar("T")


# "temperature must be >= 0", "messages.1.role: must be ...", "image_data[0]: ..." -> the leading field
_LEADING_FIELD = re.compile(r"([A-Za-z_]\w*(?:\.\w+|\[\d+\])*)(?:: | must )")


def leading_field(message: str) -> str | None:
    """The request field a ``"field: why"`` or ``"field must ..."`` message starts with (``None`` when it
    starts with none, or names the whole body)."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match and match.group(1) != "body" else None


class HTTPError(Exception):
    """Raised by route code; rendered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``.
    ``param`` (the offending request field) defaults to the field the message starts with
    (``leading_field``)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is not None else leading_field(message)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI-shaped error body: ``message``, ``type``, ``param`` (the request field at fault, or null) and
    ``code`` (the HTTP status); the ``openai`` SDK surfaces them as ``err.message`` / ``err.param``."""
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        413: "RequestTooLargeError",
        429: "RateLimitError",
    }.get(status, "ServerError")
    body = {"message": message, "type": kind, "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


MAX_BODY_BYTES = 4 * 1024 * 1024  # a full-context prompt is ~40 KB of text; SGLang has no limit
MAX_JSON_DEPTH = 32


async def json_body(request: Request) -> dict:
    """The request body as a JSON object, parsed off the event loop.

    ``HTTPError(400)`` for invalid JSON, a non-object, nesting deeper than ``MAX_JSON_DEPTH`` or a string that
    is not valid Unicode (a lone surrogate escape), naming where; bodies over ``MAX_BODY_BYTES`` are refused
    with 413 by ``BodyLimit`` before they are read.
    """
    raw = await request.body()
    return await asyncio.to_thread(parse_json_object, raw)


def parse_json_object(raw: bytes) -> dict:
    """See ``json_body``."""
    try:
        data = json.loads(raw or b"null")
    except RecursionError:
        raise HTTPError(400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the JSON body must be an object")
    _check_values(data)
    return data


def _check_values(data: dict) -> None:
    """Walk the parsed body (iteratively): bounded depth, every key and string encodable as UTF-8."""
    stack: list[tuple[object, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path or "body")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise HTTPError(400, f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                _check_text(key, child)
                stack.append((item, child, depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HTTPError(400, f"{path}: not valid Unicode ({exc.reason} at position {exc.start})") from None


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 naming the limit, checked against
    ``Content-Length`` before anything is read and against the bytes received for chunked bodies."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, self._message())(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPError(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"


def sse(data: dict | str) -> bytes:
    """One Server-Sent Events frame ``data: ...\\n\\n``."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def bearer_token(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_matches(request: Request, key: str) -> bool:
    """True when the request carries ``Authorization: Bearer <key>`` (constant-time compare)."""
    token = bearer_token(request.headers.get("authorization", ""))
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


def require_api_key(request: Request) -> None:
    """Check ``--api-key`` (when set) for inference routes; ``HTTPError(401)`` otherwise."""
    key = request.app.state.engine.args.api_key
    if key and not bearer_matches(request, key):
        raise HTTPError(401, "Unauthorized: missing or wrong API key")


async def until_disconnect(request: Request, work):
    """The result of the coroutine ``work``, unless the client disconnects first: then ``work`` is cancelled
    (its ``finally`` blocks abort what it submitted) and ``HTTPError(499)`` is raised. For non-streaming
    routes, once their body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it is done; otherwise the client is gone or this route was cancelled
    if task not in done:
        await asyncio.gather(task, return_exceptions=True)
        raise HTTPError(499, "client disconnected; request aborted")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def interleave(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """``(i, item)`` for every item of the async iterators ``streams``, in the order they arrive (``i``:
    the stream's position in the list), until all are exhausted. When the consumer stops early (or is
    cancelled), the streams still running are cancelled and closed, so their ``finally`` blocks run (an
    ``Engine.stream`` aborts its request). An exception of a stream propagates after the others are
    cancelled."""
    iters = [aiter(s) for s in streams]
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iters[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iters:
            close = getattr(it, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
