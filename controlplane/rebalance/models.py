"""Rebalance (a P:D ratio change on one PD router) and its steps (one worker's role switch each).

Each has ONE transition table: `TRANSITIONS` for the rebalance, `STEP_TRANSITIONS` for a step, with the sets
and the operator actions derived from it in `REBALANCE_MACHINE` / `STEP_MACHINE`
(controlplane.core.state_machine); `services.transitions` is the only writer of either `state`
(compare-and-set on the expected state).

Rebalance: planned -> running (auto) | awaiting_approval (per_step) -> running -> ... per step ... ->
succeeded; pause/approval wait between steps; a failed step (or breached SLO) -> rolling_back ->
rolled_back | failed; abort -> aborted once the current step reached a safe point.
A step changes the role in place (/pd_role_switch) or, for an engine that cannot, through its agent (a
restart in the new role): `RebalanceStep.method`.
Step: pending -> draining -> switching -> gating -> soaking -> succeeded; a failure before the switch took
effect -> failed (worker re-added in its old role); after it -> rolling_back -> rolled_back | rollback_failed;
a succeeded step is rolled back the same way when the whole rebalance rolls back; never run -> cancelled.
"""

from django.conf import settings
from django.db import models

from controlplane.core.models import TimeStamped
from controlplane.core.state_machine import StateMachine


class Approval(models.TextChoices):
    AUTO = "auto"
    PER_STEP = "per_step"


class PdRole(models.TextChoices):
    PREFILL = "prefill"
    DECODE = "decode"


class SwitchMethod(models.TextChoices):
    """How a step changes its worker's role: in place (``POST /pd_role_switch``, the engine started with
    ``--enable-pd-role-switch``) or by its agent restarting it with ``--disaggregation-mode`` rebuilt (the
    worker's ``desired_role``)."""

    SWITCH = "switch"
    RESTART = "restart"


class RebalanceState(models.TextChoices):
    PLANNED = "planned"
    AWAITING_APPROVAL = "awaiting_approval"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    ABORTED = "aborted"


R = RebalanceState
TRANSITIONS: dict[str, frozenset[str]] = {
    R.PLANNED: frozenset({R.RUNNING, R.AWAITING_APPROVAL, R.ABORTED, R.FAILED}),
    R.AWAITING_APPROVAL: frozenset({R.RUNNING, R.PAUSED, R.ABORTED}),
    # Between steps a running rebalance may wait for approval (per_step), pause, or stop (abort).
    R.RUNNING: frozenset({R.AWAITING_APPROVAL, R.PAUSED, R.SUCCEEDED, R.ROLLING_BACK, R.FAILED, R.ABORTED}),
    R.PAUSED: frozenset({R.RUNNING, R.AWAITING_APPROVAL, R.ABORTED}),
    R.ROLLING_BACK: frozenset({R.ROLLED_BACK, R.FAILED}),
}
ACTIVE_STATES = frozenset({R.PLANNED, R.AWAITING_APPROVAL, R.RUNNING, R.PAUSED, R.ROLLING_BACK})
# Operator actions (services.launch) and when each is allowed; a running rebalance takes pause and abort as
# requests its step runner honours between steps, so each is allowed once.
REBALANCE_MACHINE = StateMachine(
    name="rebalance",
    states=RebalanceState,
    transitions=TRANSITIONS,
    active=ACTIVE_STATES,
    outcome=frozenset({R.SUCCEEDED, R.ROLLED_BACK, R.FAILED, R.ABORTED}),  # the rebalance's outcome record
    actions={
        "approve": lambda rb: rb.state == R.AWAITING_APPROVAL,
        "pause": lambda rb: (
            rb.state == R.AWAITING_APPROVAL or (rb.state == R.RUNNING and not rb.pause_requested)
        ),
        "resume": lambda rb: rb.state == R.PAUSED or (rb.state == R.RUNNING and rb.pause_requested),
        "abort": lambda rb: (
            rb.state in (R.PLANNED, R.AWAITING_APPROVAL, R.PAUSED)
            or (rb.state == R.RUNNING and not rb.abort_requested)
        ),
    },
)
FINAL_STATES = REBALANCE_MACHINE.final  # succeeded, rolled_back, failed, aborted


class StepState(models.TextChoices):
    PENDING = "pending"
    DRAINING = "draining"
    SWITCHING = "switching"
    GATING = "gating"
    SOAKING = "soaking"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    ROLLBACK_FAILED = "rollback_failed"
    CANCELLED = "cancelled"


S = StepState
STEP_TRANSITIONS: dict[str, frozenset[str]] = {
    # A worker whose live role is not the planned one, or that cannot be drained, fails unchanged.
    S.PENDING: frozenset({S.DRAINING, S.FAILED, S.CANCELLED}),
    # Drained from the router, waiting for idle; abort or an idle timeout re-adds it in its old role.
    S.DRAINING: frozenset({S.SWITCHING, S.FAILED, S.CANCELLED}),
    # A "not idle" refusal goes back to waiting; any other refusal leaves the old role (failed).
    S.SWITCHING: frozenset({S.GATING, S.DRAINING, S.FAILED, S.ROLLING_BACK}),
    S.GATING: frozenset({S.SOAKING, S.ROLLING_BACK}),
    S.SOAKING: frozenset({S.SUCCEEDED, S.ROLLING_BACK}),
    S.SUCCEEDED: frozenset({S.ROLLING_BACK}),
    S.ROLLING_BACK: frozenset({S.ROLLED_BACK, S.ROLLBACK_FAILED}),
}
STEP_ACTIVE_STATES = frozenset({S.DRAINING, S.SWITCHING, S.GATING, S.SOAKING, S.ROLLING_BACK})
STEP_MACHINE = StateMachine(
    name="step",
    states=StepState,
    transitions=STEP_TRANSITIONS,
    active=STEP_ACTIVE_STATES,  # started and not settled (pending is neither active nor final)
    # A move into one of these appends the worker's audit record.
    outcome=frozenset({S.SUCCEEDED, S.FAILED, S.ROLLED_BACK, S.ROLLBACK_FAILED, S.CANCELLED}),
    groups={"switched": frozenset({S.GATING, S.SOAKING, S.SUCCEEDED})},  # the worker runs its new role
)
STEP_FINAL_STATES = STEP_MACHINE.final  # failed, rolled_back, rollback_failed, cancelled
STEP_OUTCOME_STATES = STEP_MACHINE.outcome


