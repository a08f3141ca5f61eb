"""``GET /api/v1/``: the API's index, so a client that starts at the version's root finds its way.

Answers ``{"endpoints": {route: {"url": absolute URL, "methods": ["GET", "POST", ...]}}, "schema": URL,
"docs": URL}``: every route under ``/api/v1/`` without a path parameter (collections and fixed endpoints such
as ``inventory/workers/`` or ``capacity/sizing/``), sorted, with the HTTP methods its view answers (sorted;
OPTIONS and HEAD, which every view answers, left out), read from the URL map itself so the list cannot drift
from it. A method listed may still be refused to a role (403). Any signed-in role may read it (the default
permission); anonymous requests get the usual 401 envelope.
"""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, reverse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

IMPLICIT_METHODS = ("options", "head")  # answered by every view: not listed


def view_methods(callback) -> set[str]:
    """The HTTP methods (upper case) a URL pattern's view answers, OPTIONS and HEAD left out: a DRF viewset's
    bound actions (``{"get": "list", "post": "create"}``), else an APIView's (or Django view class's)
    handlers among its ``http_method_names``; a plain function view: empty (not known)."""
    actions = getattr(callback, "actions", None)
    if actions:
        return {m.upper() for m in actions if m not in IMPLICIT_METHODS}
    cls = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if cls is None:
        return set()
    return {m.upper() for m in cls.http_method_names if m not in IMPLICIT_METHODS and hasattr(cls, m)}


def fixed_routes(patterns, prefix: str = "") -> dict[str, list[str]]:
    """Routes (``"inventory/workers/"``) of ``patterns`` and the resolvers under them that take no path
    parameter, each with the methods its views answer (``view_methods``, sorted; a route two patterns serve
    gets both's); regex routes (DRF routers') have their anchors removed."""
    out: dict[str, set[str]] = {}
    for p in patterns:
        route = str(p.pattern).removeprefix("^").removesuffix("$")
        if "<" in route or "(" in route or "\\" in route:
            continue
        if isinstance(p, URLResolver):
            for sub, methods in fixed_routes(p.url_patterns, prefix + route).items():
                out.setdefault(sub, set()).update(methods)
        elif isinstance(p, URLPattern) and prefix + route:
            out.setdefault(prefix + route, set()).update(view_methods(p.callback))
    return {route: sorted(out[route]) for route in sorted(out)}


class ApiRootView(APIView):
    """Every endpoint of this API that takes no path parameter and the methods it answers, with the OpenAPI
    schema and its docs."""

    routes: dict[str, list[str]] = {}  # what fixed_routes found: route -> methods (set by the URL map)

    def get_view_name(self) -> str:
        return "KVFleet API v1"

    @extend_schema(
        summary="The API's index", responses={200: OpenApiResponse(description="endpoints by route")}
    )
    def get(self, request):
        root = request.build_absolute_uri(reverse("api-root"))
        return Response(
            {
                "endpoints": {r: {"url": root + r, "methods": m} for r, m in self.routes.items()},
                "schema": request.build_absolute_uri(reverse("schema")),
                "docs": request.build_absolute_uri(reverse("swagger-ui")),
            }
        )
