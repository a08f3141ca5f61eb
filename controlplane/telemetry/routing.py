from django.urls import path

from controlplane.telemetry.consumers import EventConsumer

websocket_urlpatterns = [path("ws/v1/events/", EventConsumer.as_asgi())]
