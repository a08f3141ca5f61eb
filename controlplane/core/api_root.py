"""``GET /api/v1/``: the API's index, so a client that starts at the version's root finds its way.

Answers ``{"endpoints": {route: absolute URL}, "schema": URL, "docs": URL}``: every route under ``/api/v1/``
without a path parameter (collections and fixed endpoints such as ``inventory/workers/`` or
``capacity/sizing/``), sorted, read from the URL map itself so the list cannot drift from it. Any signed-in
role may read it (the default permission); anonymous requests get the usual 401 envelope.
"""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, reverse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView


def fixed_routes(patterns, prefix: str = "") -> list[str]:
    """Routes (``"inventory/workers/"``) of ``patterns`` and the resolvers under them that take no path
    parameter; regex routes (DRF routers') have their anchors removed."""
    out: list[str] = []
    for p in patterns:
        route = str(p.pattern).removeprefix("^").removesuffix("$")
        if "<" in route or "(" in route or "\\" in route:
            continue
        if isinstance(p, URLResolver):
            out += fixed_routes(p.url_patterns, prefix + route)
        elif isinstance(p, URLPattern) and prefix + route:
            out.append(prefix + route)
    return sorted(set(out))


class ApiRootView(APIView):
    """Every endpoint of this API that takes no path parameter, with the OpenAPI schema and its docs."""

    routes: list[str] = []  # what fixed_routes found (set by the URL map)

    def get_view_name(self) -> str:
        return "KVFleet API v1"

    @extend_schema(
        summary="The API's index", responses={200: OpenApiResponse(description="endpoints by route")}
    )
    def get(self, request):
        root = request.build_absolute_uri(reverse("api-root"))
        return Response(
            {
                "endpoints": {r: root + r for r in self.routes},
                "schema": request.build_absolute_uri(reverse("schema")),
                "docs": request.build_absolute_uri(reverse("swagger-ui")),
            }
        )
