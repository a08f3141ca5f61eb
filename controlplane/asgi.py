"""ASGI entry point: HTTP goes to Django, websockets to the telemetry consumer behind origin and auth checks
(``controlplane.accounts.ws_auth``).

Serve with `daphne controlplane.asgi:application`.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from controlplane.accounts.ws_auth import TokenOrSessionAuthMiddlewareStack  # noqa: E402
from controlplane.telemetry.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": TokenOrSessionAuthMiddlewareStack(URLRouter(websocket_urlpatterns)),
    }
)
