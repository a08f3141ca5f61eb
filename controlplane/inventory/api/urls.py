from django.urls import path
from rest_framework.routers import SimpleRouter

from controlplane.inventory.api import views

router = SimpleRouter()
router.register("hosts", views.HostViewSet, basename="host")
router.register("gpus", views.GpuViewSet, basename="gpu")
router.register("alerts", views.FleetAlertViewSet, basename="fleetalert")
router.register("routers", views.RouterViewSet, basename="router")
router.register("storage-profiles", views.StorageProfileViewSet, basename="storageprofile")
router.register("workers", views.EngineWorkerViewSet, basename="worker")

urlpatterns = [
    *router.urls,
]
agent_urlpatterns = [
    path("register/", views.AgentRegisterApi.as_view(), name="agent-register"),
    path("heartbeat/", views.AgentHeartbeatApi.as_view(), name="agent-heartbeat"),
]
