"""The FastAPI application of one engine worker: routes from the small modules, error rendering."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi

from engine.server import admin, generate, info, loads, openai, pd_role_switch, recording, schemas
from engine.server.engine import Engine, UnavailableError
from engine.server.http_utils import BodyLimit, HTTPError, error_response
from engine.server.tenants import TenantGate

logger = logging.getLogger(__name__)


class JSONServerErrors:
    """ASGI middleware: an exception no handler maps becomes a JSON 500 in the usual error shape (traceback
    logged), and the connection stays usable; once a response has started (a stream) it propagates."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
            await response(scope, receive, send)


class CountAccepted:
    """ASGI middleware: a request to a route that runs inference (``INFERENCE_PATHS``) is held in
    ``Scheduler.accepted`` from the moment it arrives until its response has ended (a stream: its last
    frame), so the worker is not idle while one is read, parsed, tokenized, checked or submitted."""

    def __init__(self, app, engine: Engine | None):
        self.app = app
        self.engine = engine

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in INFERENCE_PATHS:
            return await self.app(scope, receive, send)
        assert self.engine is not None, "an app without an engine only builds the OpenAPI schema"
        with self.engine.scheduler.accepted():
            await self.app(scope, receive, send)


INFERENCE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


def create_app(engine: Engine | None) -> FastAPI:
    """Build the app around a started ``Engine`` (None: only for building the OpenAPI schema); every route
    reads it from ``app.state.engine``. Bodies over ``http_utils.MAX_BODY_BYTES`` are a 413;
    ``/openapi.json`` declares the request bodies (``schemas``)."""
    app = FastAPI(title="KVFleet engine worker", docs_url=None, redoc_url=None)
    app.state.engine = engine
    for module in (generate, openai, info, loads, admin, recording, pd_role_switch):
        app.include_router(module.router)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(UnavailableError)
    async def _unavailable(request: Request, exc: UnavailableError):
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        loc = [str(part) for part in (exc.errors() or [{}])[0].get("loc", ()) if part != "body"]
        return error_response(400, str(exc), ".".join(loc) or None)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas.component_schemas())
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
    app.add_middleware(JSONServerErrors)
    app.add_middleware(BodyLimit)
    # inside CountAccepted: a refused request was accepted, then answered
    if engine is not None and engine.tenants is not None:
        on_rejected = engine.metrics.on_tenant_rejected if engine.metrics else None
        app.add_middleware(TenantGate, tenants=engine.tenants, on_rejected=on_rejected)
    app.add_middleware(CountAccepted, engine=engine)
    return app
