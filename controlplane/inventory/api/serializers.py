"""Inventory API shapes. The worker admin key and API key are write-only; reads only say whether one is
set."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.core.serializers import StrictModelSerializer, StrictSerializer, unknown_key_errors
from controlplane.inventory.models import (
    EngineWorker,
    FleetAlert,
    Gpu,
    Host,
    Router,
    StorageProfile,
    WorkerRole,
    devices_problem,
)
from controlplane.inventory.selectors import router_breakers, router_cache_salt
from engine.cache.storage.extra_keys import check_extra_keys
from engine.server.contract import CAPABILITIES, ENGINE_KINDS, HICACHE_STATUS_FIELDS


class FleetAlertSerializer(StrictModelSerializer):
    router_name = serializers.CharField(source="router.name", read_only=True, allow_null=True, default=None)
    worker_name = serializers.CharField(source="worker.name", read_only=True, allow_null=True, default=None)

    class Meta:
        model = FleetAlert
        fields = [
            "id", "router", "router_name", "worker", "worker_name", "kind", "subject", "message", "opened_at",
            "last_seen_at", "resolved_at",
        ]  # fmt: skip
        read_only_fields = fields


class GpuSerializer(StrictModelSerializer):
    class Meta:
        model = Gpu
        fields = ["id", "host", "index", "model", "memory_mib"]


class HostSerializer(StrictModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)

    class Meta:
        model = Host
        fields = [
            "id",
            "name",
            "address",
            "agent_version",
            "cpu_count",
            "memory_bytes",
            "last_seen",
            "gpus",
            "created_at",
            "updated_at",
        ]
        # CPU count and memory are what the agent measured (agent/register), not something to type in.
        read_only_fields = ["cpu_count", "memory_bytes", "last_seen", "created_at", "updated_at"]


class BreakerWorkerSerializer(StrictSerializer):
    url = serializers.CharField()
    state = serializers.ChoiceField(choices=["closed", "open", "half_open", "unknown"])
    consecutive_failures = serializers.IntegerField(allow_null=True)


class BreakersSerializer(StrictSerializer):
    enabled = serializers.BooleanField(help_text="false: the router runs without its circuit breaker")
    reachable = serializers.BooleanField(allow_null=True, help_text="null: breaker off, not read")
    error = serializers.CharField(allow_blank=True)
    open = serializers.IntegerField(allow_null=True, help_text="workers whose breaker is open or half-open")
    workers = BreakerWorkerSerializer(many=True)


class CacheSaltSerializer(StrictSerializer):
    identified = serializers.BooleanField(help_text="false: the router has not answered the probe yet")
    router = serializers.CharField(allow_blank=True, help_text='kind and version, e.g. "smg 1.13.0"')
    routes = serializers.DictField(
        child=serializers.BooleanField(allow_null=True),
        help_text="/generate, /v1/completions, /v1/chat/completions -> true: cache_salt reaches the worker; "
        "false: the router drops it (salts share cache, the request still succeeds); null: not verified",
    )
    warning = serializers.CharField(
        allow_blank=True, help_text="empty when every route carries the salt (to HTTP workers)"
    )
    grpc_workers = serializers.ListField(
        child=serializers.CharField(),
        help_text="its workers that serve gRPC (--grpc-mode on their command line): no cache_salt and no "
        "API key reaches them on any route",
    )
    grpc_warning = serializers.CharField(
        allow_blank=True, help_text="names them and the supported way; empty without gRPC workers"
    )


class RouterSerializer(StrictModelSerializer):
    circuit_breakers = serializers.SerializerMethodField(
        help_text="Live from metrics_url (null without one): each worker's circuit breaker in the router"
    )
    cache_salt = serializers.SerializerMethodField(
        help_text="Whether a request's cache_salt reaches the workers through this router, per route, from "
        "its probed kind and version, and which of its workers serve gRPC (no salt reaches those)"
    )

    class Meta:
        model = Router
        fields = [
            "id",
            "name",
            "url",
            "mode",
            "policy",
            "metrics_url",
            "circuit_breaker",
            "slo_ttft_p90_s",
            "slo_itl_p90_s",
            "worker_budget",
            "kind",
            "version",
            "identified_at",
            "cache_salt",
            "circuit_breakers",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["kind", "version", "identified_at", "created_at", "updated_at"]
        # the same ceiling as a rebalance's soak SLO (seconds); past it the planner's sentences are nonsense
        # worker_budget: the same ceiling as a rebalance's target counts (SQLite stores any integer)
        extra_kwargs = {
            "slo_ttft_p90_s": {"max_value": 3600.0},
            "slo_itl_p90_s": {"max_value": 3600.0},
            "worker_budget": {"max_value": 10000},
        }

    @extend_schema_field(BreakersSerializer(allow_null=True))
    def get_circuit_breakers(self, obj) -> dict | None:
        return router_breakers(obj)

    @extend_schema_field(CacheSaltSerializer)
    def get_cache_salt(self, obj) -> dict:
        return router_cache_salt(obj)


class StorageProfileSerializer(StrictModelSerializer):
    class Meta:
        model = StorageProfile
        fields = ["id", "name", "backend", "extra_config", "description", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate_extra_config(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("extra_config must be a JSON object")
        return value

    def validate(self, attrs):
        """A key the backend does not take is refused here, naming it (the check a worker runs on
        ``--hicache-storage-backend-extra-config``), not when an attach reaches the workers."""
        backend = attrs.get("backend", getattr(self.instance, "backend", None))
        extra = attrs.get("extra_config", getattr(self.instance, "extra_config", None)) or {}
        try:
            check_extra_keys(backend, extra)
        except ValueError as exc:
            raise serializers.ValidationError({"extra_config": [str(exc)]}) from None
        return attrs


class EngineWorkerSerializer(StrictModelSerializer):
    admin_key = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=500)
    api_key = serializers.CharField(
        write_only=True,
        required=False,
        allow_blank=True,
        max_length=500,
        help_text="The worker's --api-key (write-only; stored encrypted): a rebalance sends it to switch the "
        "worker's role and for its canary",
    )
    desired_role = serializers.CharField(
        read_only=True, help_text="prefill | decode: its agent is asked to restart it in that role; '' = none"
    )
    has_admin_key = serializers.SerializerMethodField()
    has_api_key = serializers.SerializerMethodField()

    class Meta:
        model = EngineWorker
        fields = [
            "id",
            "name",
            "url",
            "host",
            "router",
            "role",
            "role_changed_at",
            "desired_role",
            "role_request_seq",
            "role_seen_seq",
            "role_applied_seq",
            "engine",
            "engine_version",
            "capabilities",
            "command_line",
            "desired_flags",
            "flags_request_seq",
            "flags_applied_seq",
            "flags_failed_seq",
            "flags_failure",
            "model_name",
            "tp_size",
            "devices",
            "dp_size",
            "page_size",
            "hicache_config",
            "hicache_unreported",
            "hicache_config_read_at",
            "storage_backend",
            "storage_profile",
            "config_revision",
            "state",
            "last_seen",
            "admin_key",
            "has_admin_key",
            "api_key",
            "has_api_key",
            "created_at",
            "updated_at",
        ]
        read_only_fields = [
            "engine",
            "engine_version",
            "capabilities",
            "command_line",
            "desired_flags",
            "flags_request_seq",
            "flags_applied_seq",
            "flags_failed_seq",
            "flags_failure",
            "hicache_config",
            "hicache_unreported",
            "hicache_config_read_at",
            "storage_backend",
            "storage_profile",
            "config_revision",
            "role_changed_at",
            "desired_role",
            "role_request_seq",
            "role_seen_seq",
            "role_applied_seq",
            "state",
            "last_seen",
            "created_at",
            "updated_at",
        ]

    def validate(self, attrs: dict) -> dict:
        """``devices``: one distinct index per rank (``tp_size``; the stored one on a partial update)."""
        tp_size = attrs.get("tp_size", getattr(self.instance, "tp_size", 1))
        devices = attrs.get("devices", getattr(self.instance, "devices", []))
        problem = devices_problem(devices, tp_size)
        if problem:
            raise serializers.ValidationError({"devices": [problem]})
        return attrs

    def get_has_admin_key(self, obj) -> bool:
        return bool(obj.admin_key_encrypted)

    def get_has_api_key(self, obj) -> bool:
        return bool(obj.api_key_encrypted)


class JsonIntegerField(serializers.IntegerField):
    """An integer that must arrive as a JSON integer: strings ("8"), floats (8.0) and booleans are refused,
    where DRF's IntegerField would coerce them."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


