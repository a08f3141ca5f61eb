"""Telemetry endpoints: agent ingest, one worker's live metrics, the fleet summary."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import AGENT_ROLES
from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import selectors, services
from controlplane.telemetry.api.serializers import MetricsIngestSerializer


class MetricsIngestApi(APIView):
    """Agent: push one metrics sample for a worker (Prometheus text or a flat dict of snapshot keys)."""

    write_roles = AGENT_ROLES

    @extend_schema(request=MetricsIngestSerializer, responses={202: OpenApiTypes.OBJECT}, tags=["agent"])
    def post(self, request):
        body = MetricsIngestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        sample = services.metrics_ingest(
            worker=data["worker"], text=data.get("text"), metrics=data.get("metrics")
        )
        return Response(sample, status=status.HTTP_202_ACCEPTED)


class WorkerMetricsApi(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, pk: int):
        worker = get_object_or_404(EngineWorker, pk=pk)
        return Response(selectors.worker_metrics(worker_id=worker.pk))


class FleetMetricsApi(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response(selectors.fleet_summary())