class Rebalance(TimeStamped):
    router = models.ForeignKey("inventory.Router", on_delete=models.PROTECT, related_name="rebalances")
    before_prefill = models.PositiveSmallIntegerField(help_text="Prefill workers (live role) at creation")
    before_decode = models.PositiveSmallIntegerField(help_text="Decode workers (live role) at creation")
    target_prefill = models.PositiveSmallIntegerField()
    target_decode = models.PositiveSmallIntegerField()
    approval = models.CharField(max_length=10, choices=Approval.choices, default=Approval.AUTO)
    rollback = models.BooleanField(default=True, help_text="Roll every finished step back when one fails")
    soak_s = models.FloatField(help_text="Seconds each moved worker serves while SLOs are watched")
    idle_timeout_s = models.FloatField(help_text="Seconds a drained worker may take to become idle")
    slo = models.JSONField(default=dict, blank=True, help_text="{max_ttft_s, max_itl_s} watched during soak")
    canary = models.JSONField(
        default=dict,
        blank=True,
        help_text="Canary prompts and their greedy texts, recorded at creation (services/canary.py)",
    )
    reason = models.TextField(blank=True)
    state = models.CharField(max_length=20, choices=RebalanceState.choices, default=RebalanceState.PLANNED)
    version = models.PositiveIntegerField(default=0)
    explanation = models.TextField(blank=True)
    approved_steps = models.PositiveSmallIntegerField(
        default=0, help_text="per_step: steps with index below this are approved"
    )
    chain = models.CharField(max_length=32, blank=True, help_text="Id of the Celery task chain driving it")
    advanced_at = models.DateTimeField(null=True, blank=True, help_text="Last run of its advance task")
    pause_requested = models.BooleanField(default=False)
    abort_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    request_id = models.CharField(max_length=64, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["router"],
                condition=REBALANCE_MACHINE.active_q(),
                name="one_active_rebalance_per_router",
            )
        ]

    def __str__(self) -> str:
        return (
            f"rebalance {self.pk} ({self.before_prefill}P{self.before_decode}D -> "
            f"{self.target_prefill}P{self.target_decode}D)"
        )

    @property
    def allowed_actions(self) -> list[str]:
        """The operator actions (approve, pause, resume, abort) this rebalance takes now."""
        return REBALANCE_MACHINE.allowed_actions(self)


class RebalanceStep(models.Model):
    rebalance = models.ForeignKey(Rebalance, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveSmallIntegerField(help_text="Run order, from 0")
    worker = models.ForeignKey(
        "inventory.EngineWorker", on_delete=models.PROTECT, related_name="rebalance_steps"
    )
    from_role = models.CharField(max_length=10, choices=PdRole.choices)
    to_role = models.CharField(max_length=10, choices=PdRole.choices)
    method = models.CharField(
        max_length=10,
        choices=SwitchMethod.choices,
        default=SwitchMethod.SWITCH,
        help_text="switch: POST /pd_role_switch in place; restart: by its agent in the new role",
    )
    state = models.CharField(max_length=20, choices=StepState.choices, default=StepState.PENDING)
    version = models.PositiveIntegerField(default=0)
    explanation = models.TextField(blank=True)
    drained = models.BooleanField(default=False, help_text="Removed from the router by this step")
    switch_sent = models.BooleanField(
        default=False,
        help_text="A role change went out for this step (a /pd_role_switch or an agent restart)",
    )
    restart_requested_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="restart method: when its agent was last asked to restart it (step or rollback)",
    )
    restart_seq = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="restart method: the worker's role_request_seq of the step's request to its agent",
    )
    withdrawn_seq = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="restart method: the role_request_seq of the rollback's withdrawal of that request; the "
        "rollback trusts the live process only once its agent reports having seen it",
    )
    switched_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the new role was read back (switched or restarted), or given up on",
    )
    polls = models.PositiveIntegerField(default=0)
    rollback_cause = models.TextField(blank=True)
    before = models.JSONField(null=True, blank=True, help_text="Worker's live PD state before the step")
    after = models.JSONField(null=True, blank=True, help_text="Worker's live PD state after the step")
    soak = models.JSONField(
        default=dict, blank=True, help_text="SLO histogram baseline taken when the soak began"
    )
    idle_deadline_at = models.DateTimeField(null=True, blank=True)
    soak_until = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["rebalance_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["rebalance", "index"], name="rebalance_step_index_unique")
        ]

    def __str__(self) -> str:
        return f"{self.rebalance_id}/{self.index} {self.worker.name} {self.from_role}->{self.to_role}"

    @property
    def number(self) -> int:
        """The step's number as every text, table and dialog shows it: 1 for the first (``index`` + 1)."""
        return self.index + 1
