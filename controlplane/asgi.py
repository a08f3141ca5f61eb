"""ASGI entry point: HTTP goes to Django (each request's middleware and view in one pooled thread,
``controlplane.core.asgi_handler``), websockets to the telemetry consumer behind origin and auth checks
(``controlplane.accounts.ws_auth``).

Serve with `daphne controlplane.asgi:application`.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup(set_prefix=False)

from controlplane.core.asgi_handler import OneThreadASGIHandler  # noqa: E402

django_asgi_app = OneThreadASGIHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from controlplane.accounts.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from controlplane.telemetry.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
    }
)
