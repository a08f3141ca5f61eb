"""RequestContextMiddleware: one request id per request, echoed as X-Request-ID (NetBox/AWX style)."""

import re

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
