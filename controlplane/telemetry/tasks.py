from celery import shared_task


@shared_task(name="telemetry.publish_fleet", ignore_result=True, expires=30)
def publish_fleet_task() -> None:
    from controlplane.telemetry.services import publish_fleet

    publish_fleet()


@shared_task(name="telemetry.publish_workers", ignore_result=True, expires=30)
def publish_workers_task() -> None:
    from controlplane.telemetry.services import publish_workers

    publish_workers()


@shared_task(name="telemetry.publish_pools", ignore_result=True, expires=30)
def publish_pools_task() -> None:
    from controlplane.telemetry.services import publish_pools

    publish_pools()


@shared_task(name="telemetry.audit_storage", ignore_result=True, expires=30)
def audit_storage_task() -> int:
    from controlplane.telemetry.promql import PromQLError
    from controlplane.telemetry.storage_audit import audit_storage_moves

    try:
        return audit_storage_moves()
    except PromQLError:
        return 0  # the TSDB does not answer: the next run reads what it scraped meanwhile
