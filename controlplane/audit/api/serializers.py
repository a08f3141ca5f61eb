from rest_framework import serializers

from controlplane.audit.models import AuditEvent
from controlplane.audit.selectors import revert_changes
from controlplane.core.exceptions import ApplicationError
from controlplane.core.serializers import StrictModelSerializer, StrictSerializer


class AuditEventSerializer(StrictModelSerializer):
    revertible = serializers.SerializerMethodField(
        help_text='"Revert to this" would change a worker now (see revert_changes)'
    )
    revert_changes = serializers.SerializerMethodField(
        help_text="Per worker the revert would change now: {worker_id, worker, now, after}, in words"
    )

    undo = serializers.SerializerMethodField(
        help_text="What POST undo would do now: {kind, worker_id, worker, now, after} (words), or null with "
        "undo_refused saying why"
    )
    undo_refused = serializers.SerializerMethodField(
        help_text="Why this record cannot be undone ('' when it can)"
    )

    revert_together_changes = serializers.SerializerMethodField(
        help_text="As revert_changes, for every worker its operation changed to the same state; [] when that "
        "covers no more workers than revert_changes (POST revert with together=true)"
    )

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "occurred_at",
            "actor_display",
            "actor_type",
            "token_prefix",
            "request_id",
            "source_ip",
            "action",
            "object_type",
            "object_id",
            "object_repr",
            "operation_id",
            "before",
            "after",
            "changes",
            "message",
            "outcome",
            "extra",
            "revertible",
            "revert_changes",
            "revert_together_changes",
            "undo",
            "undo_refused",
        ]
        read_only_fields = fields

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # answers computed once per event while this serializer renders (several fields read each):
        # name -> event id -> answer; a list shares one child serializer across its events
        self._memos: dict[str, dict] = {}

    def _memo(self, name: str) -> dict:
        return self._memos.setdefault(name, {})

    def get_revert_changes(self, obj) -> list[dict]:
        if not (obj.extra or {}).get("restore"):
            return []
        memo = self._memo("revert_changes")
        if obj.pk not in memo:
            memo[obj.pk] = revert_changes(event=obj)
        return memo[obj.pk]

    def get_revert_together_changes(self, obj) -> list[dict]:
        if not (obj.extra or {}).get("restore") or not obj.operation_id:
            return []
        together = revert_changes(event=obj, together=True)
        return together if len(together) > len(self.get_revert_changes(obj)) else []

    def get_revertible(self, obj) -> bool:
        return bool(self.get_revert_changes(obj))

    def _undo(self, obj) -> tuple[dict | None, str]:
        from controlplane.operations.services.undo import UNDOABLE, undo_plan

        if obj.object_type == "operations.operation":
            return None, "an operation's record: undo the record of the worker it changed"
        if obj.action not in UNDOABLE or obj.object_type != "inventory.engineworker":
            return None, "not an attach, detach or config push of a worker"
        memo = self._memo("undo")
        if obj.pk not in memo:
            try:
                plan = undo_plan(event=obj)
            except ApplicationError as exc:
                memo[obj.pk] = (None, exc.message)
            else:
                view = {"kind": plan.kind, "worker_id": plan.worker.pk, "worker": plan.worker.name}
                memo[obj.pk] = (view | {"now": plan.now, "after": plan.after}, "")
        return memo[obj.pk]

    def get_undo(self, obj) -> dict | None:
        return self._undo(obj)[0]

    def get_undo_refused(self, obj) -> str:
        return self._undo(obj)[1]


class RevertSerializer(StrictSerializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="")
    drain = serializers.BooleanField(
        required=False, default=False, help_text="Take each worker out of its router while it changes"
    )
    together = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Revert every worker the record's operation changed to this state, in one operation",
    )


class UndoSerializer(StrictSerializer):
    reason = serializers.CharField(help_text="Why (kept in the audit log); required")
    drain = serializers.BooleanField(
        required=False,
        default=True,
        help_text="Take the worker out of its router while it changes (default); a worker without a router "
        "is changed undrained and the operation says so",
    )
