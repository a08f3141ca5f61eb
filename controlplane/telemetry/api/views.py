"""Telemetry endpoints, all read from the TSDB: one worker's charts and scrapes, the fleet summary, and the
TSDB's own service discovery of the fleet's scrape targets."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiTypes, extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.inventory.models import EngineWorker
from controlplane.telemetry import discovery, promql, samples, selectors, worker_view
from controlplane.telemetry.api.serializers import ScrapeTargetGroupSerializer


class WorkerMetricsApi(APIView):
    """The worker's scrapes from the TSDB (`telemetry.samples`): ``{"worker_id", "history": [sample, ...]}``
    oldest first over the last ``?window_s=`` seconds (60..3600, default 600), each sample with ``seq`` (its
    time in ms: a reader's order and dedupe key); ``unavailable`` says why there is none while the TSDB does
    not answer. The rebalance page's pool charts read it. 400 naming ``window_s``."""

    @extend_schema(
        parameters=[OpenApiParameter("window_s", int, description="seconds of scrapes, 60..3600")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request, pk: int):
        worker = get_object_or_404(EngineWorker, pk=pk)
        raw = request.query_params.get("window_s", "600")
        if not raw.isdigit() or not 60 <= int(raw) <= worker_view.WINDOW_S:
            raise ValidationError({"window_s": [f"an integer from 60 to {int(worker_view.WINDOW_S)}"]})
        try:
            history = samples.worker_samples([worker.name], float(raw))[worker.name]
        except promql.PromQLError as exc:
            down = worker_view.unavailable(exc)
            return Response({"worker_id": worker.pk, "history": [], **down})
        for sample in history:
            sample["seq"] = round(sample["ts"] * 1000)
        return Response({"worker_id": worker.pk, "history": history, "unavailable": None})


class WorkerSeriesApi(APIView):
    """The worker page's charts from the TSDB (`worker_view.history`): ``?window_s=`` seconds of history
    (60..3600, default 3600) every ``step_s``, its newest point's L3 breaker and tenant figures, and
    ``unavailable`` (why there is no figure) while the TSDB does not answer. 400 naming ``window_s``."""

    @extend_schema(
        parameters=[OpenApiParameter("window_s", int, description="seconds of history, 60..3600")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request, pk: int):
        worker = get_object_or_404(EngineWorker, pk=pk)
        raw = request.query_params.get("window_s", str(int(worker_view.WINDOW_S)))
        if not raw.isdigit() or not 60 <= int(raw) <= worker_view.WINDOW_S:
            raise ValidationError({"window_s": [f"an integer from 60 to {int(worker_view.WINDOW_S)}"]})
        return Response({"worker_id": worker.pk, **worker_view.history(worker.name, window_s=float(raw))})


class FleetMetricsApi(APIView):
    """The fleet summary from the TSDB (`selectors.fleet_summary`): pools, totals and one page of the worker
    table, ``?page=`` (1-based, default 1; past the last: the last), ``page_size`` workers by name. 400
    naming ``page``."""

    @extend_schema(
        parameters=[OpenApiParameter("page", int, description="page of the worker table, from 1")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request):
        raw = request.query_params.get("page", "1")
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:  # "²" is a digit int() refuses
            raise ValidationError({"page": ["an integer from 1"]})
        return Response(selectors.fleet_summary(int(raw)))


class ScrapeTargetsApi(APIView):
    """Prometheus HTTP service discovery (read-only): the fleet's scrape targets from the inventory, a JSON
    list of ``{"targets": ["host:port"], "labels": {...}}`` (``telemetry.discovery``). Any read role's token
    (give the TSDB a viewer's); no write method exists."""

    @extend_schema(responses=ScrapeTargetGroupSerializer(many=True))
    def get(self, request):
        return Response(discovery.scrape_targets())
