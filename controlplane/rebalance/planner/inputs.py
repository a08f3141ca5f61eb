"""What the planner sees of one PD router, read from inventory, the TSDB (`telemetry.samples`: the workers'
scrapes of the window, one PromQL query) and rebalances.

Pools are the router's workers by role (prefill, decode), counted in devices: a worker spans its
``tp_size`` devices. The budget is the devices of all of them, or, when the router's ``worker_budget`` is
below their number, the devices of that many workers, the largest first. A worker's samples count from
``warmup_s`` after its role last changed (Dynamo #12430: cold samples of a worker that just joined a pool
skew its capacity).
The prefill pool's TTFT is the one the client sees, measured where its first token is sent: on the decode
workers in PD (a decode worker observes TTFT from a request's arrival to the first token it streams, which
covers the prefill on P and the KV transfer); the prefill workers' own TTFT is used only when no decode
worker reports one (KVFleet's prefill workers record none; upstream's record the prefill leg).
The planner is frozen (no new recommendation) while a rebalance of the router is active, and while actual !=
expected: a worker of the router is offline or has not reported for ``stale_s``, or the router's counts are
not the target of its newest succeeded rebalance; and while the TSDB does not answer ("metrics unavailable
since ...": no figure, so no recommendation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.utils import timezone

from controlplane.inventory.models import EngineWorker, Router, WorkerRole, WorkerState
from controlplane.rebalance.models import ACTIVE_STATES, Rebalance, RebalanceState
from controlplane.rebalance.planner.core import DECODE, PREFILL, EncoderLoad, FleetView, PoolWorker, Slo
from controlplane.rebalance.planner.window import encoder_load, pool_load
from controlplane.telemetry import promql, samples
from controlplane.telemetry.selectors import unavailable_text

DEFAULT_SLO = Slo(ttft_p90_s=0.5, itl_p90_s=0.05)  # Dynamo's SLA planner defaults


@dataclass(frozen=True)
class WindowConfig:
    window_s: float = 120.0  # figures are taken over the last two minutes
    warmup_s: float = 120.0  # samples of a worker in its new role count after this long
    stale_s: float = 30.0  # a worker that has not reported for this long is not "actual"


def _rebalance_freeze(router: Router, current: tuple[int, int]) -> tuple[str | None, float | None]:
    """(why frozen, when the newest rebalance finished) from the rebalance app's records; ``current``:
    the router's (prefill, decode) workers, as a rebalance's target counts them (not devices)."""
    active = Rebalance.objects.filter(router=router, state__in=ACTIVE_STATES).first()
    if active is not None:
        return f"rebalance {active.pk} of this router is {active.state.replace('_', ' ')}", None
    done = Rebalance.objects.filter(router=router, finished_at__isnull=False).order_by("-finished_at").first()
    finished = done.finished_at.timestamp() if done else None
    if done is not None and done.state == RebalanceState.SUCCEEDED:
        target = (done.target_prefill, done.target_decode)
        if target != current:
            return (
                f"actual {current[0]}P:{current[1]}D differs from the expected {target[0]}P:{target[1]}D "
                f"of rebalance {done.pk}"
            ), finished
    return None, finished


def fleet_view(router: Router, now: float, cfg: WindowConfig = WindowConfig()) -> tuple[FleetView, dict]:
    """The router's FleetView at ``now`` (Unix s), and notes for the operator: where the SLOs came from,
    ``slo_source`` ("router" when the router sets either SLO, else "default"), ``slo_sources`` (each one)."""
    workers = list(
        EngineWorker.objects.filter(router=router, role__in=[WorkerRole.PREFILL, WorkerRole.DECODE])
    )
    current = (
        sum(w.tp_size for w in workers if w.role == WorkerRole.PREFILL),
        sum(w.tp_size for w in workers if w.role == WorkerRole.DECODE),
    )
    slo = Slo(router.slo_ttft_p90_s or DEFAULT_SLO.ttft_p90_s, router.slo_itl_p90_s or DEFAULT_SLO.itl_p90_s)
    sources = {
        "ttft_p90_s": "router" if router.slo_ttft_p90_s else "default",
        "itl_p90_s": "router" if router.slo_itl_p90_s else "default",
    }
    notes = {"slo_source": "router" if "router" in sources.values() else "default", "slo_sources": sources}
    scrapes, down = _scrapes(workers, now, max(cfg.window_s, cfg.stale_s))
    frozen = down
    for w in workers if down is None else []:
        seen = scrapes[w.name][-1]["ts"] if scrapes.get(w.name) else None
        if w.state == WorkerState.OFFLINE or seen is None or now - seen > cfg.stale_s:
            frozen = f"actual != expected: {w.name} ({w.role}) is not reporting"
            break
    workers_now = (
        sum(w.role == WorkerRole.PREFILL for w in workers),
        sum(w.role == WorkerRole.DECODE for w in workers),
    )
    why, finished = _rebalance_freeze(router, workers_now)
    frozen = why or frozen
    changed = [w.role_changed_at.timestamp() for w in workers if w.role_changed_at]
    last_change = max([*changed, *([finished] if finished else [])], default=None)
    pools: dict[str, list[list[dict]]] = {PREFILL: [], DECODE: []}
    devices: dict[str, list[int]] = {PREFILL: [], DECODE: []}
    for w in workers:
        start = now - cfg.window_s
        if w.role_changed_at:
            start = max(start, w.role_changed_at.timestamp() + cfg.warmup_s)
        pools[w.role].append([s for s in scrapes.get(w.name, []) if start <= s["ts"] <= now])
        devices[w.role].append(w.tp_size)
    prefill, decode = (pool_load(pools[r], devices[r]) for r in (PREFILL, DECODE))
    if prefill and decode and decode.ttft_p90_s is not None:
        prefill = replace(prefill, ttft_p90_s=decode.ttft_p90_s)  # the client's TTFT: see the module doc
    view = FleetView(
        current=current,
        prefill=prefill,
        decode=decode,
        budget=_device_budget(router, workers),  # a cap: docs/rebalance.md
        slo=slo,
        last_change_at=last_change,
        frozen=frozen,
        workers=tuple(PoolWorker(w.name, w.role, w.tp_size) for w in workers),
        window_s=cfg.window_s,
    )
    return view, notes


def encoder_view(
    router: Router, now: float, cfg: WindowConfig = WindowConfig()
) -> tuple[EncoderLoad | None, int]:
    """The EPD encoders recorded with ``router`` (the ones its prefill workers call): their load over the
    window (``window.encoder_load``; None without figures) and how many there are. They are not in the
    FleetView: never in a P:D split, never switched."""
    encoders = list(EngineWorker.objects.filter(router=router, role=WorkerRole.ENCODER))
    scrapes, _ = _scrapes(encoders, now, cfg.window_s)
    return encoder_load([scrapes.get(w.name, []) for w in encoders]), len(encoders)


def _scrapes(
    workers: list[EngineWorker], now: float, window_s: float
) -> tuple[dict[str, list[dict]], str | None]:
    """The workers' scrapes of the ``window_s`` s up to ``now`` (`samples.worker_samples`), and why there are
    none when the TSDB does not answer ("metrics unavailable since ...", else None)."""
    try:
        return samples.worker_samples([w.name for w in workers], window_s, at=now), None
    except promql.PromQLError as exc:
        return {}, unavailable_text(promql.unavailable_since() or now, exc.message)


def _device_budget(router: Router, workers: list[EngineWorker]) -> int:
    """The devices the planner splits: all the workers', or the ``worker_budget`` largest workers'."""
    sizes = sorted((w.tp_size for w in workers), reverse=True)
    return sum(sizes[: router.worker_budget or len(sizes)])


def now_s() -> float:
    return timezone.now().timestamp()
