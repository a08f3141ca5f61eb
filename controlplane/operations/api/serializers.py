from rest_framework import serializers

from controlplane.configs.models import ConfigRevision
from controlplane.core.serializers import StrictModelSerializer, StrictSerializer
from controlplane.inventory.models import EngineWorker, StorageProfile
from controlplane.operations.models import NoRouter, Operation, OperationKind, OperationTarget, Policy
from controlplane.operations.services.steps import drain_would_help


class OperationTargetSerializer(StrictModelSerializer):
    worker_name = serializers.CharField(source="worker.name", read_only=True)

    class Meta:
        model = OperationTarget
        fields = [
            "id",
            "worker",
            "worker_name",
            "state",
            "explanation",
            "polls",
            "drained",
            "apply_sent",
            "changed",
            "revert_cause",
            "restart_seq",
            "before",
            "after",
            "idle_deadline_at",
            "deadline_at",
            "updated_at",
            "finished_at",
        ]
        read_only_fields = fields


class OperationSerializer(StrictModelSerializer):
    targets = OperationTargetSerializer(many=True, read_only=True)
    drain_on_retry = serializers.SerializerMethodField(
        help_text="Worker ids whose targets failed by staying busy past the idle timeout, undrained, with a "
        "router: a retry with drain on may succeed"
    )
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    started_at = serializers.DateTimeField(
        source="created_at",
        read_only=True,
        help_text="When it began changing workers: an operation runs as soon as it is launched",
    )

    class Meta:
        model = Operation
        fields = [
            "id",
            "kind",
            "policy",
            "drain",
            "no_router",
            "storage_profile",
            "revision",
            "flags",
            "state",
            "reason",
            "idle_timeout_s",
            "cancel_requested",
            "abort_requested",
            "summary",
            "explanation",
            "created_by",
            "request_id",
            "created_at",
            "started_at",
            "finished_at",
            "targets",
            "drain_on_retry",
        ]
        read_only_fields = fields

    def get_drain_on_retry(self, op: Operation) -> list[int]:
        return [t.worker_id for t in op.targets.all() if t.state == "failed" and drain_would_help(t)]


class OperationCreateSerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=OperationKind.choices)
    workers = serializers.PrimaryKeyRelatedField(queryset=EngineWorker.objects.all(), many=True)
    policy = serializers.ChoiceField(choices=Policy.choices, default=Policy.BEST_EFFORT)
    drain = serializers.BooleanField(default=False)
    no_router = serializers.ChoiceField(
        choices=NoRouter.choices,
        default=NoRouter.REFUSE,
        help_text="drain=true, a worker has no router: refuse the launch (400) or warn and apply undrained",
    )
    storage_profile = serializers.PrimaryKeyRelatedField(
        queryset=StorageProfile.objects.all(), required=False, allow_null=True
    )
    revision = serializers.PrimaryKeyRelatedField(
        queryset=ConfigRevision.objects.all(), required=False, allow_null=True
    )
    flags = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="restart_with_flags: {set: {flag: value}, remove: [flag]} by SGLang flag names "
        "(page_size, or --page-size); true/false for a switch. Checked on every worker against its "
        "engine's own flags: 400 naming the flag and the closest real one",
    )
    idle_timeout_s = serializers.FloatField(required=False, min_value=0.1, max_value=3600)
    reason = serializers.CharField(
        help_text="Why (kept in the audit log and on the operation); required, as in the launch form"
    )


class CancelSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")


class PreviewRowSerializer(StrictSerializer):
    worker_id = serializers.IntegerField()
    name = serializers.CharField()
    url = serializers.CharField()
    reachable = serializers.BooleanField()
    is_idle = serializers.BooleanField(allow_null=True)
    num_running_reqs = serializers.IntegerField(allow_null=True)
    num_waiting_reqs = serializers.IntegerField(allow_null=True)
    num_http_reqs = serializers.IntegerField(allow_null=True, help_text="accepted, not answered yet")
    storage_backend = serializers.CharField(allow_null=True)
    inflight_cache_io = serializers.DictField(child=serializers.IntegerField(), allow_null=True)
    router = serializers.CharField(allow_null=True)
    warnings = serializers.ListField(child=serializers.CharField())
    error = serializers.CharField()
