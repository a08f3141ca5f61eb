from django.urls import path

from controlplane.telemetry.api import views

urlpatterns = [
    path("fleet/", views.FleetMetricsApi.as_view(), name="telemetry-fleet"),
    path("workers/<int:pk>/", views.WorkerMetricsApi.as_view(), name="telemetry-worker"),
]
agent_urlpatterns = [path("metrics/", views.MetricsIngestApi.as_view(), name="agent-metrics")]
