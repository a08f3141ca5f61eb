"""The FastAPI application of one engine worker: routes from the small modules, error rendering."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from engine.server import admin, generate, info, openai
from engine.server.engine import Engine, EngineDeadError
from engine.server.http_utils import HTTPError, error_response


def create_app(engine: Engine) -> FastAPI:
    """Build the app around a started ``Engine``; every route reads it from ``app.state.engine``."""
    app = FastAPI(title="KVFleet engine worker", docs_url=None, redoc_url=None)
    app.state.engine = engine
    for module in (generate, openai, info, admin):
        app.include_router(module.router)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(exc.status, exc.message)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(400, str(exc))

    return app
