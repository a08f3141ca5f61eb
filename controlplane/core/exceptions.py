"""One error shape for the whole API: {"error": {"code", "message", "detail", "request_id"}}.

Services raise ApplicationError (or a subclass) with an HTTP status; DRF and Django errors are mapped onto the
same envelope by `exception_handler`.
"""

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DatabaseError, DataError, IntegrityError
from django.http import Http404
from rest_framework import exceptions as drf_exceptions
from rest_framework import status
from rest_framework.response import Response

from controlplane.core.context import current_request_id

log = logging.getLogger(__name__)


class ApplicationError(Exception):
    """A business-rule failure with a stable machine-readable `code` and an HTTP status."""

    status_code = status.HTTP_400_BAD_REQUEST
    code = "invalid"

    def __init__(self, message: str, *, code: str | None = None, status_code: int | None = None, detail=None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.status_code = status_code or self.status_code
        self.detail = detail or {}


class ConflictError(ApplicationError):
    status_code = status.HTTP_409_CONFLICT
    code = "conflict"


class ServiceUnavailable(ApplicationError):
    """A backing service (the task broker, ...) is unreachable: 503, nothing was started."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    code = "service_unavailable"


class PreconditionFailed(ApplicationError):
    status_code = status.HTTP_412_PRECONDITION_FAILED
    code = "precondition_failed"


class PreconditionRequired(ApplicationError):
    status_code = status.HTTP_428_PRECONDITION_REQUIRED
    code = "precondition_required"


def error_body(code: str, message: str, detail=None) -> dict:
    return {
        "error": {
            "code": code,
            "message": message,
            "detail": detail or {},
            "request_id": current_request_id(),
        }
    }


def database_error(exc: DatabaseError) -> ApplicationError:
    """The API's answer to a database error no service handled: 409 ``integrity_error`` for a constraint a
    write broke, 400 ``data_error`` for a value the column refuses, else 503 ``database_unavailable`` (the
    server refused or lost the connection, e.g. "too many clients"; retry). The driver's text stays in the
    server log: it can quote row values."""
    if isinstance(exc, IntegrityError):
        return ConflictError("the change conflicts with stored data", code="integrity_error")
    if isinstance(exc, DataError):
        return ApplicationError("a value does not fit its database column", code="data_error")
    return ServiceUnavailable("the database is unavailable; retry shortly", code="database_unavailable")


def exception_handler(exc, context):
    from rest_framework.views import exception_handler as drf_exception_handler  # DRF imports this module

    if isinstance(exc, DatabaseError):
        log.error("database error in %s: %r", context.get("view").__class__.__name__, exc)
        exc = database_error(exc)
    if isinstance(exc, ApplicationError):
        return Response(error_body(exc.code, exc.message, exc.detail), status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = drf_exceptions.ValidationError(detail)
    elif isinstance(exc, Http404):
        exc = drf_exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = drf_exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, drf_exceptions.ValidationError):
        code, message, detail = "validation_error", "Invalid input.", response.data
    else:
        codes = exc.get_codes() if isinstance(exc, drf_exceptions.APIException) else "error"
        code = codes if isinstance(codes, str) else "error"
        message = str(exc.detail) if isinstance(exc, drf_exceptions.APIException) else str(exc)
        detail = {}
    response.data = error_body(code, message, detail)
    return response