# Column ranges (PositiveSmallIntegerField / PositiveIntegerField): larger values are a 400 naming the
# field, never a database overflow.
SMALL_MAX, INT_MAX = 2**15 - 1, 2**31 - 1


class AgentGpuSerializer(StrictSerializer):
    index = serializers.IntegerField(min_value=0, max_value=SMALL_MAX)
    model = serializers.CharField(max_length=100)
    memory_mib = serializers.IntegerField(min_value=0, max_value=INT_MAX)


class AgentHostSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    address = serializers.CharField(max_length=200, required=False, allow_blank=True)
    agent_version = serializers.CharField(max_length=50, required=False, allow_blank=True)
    cpu_count = JsonIntegerField(min_value=1, max_value=INT_MAX, required=False)
    memory_bytes = JsonIntegerField(min_value=1, max_value=2**63 - 1, required=False)
    gpus = AgentGpuSerializer(many=True, required=False)

    def validate_gpus(self, gpus: list[dict]) -> list[dict]:
        """GPU indexes are unique per host (the database's constraint): a repeated one is a 400 here."""
        indexes = [g["index"] for g in gpus]
        repeated = sorted({i for i in indexes if indexes.count(i) > 1})
        if repeated:
            raise serializers.ValidationError(f"GPU index repeated: {', '.join(map(str, repeated))}")
        return gpus


