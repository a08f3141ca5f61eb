"""Operation endpoints: list/detail, launch (Idempotency-Key), cancel, and the live launch preview."""

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker
from controlplane.operations import selectors, services
from controlplane.operations.api import serializers as s
from controlplane.operations.models import Operation
from controlplane.operations.selectors import OperationFilter

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    str,
    OpenApiParameter.HEADER,
    required=False,
    description="Repeat-safe launch: the same key and body replay the first response (24 h)",
)


class OperationViewSet(viewsets.ReadOnlyModelViewSet, mixins.CreateModelMixin):
    queryset = selectors.operation_list()
    serializer_class = s.OperationSerializer
    filterset_class = OperationFilter
    ordering_fields = ["created_at", "finished_at", "state"]
    ordering = ["-created_at"]

    def retrieve(self, request, pk=None):
        """One operation with its targets, read on one snapshot (`selectors.operation_snapshot`)."""
        try:
            data = selectors.operation_snapshot(pk=int(pk), render=lambda op: s.OperationSerializer(op).data)
        except (Operation.DoesNotExist, ValueError, OverflowError):
            raise Http404 from None
        return Response(data)

    @extend_schema(
        request=s.OperationCreateSerializer,
        parameters=[IDEMPOTENCY_KEY],
        responses={
            201: s.OperationSerializer,
            409: OpenApiResponse(description="worker busy or key in flight"),
            422: OpenApiResponse(description="Idempotency-Key reused with another body"),
        },
    )
    def create(self, request):
        body = s.OperationCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)

        def create():
            op = services.operation_create(actor=request.user, **data)
            return s.OperationSerializer(selectors.operation_list().get(pk=op.pk)).data

        payload = {**request.data} if isinstance(request.data, dict) else {"body": request.data}
        code, out, replayed = services.operation_create_idempotent(
            key=request.headers.get("Idempotency-Key"), user=request.user, payload=payload, create=create
        )
        response = Response(out, status=code)
        response["Location"] = f"/api/v1/operations/{out['id']}/"
        if replayed:
            response["Idempotent-Replayed"] = "true"
        return response

    @extend_schema(request=s.CancelSerializer, responses={202: s.OperationSerializer, 409: OpenApiResponse()})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        body = s.CancelSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        op = services.operation_cancel(op=self.get_object(), actor=request.user, **body.validated_data)
        return Response(
            s.OperationSerializer(selectors.operation_list().get(pk=op.pk)).data,
            status=status.HTTP_202_ACCEPTED,
        )

    @staticmethod
    def _bad_worker(problem: str) -> ApplicationError:
        return ApplicationError(f"worker: {problem}", code="validation_error", detail={"worker": [problem]})

    @extend_schema(
        parameters=[
            OpenApiParameter("worker", int, many=True, required=True, description="Worker ids"),
            OpenApiParameter("drain", bool, required=False, description="Warn about workers with no router"),
        ],
        responses=s.PreviewRowSerializer(many=True),
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def preview(self, request):
        """400 ``validation_error`` naming ``worker``: missing, not integer ids, or naming no worker."""
        given = request.query_params.getlist("worker")
        if not given:
            raise self._bad_worker("required: one or more worker ids (?worker=1&worker=2)")
        try:
            ids = [int(v) for v in given]
            if not all(0 < i < 2**63 for i in ids):
                raise ValueError("out of range")
        except ValueError:
            raise self._bad_worker(f"must be integer ids >= 1, got {', '.join(given)[:100]!r}") from None
        workers = list(EngineWorker.objects.select_related("router").filter(pk__in=ids).order_by("name"))
        missing = sorted(set(ids) - {w.pk for w in workers})
        if missing:
            raise self._bad_worker(f"unknown worker ids: {missing}")
        drain = request.query_params.get("drain", "").lower() in ("1", "true", "yes")
        rows = selectors.operation_preview(workers=workers, drain=drain)
        return Response(s.PreviewRowSerializer(rows, many=True).data)
