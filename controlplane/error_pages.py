"""The error pages the URL map names (``handler404``, ``handler500``): the API's JSON envelope under
``/api/``, the console's pages elsewhere. Here, at the top beside the URL map, rather than in
``core.exceptions``, which the console's own modules import."""

import logging
import sys

from django.db import DatabaseError
from django.http import JsonResponse
from django.views.defaults import server_error as html_server_error

from controlplane.core.exceptions import database_error, error_body
from frontend.views import not_found as console_not_found
from frontend.views import server_error as console_server_error

log = logging.getLogger(__name__)


def not_found(request, exception=None):
    """The 404 page (``handler404``): the JSON envelope under ``/api/``, the console's page in its layout
    elsewhere (``frontend.views.not_found``)."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not_found", "Not found.", {"path": request.path}), status=404)
    return console_not_found(request)


def server_error(request):
    """The 500 page (``handler500``): under ``/api/`` the JSON envelope (a database error as
    :func:`database_error` maps it), never Django's HTML page; the console's page in its layout elsewhere
    (``frontend.views.server_error``: no database read, which may be what failed), Django's plain page if
    even that fails."""
    if not request.path.startswith("/api/"):
        try:
            return console_server_error(request)
        except Exception:
            log.exception("the console's 500 page failed")
            return html_server_error(request)
    exc = sys.exc_info()[1]
    if isinstance(exc, DatabaseError):
        err = database_error(exc)
        return JsonResponse(error_body(err.code, err.message), status=err.status_code)
    return JsonResponse(error_body("server_error", "Internal server error."), status=500)
