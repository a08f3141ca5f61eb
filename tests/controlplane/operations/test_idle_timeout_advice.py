"""A worker that stays busy past the idle timeout: its target's error says what to do next, and the operation
tells the console which workers a retry with drain on may change (the step runner on the real database; the
worker and router are the real-HTTP fakes of fakes.py)."""

import pytest
from cp_factories import RouterFactory

from controlplane.operations.services import operation_create

from .test_all_or_nothing_revert import drive, registered

pytestmark = pytest.mark.django_db


def _busy_detach(fake_worker, fake_router, *, drain: bool, routed: bool = True):
    busy = fake_worker(busy_polls=-1)
    router = RouterFactory(url=fake_router.url) if routed else None
    fake_router.add(busy.url)
    worker = registered(busy, "busy", router=router)
    op = drive(operation_create(kind="detach", workers=[worker], actor=None, drain=drain, idle_timeout_s=0.5))
    return op, worker, op.targets.get()


def test_an_undrained_busy_worker_fails_suggesting_drain(fake_worker, fake_router, api_as):
    op, worker, target = _busy_detach(fake_worker, fake_router, drain=False)
    assert target.state == "failed" and target.explanation.startswith(
        "not idle within 0.5s (last seen running="
    )
    assert target.explanation.endswith(
        "; retry with drain on: its router then sends it no new requests, so it goes idle"
    )
    assert api_as("viewer").get(f"/api/v1/operations/{op.pk}/").json()["drain_on_retry"] == [worker.pk]


def test_a_drained_busy_worker_fails_suggesting_a_longer_idle_timeout(fake_worker, fake_router, api_as):
    op, _, target = _busy_detach(fake_worker, fake_router, drain=True)
    assert target.state == "failed"
    assert target.explanation.endswith("; it was drained from its router: retry with a longer idle timeout")
    assert api_as("viewer").get(f"/api/v1/operations/{op.pk}/").json()["drain_on_retry"] == []
