"""Operation, its per-target state machine rows, and stored Idempotency-Key responses.

Target states: pending -> waiting_for_idle -> applying -> verifying -> succeeded | failed | cancelled; under
all_or_nothing, any target an apply was sent to (succeeded, or failed after the apply went out) then moves to
reverting -> reverted | revert_failed.
`TRANSITIONS` is the whole table and `TARGET_MACHINE` (controlplane.core.state_machine) the sets derived from
it; `services.transitions.target_transition` is the only writer of `OperationTarget.state`.
"""

from django.conf import settings
from django.db import models

from controlplane.core.state_machine import StateMachine


class OperationKind(models.TextChoices):
    ATTACH = "attach"
    DETACH = "detach"
    APPLY_CONFIG = "apply_config"
    # Stop and start the worker through its agent with changed launch flags (Operation.flags).
    RESTART_WITH_FLAGS = "restart_with_flags"


class Policy(models.TextChoices):
    BEST_EFFORT = "best_effort"
    ALL_OR_NOTHING = "all_or_nothing"


class NoRouter(models.TextChoices):
    REFUSE = "refuse"
    WARN = "warn"


class OperationState(models.TextChoices):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    PARTIALLY_FAILED = "partially_failed"
    FAILED = "failed"
    REVERTED = "reverted"
    CANCELLED = "cancelled"


class TargetState(models.TextChoices):
    PENDING = "pending"
    WAITING_FOR_IDLE = "waiting_for_idle"
    APPLYING = "applying"
    VERIFYING = "verifying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REVERTING = "reverting"
    REVERTED = "reverted"
    REVERT_FAILED = "revert_failed"
    CANCELLED = "cancelled"


T = TargetState
TRANSITIONS: dict[str, frozenset[str]] = {
    T.PENDING: frozenset({T.WAITING_FOR_IDLE, T.FAILED, T.CANCELLED}),
    T.WAITING_FOR_IDLE: frozenset({T.APPLYING, T.FAILED, T.CANCELLED}),
    # A 400 "not idle" from the worker sends the target back to waiting: waited on, never forced.
    T.APPLYING: frozenset({T.VERIFYING, T.WAITING_FOR_IDLE, T.FAILED}),
    T.VERIFYING: frozenset({T.SUCCEEDED, T.FAILED}),
    # all_or_nothing: once any target failed, every target an apply was sent to is possibly changed and is
    # reverted (drained, idle-waited, restored and read back like an apply).
    T.SUCCEEDED: frozenset({T.REVERTING}),
    T.FAILED: frozenset({T.REVERTING}),
    T.REVERTING: frozenset({T.REVERTED, T.REVERT_FAILED}),
}
# An operation target in progress; succeeded and failed are not final: all_or_nothing can still revert them.
ACTIVE_STATES = frozenset({T.PENDING, T.WAITING_FOR_IDLE, T.APPLYING, T.VERIFYING, T.REVERTING})
TARGET_MACHINE = StateMachine(
    name="target",
    states=TargetState,
    transitions=TRANSITIONS,
    active=ACTIVE_STATES,
    # A move into one of these appends the worker's audit record.
    outcome=frozenset({T.SUCCEEDED, T.FAILED, T.REVERTED, T.REVERT_FAILED}),
)
FINAL_STATES = TARGET_MACHINE.final  # reverted, revert_failed, cancelled
OUTCOME_STATES = TARGET_MACHINE.outcome


class Operation(models.Model):
    kind = models.CharField(max_length=20, choices=OperationKind.choices)
    policy = models.CharField(max_length=20, choices=Policy.choices, default=Policy.BEST_EFFORT)
    drain = models.BooleanField(default=False, help_text="Remove each worker from its router while applying")
    no_router = models.CharField(
        max_length=10,
        choices=NoRouter.choices,
        default=NoRouter.REFUSE,
        help_text="drain asked, worker has no router: refuse the launch, or warn and apply undrained",
    )
    storage_profile = models.ForeignKey(
        "inventory.StorageProfile", null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    revision = models.ForeignKey(
        "configs.ConfigRevision", null=True, blank=True, on_delete=models.PROTECT, related_name="operations"
    )
    flags = models.JSONField(
        null=True,
        blank=True,
        help_text="restart_with_flags: {set: {SGLang flag name: value (true/false for a switch)}, "
        "remove: [flag name]}, the same for every target",
    )
    state = models.CharField(max_length=20, choices=OperationState.choices, default=OperationState.RUNNING)
    reason = models.TextField(blank=True)
    idle_timeout_s = models.FloatField()
    cancel_requested = models.BooleanField(default=False)
    abort_requested = models.BooleanField(default=False, help_text="all_or_nothing: a target failed")
    summary = models.JSONField(default=dict, blank=True)
    explanation = models.TextField(blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    request_id = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"operation {self.pk} ({self.kind})"


class OperationTarget(models.Model):
    operation = models.ForeignKey(Operation, on_delete=models.CASCADE, related_name="targets")
    worker = models.ForeignKey(
        "inventory.EngineWorker", on_delete=models.PROTECT, related_name="operation_targets"
    )
    state = models.CharField(max_length=20, choices=TargetState.choices, default=TargetState.PENDING)
    version = models.PositiveIntegerField(default=0)
    before = models.JSONField(null=True, blank=True, help_text="Worker state read before applying")
    after = models.JSONField(null=True, blank=True, help_text="Worker state read back after applying")
    explanation = models.TextField(blank=True)
    polls = models.PositiveIntegerField(default=0)
    drained = models.BooleanField(default=False, help_text="Removed from its router by this target")
    apply_sent = models.BooleanField(
        default=False, help_text="An apply request went out: the worker may have changed (revert reads it)"
    )
    changed = models.BooleanField(
        null=True, help_text="The worker's live state differed from `before` (null: unknown, unreadable)"
    )
    restart_seq = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="restart_with_flags: the worker's flags_request_seq this target last asked its agent for",
    )
    revert_cause = models.TextField(blank=True, help_text="Why this target is being reverted")
    idle_deadline_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True, help_text="Reaper fails the target after this")
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["operation_id", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["worker"],
                condition=TARGET_MACHINE.active_q(),
                name="one_active_target_per_worker",
            )
        ]

    def __str__(self) -> str:
        return f"{self.operation_id}/{self.worker.name}"


class IdempotencyRecord(models.Model):
    """The stored response of a POST sent with `Idempotency-Key` (replayed for 24 h)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    key = models.CharField(max_length=200)
    request_sha256 = models.CharField(max_length=64)
    status_code = models.PositiveSmallIntegerField()
    response_body = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="idempotency_unique_key")]

    def __str__(self) -> str:
        return f"{self.key} ({self.status_code})"
