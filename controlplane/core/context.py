"""Per-request context (request id, source IP, token prefix) carried in contextvars.

The middleware fills it for HTTP requests; token authentication adds the token prefix; Celery tasks set the
request id of the operation they work for, so audit rows written by workers link back to the API call.
"""

import contextvars
import uuid
from contextlib import contextmanager

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
source_ip_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("source_ip", default=None)
token_prefix_var: contextvars.ContextVar[str] = contextvars.ContextVar("token_prefix", default="")


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str:
    return request_id_var.get()


@contextmanager
def bound_request_id(request_id: str):
    """Run a block (e.g. a Celery task body) under the request id of the API call that caused it."""
    token = request_id_var.set(request_id or new_request_id())
    try:
        yield
    finally:
        request_id_var.reset(token)
