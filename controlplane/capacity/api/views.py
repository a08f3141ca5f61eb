"""Capacity endpoints: the KV sizing calculator and the workers' current pool sizes."""

from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.capacity import selectors, services
from controlplane.capacity.api.serializers import SizingQuerySerializer


class SizingApi(APIView):
    """GET: per-tier KV capacity in tokens and bytes for the given model shape and launch flags, with the
    engine's warnings (400 naming each bad parameter). A calculation: it changes nothing."""

    @extend_schema(parameters=[SizingQuerySerializer], responses=OpenApiTypes.OBJECT)
    def get(self, request):
        query = SizingQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        args = dict(query.validated_data)
        shape = {k: args.pop(k, None) for k in ("num_layers", "num_kv_heads", "head_dim")}
        dtype = args.pop("dtype")
        if "bytes_per_token" not in args:
            args["bytes_per_token"] = services.kv_bytes_per_token(**shape, dtype=dtype)
        return Response(services.kv_sizing(**args))


class WorkerCapacitiesApi(APIView):
    """GET: every worker's pool, page size and reported L1 / L2 capacity (tokens; null until it reports)."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response({"workers": selectors.worker_capacities()})
