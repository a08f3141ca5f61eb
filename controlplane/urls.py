"""URL map: /api/v1/ (REST; its root the index of its endpoints), /api/schema/ (OpenAPI) + /api/docs/
(Swagger UI), /admin/, /healthz (liveness), /readyz (readiness: database and Redis), console."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.capacity.api.urls import agent_urlpatterns as capacity_agent
from controlplane.core.api_root import ApiRootView, fixed_routes
from controlplane.core.health import healthz, readyz
from controlplane.inventory.api.urls import agent_urlpatterns as inventory_agent
from controlplane.rebalance.api.recommendation import RecommendationApi

api_v1 = [
    path("accounts/", include("controlplane.accounts.api.urls")),
    path(
        "inventory/routers/<int:pk>/recommendation/",
        RecommendationApi.as_view(),
        name="router-recommendation",
    ),
    path("inventory/", include("controlplane.inventory.api.urls")),
    path("configs/", include("controlplane.configs.api.urls")),
    path("operations/", include("controlplane.operations.api.urls")),
    path("audit/", include("controlplane.audit.api.urls")),
    path("telemetry/", include("controlplane.telemetry.api.urls")),
    path("capacity/", include("controlplane.capacity.api.urls")),
    path("rebalances/", include("controlplane.rebalance.api.urls")),
    path("agent/", include(inventory_agent + capacity_agent)),
]
api_v1.append(path("", ApiRootView.as_view(routes=fixed_routes(api_v1)), name="api-root"))

urlpatterns = [
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("admin/", admin.site.urls),
    path("healthz", healthz),
    path("readyz", readyz),
    path("", include("frontend.urls")),
]

handler404 = "controlplane.error_pages.not_found"
handler500 = "controlplane.error_pages.server_error"
