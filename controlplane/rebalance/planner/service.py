"""Run the planner for a PD router: read the fleet, decide, keep the state, return the recommendation.

Called every ``PLANNER_INTERVAL_S`` by Celery beat (``rebalance.plan_all``) and by the recommendation
endpoint when the stored one is older than ``FRESH_S`` or a rebalance of the router changed since (so a
freeze shows at once, and it works without beat). Extra evaluations do not weaken the anti-flap rules:
persistence and smoothing are measured in time.
"""

from __future__ import annotations

from datetime import UTC, datetime

from controlplane.inventory.models import Router, RouterMode
from controlplane.rebalance.models import Rebalance
from controlplane.rebalance.planner import store
from controlplane.rebalance.planner.core import PlannerConfig, encoder_advice, evaluate
from controlplane.rebalance.planner.inputs import WindowConfig, encoder_view, fleet_view, now_s

FRESH_S = 5.0


def plan(router: Router, now: float | None = None) -> dict:
    """Evaluate the planner for ``router`` now; stores and returns the recommendation dict (see
    ``core.Recommendation.to_dict``, plus ``router``, ``slo_source``, ``slo_sources``, ``config`` and
    ``encoders``: ``core.encoder_advice`` for the router's EPD encoders, None when it has none)."""
    now = now_s() if now is None else now
    cfg, window = PlannerConfig(), WindowConfig()
    view, notes = fleet_view(router, now, window)
    rec, state = evaluate(view, store.load_state(router.pk), now, cfg)
    encoders, total = encoder_view(router, now, window)
    out = {
        "router": router.pk,
        **rec.to_dict(),
        **notes,
        "encoders": encoder_advice(encoders, total, view.prefill, view.slo, cfg),
        "config": {**cfg.__dict__, **window.__dict__},
    }
    store.save(router.pk, state, out)
    return out


def recommendation(router: Router) -> dict:
    """The stored recommendation if fresh (evaluated in the last ``FRESH_S`` and no rebalance of the router
    changed since), else a new evaluation."""
    rec = store.latest(router.pk)
    if rec is None or not 0 <= now_s() - rec["evaluated_at"] <= FRESH_S or _rebalanced_since(router, rec):
        rec = plan(router)
    return rec


def _rebalanced_since(router: Router, rec: dict) -> bool:
    since = datetime.fromtimestamp(rec["evaluated_at"], tz=UTC)
    return Rebalance.objects.filter(router=router, updated_at__gte=since).exists()


def plan_all() -> int:
    """One evaluation for every PD router; returns how many."""
    routers = list(Router.objects.filter(mode=RouterMode.PD))
    for router in routers:
        plan(router)
    return len(routers)
