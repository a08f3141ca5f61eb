"""Restart the task chain of a rebalance whose chain was lost (a message dropped with a broker that lost its
data, a worker gone past the visibility timeout): running or rolling back, with no advance for
REBALANCE_STALL_S (more than the longest a single advance can take, so a slow live chain is not doubled)."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.rebalance.models import Rebalance
from controlplane.rebalance.models import RebalanceState as R
from controlplane.rebalance.services.transitions import enqueue_advance


def rebalance_resume_stalled() -> int:
    """Start a new chain for each stalled rebalance (audited); returns how many."""
    stale = timezone.now() - timedelta(seconds=settings.REBALANCE_STALL_S)
    stalled = Rebalance.objects.filter(state__in=(R.RUNNING, R.ROLLING_BACK)).filter(
        Q(advanced_at__lt=stale) | Q(advanced_at__isnull=True)
    )
    count = 0
    for rb in stalled:
        with transaction.atomic():
            if not Rebalance.objects.filter(pk=rb.pk, chain=rb.chain, state=rb.state).exists():
                continue
            enqueue_advance(rb.pk)
            audit_record(
                action="rebalance_task_restarted",
                obj=rb,
                before={"chain": rb.chain, "advanced_at": rb.advanced_at and rb.advanced_at.isoformat()},
                after={"state": rb.state},
                message=f"no advance for over {settings.REBALANCE_STALL_S:g}s: started a new task chain",
                extra={"rebalance_id": rb.pk},
            )
        count += 1
    return count
