"""Thin Celery tasks: ids in, a service call, re-enqueue while the service asks for another step.

acks_late + reject_on_worker_lost: a message is acknowledged only after the step ran, and redelivered if the
worker died; `target_step` re-reads the target and no-ops when the state already moved, so a rerun is safe.
"""

from celery import shared_task

STEP_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}


@shared_task(name="operations.target_step", **STEP_OPTIONS)
def target_step_task(target_id: int) -> None:
    from controlplane.operations.services import target_step

    delay = target_step(target_id=target_id)
    if delay is not None:
        target_step_task.apply_async((target_id,), countdown=delay)


@shared_task(name="operations.reap_stuck_targets", ignore_result=True)
def reap_stuck_targets_task() -> int:
    from controlplane.operations.services import reap_stuck_targets

    return reap_stuck_targets()


@shared_task(name="operations.purge_idempotency_records", ignore_result=True)
def purge_idempotency_records_task() -> int:
    from controlplane.operations.services import idempotency_purge

    return idempotency_purge()
