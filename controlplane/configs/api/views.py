"""Config profile endpoints; committing a revision needs `If-Match: <ETag>` (428 without, 412 when stale)."""

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.configs import selectors, services
from controlplane.configs.api import serializers as s
from controlplane.configs.models import ConfigRevision
from controlplane.core.api import ServiceModelViewSet
from controlplane.core.services import model_update

IF_MATCH = OpenApiParameter(
    "If-Match", str, OpenApiParameter.HEADER, required=True, description="Profile ETag"
)


class ConfigProfileViewSet(ServiceModelViewSet):
    queryset = selectors.profile_list()
    serializer_class = s.ConfigProfileSerializer
    filterset_fields = ["name"]
    ordering_fields = ["name", "updated_at"]
    ordering = ["name"]

    def create_service(self, *, data, actor):
        return services.profile_create(actor=actor, **data)

    def update_service(self, *, instance, data, actor):
        data.pop("content", None)
        return model_update(instance=instance, data=data, actor=actor)

    def retrieve(self, request, *args, **kwargs):
        response = super().retrieve(request, *args, **kwargs)
        response["ETag"] = self.get_object().etag
        return response

    @extend_schema(responses=s.ConfigRevisionSerializer(many=True), methods=["GET"])
    @extend_schema(
        request=s.RevisionCommitSerializer,
        parameters=[IF_MATCH],
        responses={
            201: s.ConfigRevisionSerializer,
            409: OpenApiResponse(description="identical to head"),
            412: OpenApiResponse(description="stale ETag"),
            428: OpenApiResponse(description="If-Match missing"),
        },
        methods=["POST"],
    )
    @action(detail=True, methods=["get", "post"])
    def revisions(self, request, pk=None):
        profile = self.get_object()
        if request.method == "GET":
            page = self.paginate_queryset(selectors.revision_list(profile=profile))
            return self.get_paginated_response(s.ConfigRevisionSerializer(page, many=True).data)
        body = s.RevisionCommitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        revision = services.revision_commit(
            profile=profile,
            if_match=request.headers.get("If-Match"),
            actor=request.user,
            **body.validated_data,
        )
        response = Response(s.ConfigRevisionSerializer(revision).data, status=status.HTTP_201_CREATED)
        response["ETag"] = profile.etag
        return response

    @extend_schema(responses=s.ConfigRevisionSerializer)
    @action(detail=True, methods=["get"], url_path=r"revisions/(?P<number>\d+)")
    def revision(self, request, pk=None, number=None):
        profile = self.get_object()
        revision = get_object_or_404(ConfigRevision, profile=profile, number=int(number))
        return Response(s.ConfigRevisionSerializer(revision).data)