class HiCacheReportSerializer(StrictSerializer):
    """The HiCache settings a worker's ``/server_info`` reports (``engine.server.contract.
    reported_hicache_config``): each key a ``GET /hicache/config`` field name (another is a 400 naming it and
    the closest real one)."""

    config = serializers.DictField(help_text="field -> value, under GET /hicache/config's names")
    unreported = serializers.DictField(
        child=serializers.CharField(max_length=500),
        required=False,
        default=dict,
        help_text="field -> why the worker does not report it",
    )

    @staticmethod
    def _named_settings(value: dict) -> dict:
        errors = unknown_key_errors(value, HICACHE_STATUS_FIELDS, "HiCache setting")
        if errors:
            raise serializers.ValidationError(errors)
        return value

    def validate_config(self, value: dict) -> dict:
        return self._named_settings(value)

    def validate_unreported(self, value: dict) -> dict:
        return self._named_settings(value)


class AgentWorkerSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    url = serializers.URLField()
    role = serializers.ChoiceField(choices=EngineWorker._meta.get_field("role").choices, required=False)
    model_name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    tp_size = serializers.IntegerField(min_value=1, max_value=SMALL_MAX, required=False)
    devices = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=SMALL_MAX),
        required=False,
        help_text="GPU indexes on this host its ranks hold, rank 0 first: one per rank (tp_size); [] for a "
        "CPU worker",
    )
    dp_size = serializers.IntegerField(min_value=1, max_value=SMALL_MAX, required=False)
    page_size = serializers.IntegerField(min_value=1, max_value=INT_MAX, required=False)
    admin_key = serializers.CharField(max_length=500, required=False, allow_blank=True)
    api_key = serializers.CharField(
        max_length=500, required=False, allow_blank=True, help_text="the worker's --api-key, if it has one"
    )
    storage_backend = serializers.CharField(
        max_length=20, required=False, allow_blank=True, help_text="attached L3 backend ('' for none)"
    )
    storage_extra_config = serializers.DictField(
        required=False, allow_null=True, help_text="its hicache_storage_backend_extra_config"
    )
    engine = serializers.ChoiceField(choices=ENGINE_KINDS, required=False, help_text="kvfleet | sglang")
    engine_version = serializers.CharField(
        max_length=50, required=False, allow_blank=True, help_text="its /server_info version"
    )
    capabilities = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(CAPABILITIES)),
        required=False,
        max_length=len(CAPABILITIES),
        help_text="what the agent found it able to do (probed)",
    )
    command_line = serializers.ListField(
        child=serializers.CharField(max_length=20000),
        required=False,
        max_length=1000,
        help_text="the launch flags it runs with, one argv item each, without secrets",
    )
    launch_flags = serializers.DictField(
        child=serializers.ListField(min_length=2, max_length=2),
        required=False,
        help_text="its engine's launch flags: SGLang name -> [option, takes a value]",
    )
    hicache = HiCacheReportSerializer(
        required=False, help_text="the HiCache settings its /server_info reports (left out: not read)"
    )

    def validate(self, attrs: dict) -> dict:
        problem = devices_problem(attrs.get("devices", []), attrs.get("tp_size"))
        if problem:
            raise serializers.ValidationError({"devices": [problem]})
        return attrs


