"""Inventory endpoints: CRUD viewsets plus the agent's register and heartbeat."""

from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.permissions import AGENT_ROLES, READ_ROLES
from controlplane.accounts.selectors import agent_host_scope
from controlplane.core.api import ServiceModelViewSet
from controlplane.inventory import selectors, services
from controlplane.inventory.api import serializers as s
from controlplane.inventory.selectors import WorkerFilter


class HostViewSet(ServiceModelViewSet):
    queryset = selectors.host_list()
    serializer_class = s.HostSerializer
    filterset_fields = {
        "name": ["exact"],
        "cpu_count": ["exact", "gte", "lte"],
        "memory_bytes": ["gte", "lte"],
    }
    ordering_fields = ["name", "cpu_count", "memory_bytes", "last_seen", "created_at"]
    ordering = ["name"]


class GpuViewSet(ServiceModelViewSet):
    queryset = selectors.gpu_list()
    serializer_class = s.GpuSerializer
    filterset_fields = ["host", "model"]
    ordering_fields = ["index", "memory_mib"]
    ordering = ["host__name", "index"]


class FleetAlertViewSet(viewsets.ReadOnlyModelViewSet):
    """Drift the reconciler found and could not repair (`?open=true`: those it still sees)."""

    queryset = selectors.fleet_alert_list()
    serializer_class = s.FleetAlertSerializer
    filterset_class = selectors.FleetAlertFilter
    ordering_fields = ["opened_at", "last_seen_at"]
    ordering = ["-opened_at", "-id"]


class RouterViewSet(ServiceModelViewSet):
    queryset = selectors.router_list()
    serializer_class = s.RouterSerializer
    filterset_fields = ["mode", "policy", "kind"]
    ordering_fields = ["name", "created_at"]
    ordering = ["name"]

    def create_service(self, *, data: dict, actor):
        return services.router_create(data=data, actor=actor)

    def update_service(self, *, instance, data: dict, actor):
        return services.router_update(instance=instance, data=data, actor=actor)


class StorageProfileViewSet(ServiceModelViewSet):
    queryset = selectors.storage_profile_list()
    serializer_class = s.StorageProfileSerializer
    filterset_fields = ["backend"]
    ordering_fields = ["name", "created_at"]
    ordering = ["name"]


class EngineWorkerViewSet(ServiceModelViewSet):
    queryset = selectors.worker_list()
    serializer_class = s.EngineWorkerSerializer
    filterset_class = WorkerFilter
    ordering_fields = ["name", "role", "state", "last_seen", "created_at"]
    ordering = ["name"]

    def create_service(self, *, data, actor):
        return services.worker_create(data=data, actor=actor)

    def update_service(self, *, instance, data, actor):
        return services.worker_update(instance=instance, data=data, actor=actor)

    @extend_schema(request=None, responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def undrain(self, request, pk=None):
        """Put the worker back into its router (the reverse of drain)."""
        return Response(services.worker_undrain(worker=self.get_object(), actor=request.user))

    @extend_schema(request=s.WorkerRoleSerializer, responses={202: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def role(self, request, pk=None):
        """Ask the worker's agent to restart it in another PD role (``desired_role`` until it reports it)."""
        body = s.WorkerRoleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        answer = services.worker_role_request(
            worker=self.get_object(),
            role=body.validated_data["role"],
            actor=request.user,
            reason=body.validated_data["reason"],
        )
        return Response(answer, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=s.WorkerIsolationCheckSerializer, responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"], url_path="check-isolation")
    def check_isolation(self, request, pk=None):
        """Run the cache isolation self-test against the worker (``kvfleet-agent check-isolation``'s
        check): both TTFTs, cached tokens per tier of each probe and the verdict; audited. 502 when the
        worker cannot be checked."""
        body = s.WorkerIsolationCheckSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return Response(
            services.worker_check_isolation(
                worker=self.get_object(), actor=request.user, words=body.validated_data["words"]
            )
        )

    @extend_schema(request=None, responses={200: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        """Remove the worker from its router (the agent's `drain`); waiting for idle is the caller's part."""
        return Response(services.worker_drain(worker=self.get_object(), actor=request.user))


class AgentRegisterApi(APIView):
    """Agent: create or update this host, its GPUs and the workers it runs (idempotent upsert by name/url).

    An agent token may register only its own host (403 otherwise); a worker URL another host owns is a 409
    naming the owner."""

    read_roles = READ_ROLES
    write_roles = AGENT_ROLES

    @extend_schema(
        request=s.AgentRegisterSerializer, responses={200: s.AgentRegisterResponseSerializer}, tags=["agent"]
    )
    def post(self, request):
        body = s.AgentRegisterSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        host, workers = services.agent_register(
            host=body.validated_data["host"],
            workers=body.validated_data["workers"],
            actor=request.user,
            bound_host=agent_host_scope(request.user, request.auth),
        )
        out = s.AgentRegisterResponseSerializer({"host": host, "workers": workers})
        return Response(out.data, status=status.HTTP_200_OK)


class AgentHeartbeatApi(APIView):
    """Agent: the host and the listed workers are alive now; the `offline` ones are not serving."""

    read_roles = READ_ROLES
    write_roles = AGENT_ROLES

    @extend_schema(
        request=s.AgentHeartbeatSerializer,
        responses={200: s.AgentHeartbeatResponseSerializer},
        tags=["agent"],
    )
    def post(self, request):
        body = s.AgentHeartbeatSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        answer = services.agent_heartbeat(
            host_name=body.validated_data["host"],
            worker_urls=body.validated_data["workers"],
            offline_urls=body.validated_data["offline"],
            roles=body.validated_data["roles"],
            role_acks=body.validated_data["role_acks"],
            flag_acks=body.validated_data["flag_acks"],
            hicache=body.validated_data["hicache"],
            bound_host=agent_host_scope(request.user, request.auth),
            actor=request.user,
        )
        return Response(answer)
