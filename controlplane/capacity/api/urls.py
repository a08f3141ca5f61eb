from django.urls import path

from controlplane.capacity.api import views

urlpatterns = [
    path("sizing/", views.SizingApi.as_view(), name="capacity-sizing"),
    path("workers/", views.WorkerCapacitiesApi.as_view(), name="capacity-workers"),
    path("traces/", views.RecordedPoolsApi.as_view(), name="capacity-traces"),
    path("whatif/", views.WhatIfApi.as_view(), name="capacity-whatif"),
    path("misses/", views.MissesApi.as_view(), name="capacity-misses"),
    path("crossover/", views.CrossoverApi.as_view(), name="capacity-crossover"),
    path("crossover/apply/", views.CrossoverApplyApi.as_view(), name="capacity-crossover-apply"),
    path("crossover/probe/", views.CrossoverProbeApi.as_view(), name="capacity-crossover-probe"),
    path("calibration/<str:pool>/", views.CalibrationApi.as_view(), name="capacity-calibration"),
    path("traces/<str:pool>.jsonl", views.RecordedTraceApi.as_view(), name="capacity-trace"),
]
agent_urlpatterns = [path("traces/", views.TraceIngestApi.as_view(), name="agent-traces")]
