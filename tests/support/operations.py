"""Driving control-plane operations in a test process, as the Celery tasks would (needs Django set up)."""

from __future__ import annotations

import time


def drive(op, limit_s: float = 120.0):
    """Run every active target's steps (what the Celery tasks do) until the operation ends; returns it
    refreshed. Fails the test naming each target's state and explanation past ``limit_s`` seconds."""
    from controlplane.operations.models import ACTIVE_STATES
    from controlplane.operations.services import target_step

    deadline = time.monotonic() + limit_s
    while True:
        op.refresh_from_db()
        active = list(op.targets.filter(state__in=ACTIVE_STATES).order_by("id"))
        if op.state != "running" and not active:
            return op
        assert time.monotonic() < deadline, list(op.targets.values("worker__name", "state", "explanation"))
        delays = [target_step(target_id=t.pk) for t in active]
        if delays and all(d is not None for d in delays):
            time.sleep(min(delays))
