"""Users and API tokens (admin only to change), plus `me` for any authenticated principal."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts import selectors, services
from controlplane.accounts.api import serializers as s
from controlplane.accounts.models import Role
from controlplane.accounts.permissions import ADMIN_ONLY


class UserViewSet(viewsets.ReadOnlyModelViewSet, mixins.CreateModelMixin, mixins.UpdateModelMixin):
    queryset = selectors.user_list()
    serializer_class = s.UserSerializer
    write_roles = ADMIN_ONLY
    filterset_fields = ["username", "is_active"]
    ordering_fields = ["username", "date_joined"]
    ordering = ["username"]
    http_method_names = ["get", "post", "patch", "head", "options"]

    @extend_schema(request=s.UserCreateSerializer, responses={201: s.UserSerializer})
    def create(self, request):
        body = s.UserCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = services.user_create(actor=request.user, **body.validated_data)
        return Response(s.UserSerializer(user).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.UserUpdateSerializer, responses=s.UserSerializer)
    def partial_update(self, request, pk=None):
        body = s.UserUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = services.user_update(user=self.get_object(), actor=request.user, **body.validated_data)
        return Response(s.UserSerializer(user).data)


class ApiTokenViewSet(viewsets.ReadOnlyModelViewSet, mixins.CreateModelMixin, mixins.DestroyModelMixin):
    """Tokens: POST issues one (the plaintext is in the response once), DELETE revokes (the row stays)."""

    queryset = selectors.token_list()
    serializer_class = s.ApiTokenSerializer
    read_roles = ADMIN_ONLY
    write_roles = ADMIN_ONLY
    filterset_fields = ["user", "write_enabled"]
    ordering_fields = ["created_at", "name"]
    ordering = ["-created_at"]

    @extend_schema(responses={201: s.ApiTokenCreatedSerializer})
    def create(self, request):
        body = s.ApiTokenSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        token, plaintext = services.token_create(
            user=data["user"],
            name=data["name"],
            write_enabled=data.get("write_enabled", True),
            expires_at=data.get("expires_at"),
            host=data.get("host_name", ""),
            actor=request.user,
        )
        out = s.ApiTokenCreatedSerializer(token).data
        out["token"] = plaintext
        return Response(out, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.token_revoke(token=instance, actor=self.request.user)


class MeApi(APIView):
    read_roles = frozenset(Role)

    @extend_schema(responses=s.UserSerializer)
    def get(self, request):
        return Response(s.UserSerializer(request.user).data)
