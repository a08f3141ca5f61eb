"""Shared HTTP helpers: JSON body parsing, OpenAI-style error bodies, SSE framing and bearer-key checks."""

from __future__ import annotations

import hmac
import json

from fastapi import Request
from fastapi.responses import JSONResponse


class HTTPError(Exception):
    """Raised by route code; rendered as ``{"error": {"message", "type", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI-shaped error body (the ``openai`` SDK surfaces ``error.message``)."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "ServerError"
    )
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def json_body(request: Request) -> dict:
    """The request body as a JSON object; ``HTTPError(400)`` for invalid JSON or a non-object."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the JSON body must be an object")
    return data


def sse(data: dict | str) -> bytes:
    """One Server-Sent Events frame ``data: ...\\n\\n``."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")


def bearer_matches(request: Request, key: str) -> bool:
    """True when the request carries ``Authorization: Bearer <key>`` (constant-time compare)."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def require_api_key(request: Request) -> None:
    """Check ``--api-key`` (when set) for inference routes; ``HTTPError(401)`` otherwise."""
    key = request.app.state.engine.args.api_key
    if key and not bearer_matches(request, key):
        raise HTTPError(401, "Unauthorized: missing or wrong API key")
