"""Telemetry endpoints: agent ingest, one worker's live metrics, the fleet summary."""

from django.db import connection
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiTypes, extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import AGENT_ROLES
from controlplane.accounts.selectors import agent_host_scope
from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import selectors, services, store
from controlplane.telemetry.api.serializers import MetricsIngestSerializer


class MetricsIngestApi(APIView):
    """Agent: push one metrics sample for a worker (Prometheus text or a flat dict of snapshot keys).

    400 ``unknown_worker`` when no such worker is registered (the agent registers again); an agent token may
    push only for its own host's workers (403)."""

    write_roles = AGENT_ROLES

    @extend_schema(request=MetricsIngestSerializer, responses={202: OpenApiTypes.OBJECT}, tags=["agent"])
    def post(self, request):
        body = MetricsIngestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        worker_id = services.ingest_worker_id(
            worker_id=data.get("worker"),
            worker_url=data.get("worker_url"),
            bound_host=agent_host_scope(request.user, request.auth),
        )
        # Nothing below reads the database: hand the connection back to the pool now rather than hold it
        # through the parse and the Redis writes (under load, more requests than pooled connections run).
        if not connection.in_atomic_block:
            connection.close()
        sample = services.metrics_ingest(
            worker_id=worker_id, text=data.get("text"), metrics=data.get("metrics"), ts=data.get("ts")
        )
        return Response(sample, status=status.HTTP_202_ACCEPTED)


class WorkerMetricsApi(APIView):
    """Latest sample and history (oldest first); ?history=N samples (default 120, at most one hour's)."""

    @extend_schema(
        parameters=[OpenApiParameter("history", int, description="samples of history, 1..1800")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request, pk: int):
        worker = get_object_or_404(EngineWorker, pk=pk)
        raw = request.query_params.get("history", "120")
        if not raw.isdigit() or not 1 <= int(raw) <= store.HISTORY_LEN:
            raise ValidationError({"history": [f"an integer from 1 to {store.HISTORY_LEN}"]})
        return Response(selectors.worker_metrics(worker_id=worker.pk, history_limit=int(raw)))


class FleetMetricsApi(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response(selectors.fleet_summary())
