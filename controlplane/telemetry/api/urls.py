from django.urls import path

from controlplane.telemetry.api import views

urlpatterns = [
    path("fleet/", views.FleetMetricsApi.as_view(), name="telemetry-fleet"),
    path("workers/<int:pk>/", views.WorkerMetricsApi.as_view(), name="telemetry-worker"),
    path("workers/<int:pk>/series/", views.WorkerSeriesApi.as_view(), name="telemetry-worker-series"),
    path("targets/", views.ScrapeTargetsApi.as_view(), name="telemetry-targets"),
]
