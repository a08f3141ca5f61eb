"""ASGI entry point: HTTP goes to Django (each request's middleware and view in one pooled thread,
``controlplane.core.asgi_handler``), websockets to the telemetry consumer behind origin and auth checks
(``controlplane.accounts.ws_auth``).

Serve with `daphne controlplane.asgi:application`.
"""

import os
from http import HTTPStatus

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup(set_prefix=False)

from controlplane.core.asgi_handler import OneThreadASGIHandler  # noqa: E402

django_asgi_app = OneThreadASGIHandler()

try:  # daphne writes Twisted's reason phrase, which some codes lack ("HTTP/1.1 422 Unknown Status")
    from twisted.web import http as twisted_http
except ImportError:  # another ASGI server: it has its own phrases
    pass
else:
    for status in HTTPStatus:
        twisted_http.RESPONSES.setdefault(status.value, status.phrase.encode())

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from controlplane.accounts.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from controlplane.telemetry.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
    }
)
