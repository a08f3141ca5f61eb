"""Thin Celery task: a rebalance id in, one advance, re-enqueued with the delay the service asks for.

acks_late + reject_on_worker_lost as operations' steps: a step whose worker died is redelivered; every
state move is a compare-and-set, so a rerun that finds the state moved does nothing. Each chain carries its
id; beat's `rebalance.resume_stalled` starts a new chain for a running rebalance whose chain was lost.
"""

from celery import shared_task

from controlplane.operations.tasks import STEP_OPTIONS


@shared_task(name="rebalance.advance", **STEP_OPTIONS)
def advance_task(rebalance_id: int, chain: str) -> None:
    from controlplane.rebalance.services import rebalance_advance

    delay = rebalance_advance(rebalance_id=rebalance_id, chain=chain)
    if delay is not None:
        advance_task.apply_async((rebalance_id, chain), countdown=delay)


@shared_task(name="rebalance.resume_stalled", ignore_result=True)
def resume_stalled_task() -> int:
    from controlplane.rebalance.services import rebalance_resume_stalled

    return rebalance_resume_stalled()


@shared_task(name="rebalance.reconcile_all", ignore_result=True)
def reconcile_all_task() -> int:
    from controlplane.rebalance.services.reconcile import reconcile_all

    return len(reconcile_all())