class AgentRegisterSerializer(StrictSerializer):
    host = AgentHostSerializer()
    workers = AgentWorkerSerializer(many=True, required=False, default=list)


class AgentRegisterResponseSerializer(StrictSerializer):
    host = HostSerializer()
    workers = EngineWorkerSerializer(many=True)


class RoleAckSerializer(StrictSerializer):
    seen = serializers.IntegerField(min_value=0)
    applied = serializers.IntegerField(min_value=0)


class FlagAckSerializer(StrictSerializer):
    applied = serializers.IntegerField(min_value=0)
    failed = serializers.IntegerField(min_value=0)
    failure = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class AgentHeartbeatSerializer(StrictSerializer):
    host = serializers.CharField(max_length=100)
    workers = serializers.ListField(child=serializers.URLField(), required=False, default=list)
    offline = serializers.ListField(child=serializers.URLField(), required=False, default=list)
    roles = serializers.DictField(
        child=serializers.ChoiceField(choices=WorkerRole.choices),
        required=False,
        default=dict,
        help_text="worker URL -> the role it runs (its /server_info disaggregation_mode; null = mixed)",
    )
    role_acks = serializers.DictField(
        child=RoleAckSerializer(),
        required=False,
        default=dict,
        help_text="worker URL -> {seen, applied}: the newest request_seq the agent has processed, and the "
        "newest restart request it carried out",
    )
    flag_acks = serializers.DictField(
        child=FlagAckSerializer(),
        required=False,
        default=dict,
        help_text="worker URL -> {applied, failed, failure}: the newest flags request it carried out (the "
        "worker answered /health with them), the newest that failed, and why",
    )
    hicache = serializers.DictField(
        child=HiCacheReportSerializer(),
        required=False,
        default=dict,
        help_text="worker URL -> the HiCache settings its /server_info reports now (written when changed)",
    )


class RoleRestartSerializer(StrictSerializer):
    worker_url = serializers.URLField()
    role = serializers.ChoiceField(choices=WorkerRole.choices)
    seq = serializers.IntegerField(help_text="the request's generation (role_request_seq)")


class FlagRestartSerializer(StrictSerializer):
    worker_url = serializers.URLField()
    flags = serializers.ListField(child=serializers.CharField(), help_text="the whole command line")
    seq = serializers.IntegerField(help_text="the request's generation (flags_request_seq)")


class AgentHeartbeatResponseSerializer(StrictSerializer):
    workers_seen = serializers.IntegerField()
    restart = RoleRestartSerializer(
        many=True, help_text="Workers to restart in a new role (their desired_role), with that role"
    )
    request_seq = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="worker URL -> its role_request_seq (the agent reports it as seen once it processed this)",
    )
    flags = FlagRestartSerializer(
        many=True, help_text="Workers to restart with another command line (their desired_flags)"
    )


class WorkerIsolationCheckSerializer(StrictSerializer):
    words = serializers.IntegerField(required=False, default=400, min_value=32, max_value=4000)


class WorkerRoleSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=[WorkerRole.PREFILL, WorkerRole.DECODE])
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)
