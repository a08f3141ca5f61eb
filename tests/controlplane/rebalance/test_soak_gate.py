"""What a finished soak says it checked (the step runner on the real database; the worker and router are the
real-HTTP fakes of fakes.py, the worker's latency histograms read with PromQL from a real Prometheus): "within
SLO" only when the rebalance has an SLO, which the soak then checked; never passed unchecked while the TSDB
does not answer."""

import time
from datetime import timedelta

import httpx
import pytest
from cp_factories import RouterFactory
from django.utils import timezone

from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import Rebalance, RebalanceStep
from controlplane.rebalance.services import rebalance_advance

pytestmark = pytest.mark.django_db


def _soaked(fake_worker, fake_router, personas, slo: dict, tsdb=None) -> RebalanceStep:
    """A decode -> prefill step past its soak time, the worker listed healthy as a prefill (and, given
    ``tsdb``, scraped by it now); advanced once."""
    worker = fake_worker(pd_role="prefill")
    if tsdb is not None:
        tsdb.serve([("w0", time.time(), worker.metrics_text())])
    router = RouterFactory(name="pd", url=fake_router.url, mode="pd")
    row = EngineWorker.objects.create(name="w0", url=worker.url, router=router, role="prefill")
    httpx.post(
        f"{fake_router.url}/workers", json={"url": worker.url, "worker_type": "prefill"}
    ).raise_for_status()
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=2, target_prefill=2, target_decode=1, soak_s=5,
        idle_timeout_s=60, state="running", created_by=personas["operator"][0], slo=slo,
    )  # fmt: skip
    RebalanceStep.objects.create(
        rebalance=rb, index=0, worker=row, from_role="decode", to_role="prefill", method="switch",
        state="soaking", switch_sent=True, started_at=timezone.now(), soak={"baseline": {}},
        soak_until=timezone.now() - timedelta(seconds=1),
    )  # fmt: skip
    rebalance_advance(rebalance_id=rb.pk)
    return rb.steps.get()


def test_a_soak_without_an_slo_says_it_checked_health_and_errors_only(fake_worker, fake_router, personas):
    step = _soaked(fake_worker, fake_router, personas, {"max_ttft_s": None, "max_itl_s": None})
    assert step.state == "succeeded", step.explanation
    assert step.explanation.endswith("served 5s (no SLO set: checked health and errors only)")
    assert "within SLO" not in step.explanation


def test_a_soak_with_an_slo_names_the_thresholds_it_held(fake_worker, fake_router, personas, tsdb):
    step = _soaked(fake_worker, fake_router, personas, {"max_ttft_s": 0.5, "max_itl_s": None}, tsdb)
    assert step.state == "succeeded", step.explanation
    assert step.explanation.endswith("served 5s within SLO (TTFT p90 ≤ 0.5 s)")


def test_a_soak_with_an_slo_waits_while_the_tsdb_does_not_answer(fake_worker, fake_router, personas, tsdb):
    step = _soaked(fake_worker, fake_router, personas, {"max_ttft_s": 0.5, "max_itl_s": None})  # not started
    assert step.state == "soaking"  # it cannot say the SLO held: it never passes unchecked
    assert "SLO not checked: metrics unavailable since" in step.explanation, step.explanation


def test_a_step_is_numbered_from_1_in_the_rebalances_own_text(fake_router, personas):
    """The page's table and dialogs number steps from 1: the rebalance's explanation names the same number."""
    router = RouterFactory(name="pd", url=fake_router.url, mode="pd")
    row = EngineWorker.objects.create(name="w0", url="http://w0.local:30000", router=router, role="decode")
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=2, target_prefill=2, target_decode=1, soak_s=5,
        idle_timeout_s=60, state="running", approval="per_step", created_by=personas["operator"][0],
    )  # fmt: skip
    RebalanceStep.objects.create(rebalance=rb, index=0, worker=row, from_role="decode", to_role="prefill")
    rebalance_advance(rebalance_id=rb.pk)
    rb.refresh_from_db()
    assert rb.state == "awaiting_approval"
    assert rb.explanation == "step 1 (w0: decode -> prefill) waits for approval"
