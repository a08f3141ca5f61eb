"""Audit log: read-only list/detail (cursor-paginated, filterable), "revert to this revision" (the state a
record left) and "undo" (the state a record found)."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.audit import selectors
from controlplane.audit.api.serializers import AuditEventSerializer, RevertSerializer, UndoSerializer
from controlplane.audit.selectors import AuditEventFilter
from controlplane.core.pagination import CursorPagination


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = selectors.audit_event_list()
    serializer_class = AuditEventSerializer
    filterset_class = AuditEventFilter
    pagination_class = CursorPagination
    ordering_fields = ["occurred_at"]
    ordering = ["-occurred_at", "-id"]

    def _launch(self, request, serializer_class, create) -> Response:
        """Validate the body with ``serializer_class``, launch ``create(event=, actor=, **body)``, answer 201
        with the new operation and its Location."""
        from controlplane.operations.api.serializers import OperationSerializer

        body = serializer_class(data=request.data)
        body.is_valid(raise_exception=True)
        op = create(event=self.get_object(), actor=request.user, **body.validated_data)
        return Response(
            OperationSerializer(op).data,
            status=status.HTTP_201_CREATED,
            headers={"Location": f"/api/v1/operations/{op.pk}/"},
        )

    @extend_schema(
        request=RevertSerializer, responses={201: OpenApiResponse(description="the new operation")}
    )
    @action(detail=True, methods=["post"])
    def revert(self, request, pk=None):
        from controlplane.operations.services import operation_create_from_audit

        return self._launch(request, RevertSerializer, operation_create_from_audit)

    @extend_schema(request=UndoSerializer, responses={201: OpenApiResponse(description="the new operation")})
    @action(detail=True, methods=["post"])
    def undo(self, request, pk=None):
        from controlplane.operations.services.undo import operation_create_undo

        return self._launch(request, UndoSerializer, operation_create_undo)
