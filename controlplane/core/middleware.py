"""RequestContextMiddleware: one request id per request, echoed as X-Request-ID (NetBox/AWX style).
ApiSlashMiddleware: an API path without its trailing slash is served as if it had one."""

import re

from django.urls import Resolver404, resolve

from controlplane.core.context import new_request_id, request_id_var, source_ip_var, token_prefix_var

_VALID_ID = re.compile(r"^[A-Za-z0-9._-]{8,64}$")


class RequestContextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.headers.get("X-Request-ID", "")
        request_id = incoming if _VALID_ID.match(incoming) else new_request_id()
        request.request_id = request_id
        tokens = (
            request_id_var.set(request_id),
            source_ip_var.set(request.META.get("REMOTE_ADDR")),
            token_prefix_var.set(""),
        )
        try:
            response = self.get_response(request)
        finally:
            request_id_var.reset(tokens[0])
            source_ip_var.reset(tokens[1])
            token_prefix_var.reset(tokens[2])
        response["X-Request-ID"] = request_id
        response["API-Version"] = "1"
        return response


class ApiSlashMiddleware:
    """``/api/...`` without the trailing slash is served as the same path with it, whatever the method.
    Django's CommonMiddleware would answer a 301 to the slashed URL instead, and a client following it
    re-sends a POST as a GET without its body (or Django raises in DEBUG). Only a path that does not resolve
    as it is and does resolve with the slash is changed; anything else reaches the URL map unchanged (an
    unknown path stays the API's JSON 404). Must come before CommonMiddleware."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        path = request.path_info
        slashless = path.startswith("/api/") and not path.endswith("/")
        if slashless and not _resolves(path) and _resolves(path + "/"):
            request.path_info = path + "/"
            request.path = request.path + "/"
        return self.get_response(request)


def _resolves(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True
