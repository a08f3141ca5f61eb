"""Rebalance endpoints: list/detail, create (plan + start), approve, pause, resume, abort.

Roles follow RolePermission: viewer/operator/admin read, operator/admin write, agent nothing."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.rebalance import selectors, services
from controlplane.rebalance.api import serializers as s
from controlplane.rebalance.selectors import RebalanceFilter


class RebalanceViewSet(viewsets.ReadOnlyModelViewSet, mixins.CreateModelMixin):
    queryset = selectors.rebalance_list()
    serializer_class = s.RebalanceSerializer
    filterset_class = RebalanceFilter
    ordering_fields = ["created_at", "finished_at", "state"]
    ordering = ["-created_at"]

    def _detail(self, rb, code=status.HTTP_202_ACCEPTED) -> Response:
        return Response(s.RebalanceSerializer(selectors.rebalance_list().get(pk=rb.pk)).data, status=code)

    @extend_schema(
        request=s.RebalanceCreateSerializer,
        responses={
            201: s.RebalanceSerializer,
            409: OpenApiResponse(description="a rebalance is active on the router, or the fleet disagrees"),
            503: OpenApiResponse(description="router or worker unreachable, or the canary failed"),
        },
    )
    def create(self, request):
        body = s.RebalanceCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        rb = services.rebalance_create(actor=request.user, **body.validated_data)
        response = self._detail(rb, status.HTTP_201_CREATED)
        response["Location"] = f"/api/v1/rebalances/{rb.pk}/"
        return response

    def _act(self, request, service):
        body = s.ActionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._detail(service(rb=self.get_object(), actor=request.user, **body.validated_data))

    @extend_schema(request=s.ActionSerializer, responses={202: s.RebalanceSerializer, 409: OpenApiResponse()})
    @action(detail=True, methods=["post"])
    def approve(self, request, pk=None):
        return self._act(request, services.rebalance_approve)

    @extend_schema(request=s.ActionSerializer, responses={202: s.RebalanceSerializer, 409: OpenApiResponse()})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._act(request, services.rebalance_pause)

    @extend_schema(request=s.ActionSerializer, responses={202: s.RebalanceSerializer, 409: OpenApiResponse()})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._act(request, services.rebalance_resume)

    @extend_schema(request=s.ActionSerializer, responses={202: s.RebalanceSerializer, 409: OpenApiResponse()})
    @action(detail=True, methods=["post"])
    def abort(self, request, pk=None):
        return self._act(request, services.rebalance_abort)
