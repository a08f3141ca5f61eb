"""GET /api/v1/inventory/routers/{id}/recommendation/: the P:D planner's advice for a PD router."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.core.exceptions import ConflictError
from controlplane.inventory.models import Router, RouterMode
from controlplane.rebalance.planner.service import recommendation


class RecommendationApi(APIView):
    """The newest recommendation (re-evaluated when older than 5 s): status, current and recommended
    (prefill, decode) in devices (``unit``: a worker of tp N spans N devices), ``current_workers`` and
    ``recommended_workers`` (the worker counts a rebalance's target takes) with the ``moves`` that reach
    it, a summary and the reasons with each pool's demand, per-device capacity at the SLO, hit-rate
    discount and headroom. 409 ``not_pd`` for a router that is not in PD mode."""

    @extend_schema(responses=OpenApiTypes.OBJECT, tags=["rebalance"])
    def get(self, request, pk: int):
        router = get_object_or_404(Router, pk=pk)
        if router.mode != RouterMode.PD:
            raise ConflictError(
                f"router {router.name!r} is not a PD router (mode {router.mode})", code="not_pd"
            )
        return Response(recommendation(router))
