from celery import shared_task


@shared_task(name="telemetry.scrape_all", ignore_result=True)
def scrape_all_task() -> int:
    from controlplane.telemetry.services import scrape_all

    return scrape_all()


@shared_task(name="telemetry.flush_group", ignore_result=True)
def flush_group_task(group: str) -> None:
    from controlplane.telemetry.services import flush_group

    flush_group(group=group)
