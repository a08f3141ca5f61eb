"""Celery beat task of the planner (listed in CELERY_IMPORTS)."""

from celery import shared_task


@shared_task(name="rebalance.plan_all", ignore_result=True)
def plan_all_task() -> int:
    from controlplane.rebalance.planner.service import plan_all

    return plan_all()
