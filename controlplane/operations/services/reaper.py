"""Housekeeping: targets a lost task left behind, and expired Idempotency-Key records."""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.core.context import bound_request_id
from controlplane.operations.models import ACTIVE_STATES, IdempotencyRecord, OperationTarget
from controlplane.operations.models import TargetState as T
from controlplane.operations.services import steps
from controlplane.operations.services.transitions import target_transition


def reap_stuck_targets(*, grace_s: float | None = None) -> int:
    """Settle targets still active past deadline + grace (their task was lost) from the worker's live state.

    The grace (seconds) defaults to ``OPERATION_REAPER_GRACE_S``: the visibility timeout, one sweep interval
    and the step hard limit, so a step redelivered after its worker died always runs (and ends) first.

    An apply that went out is read back: the target succeeds if the worker shows the wanted state, else
    fails with the live state recorded (and all_or_nothing reverts it). A revert reads the worker and records
    what it was left in. A target that never sent anything fails. Returns how many were settled.
    """
    grace_s = settings.OPERATION_REAPER_GRACE_S if grace_s is None else grace_s
    cutoff = timezone.now() - timedelta(seconds=grace_s)
    stuck = OperationTarget.objects.select_related(
        "operation__storage_profile", "operation__revision", "operation__created_by", "worker__router"
    ).filter(deadline_at__lt=cutoff, state__in=ACTIVE_STATES)
    reaped = 0
    for target in stuck:
        with bound_request_id(target.operation.request_id):
            why = f"reaped: stuck in {target.state} past its deadline {target.deadline_at.isoformat()}"
            if target.state == T.REVERTING:
                steps.target_revert_fail(target, why)
            elif target.apply_sent:
                if target.state == T.APPLYING and not target_transition(
                    target, to=T.VERIFYING, explanation=why
                ):
                    continue
                steps.target_verify(target)
            else:
                steps.target_fail(target, why)
        reaped += 1
    return reaped


def idempotency_purge(*, older_than_s: float = 86400.0) -> int:
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    return IdempotencyRecord.objects.filter(created_at__lt=cutoff).delete()[0]
