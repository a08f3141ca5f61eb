"""What a router does with its traffic, from the TSDB: per-worker request rate and share, requests in flight,
health, the cache-aware policy's decisions, and an imbalance warning with its cause where the router's own
metrics show one.

Read from the router's own metrics (smg's names; sglang-router 0.3.2 exports the same ``smg_`` families),
scraped by the TSDB through the control plane's service discovery, which labels the router's series
``router=<name>`` (`discovery`). Over ``WINDOW_S``:

- ``workers``: ``[{url, worker (inventory row or None), rate (req/s, 3 decimals), share (0..1 of the
  router's dispatches), active (in flight now), healthy (bool or None)}]``, highest rate first, from
  ``smg_worker_requests_total`` (counted at each send, retries included), ``smg_worker_requests_active``,
  ``smg_worker_health``.
- ``decisions``: ``[{branch, label, count (dispatches in the window), share}]`` of the cache-aware policy
  (``smg_cache_aware_policy_branch_total``); empty under another policy. ``decided``: the sum of their
  counts, the dispatches the window holds (0 without decisions).
- ``imbalance``: None, or ``{worker, share, fair, cause}`` when at least ``MIN_REQUESTS`` were dispatched
  over two or more workers in the router and one took at least ``IMBALANCE_FACTOR`` times its fair share
  (1 / workers) and more than half of all. ``cause``: the other workers failing their health checks, or the
  cache-aware policy's tree matches (the prefixes live on that worker, so matched requests go there), or
  "not visible in the router's metrics".
- ``absent``: why there is no figure ("" when there are): no metrics URL recorded, or the router exports no
  per-worker request count, or the TSDB is unavailable (``unavailable_since``, epoch s, then set).

Nothing is made up: a worker the router has no series for is not listed, a rate over fewer than two scrapes
is no rate.
"""

from __future__ import annotations

from controlplane.inventory.models import Router
from controlplane.telemetry.promql import MetricsUnavailable, PromQL, unavailable_since

WINDOW_S = 60
MIN_REQUESTS = 20  # fewer dispatches in the window say nothing about balance
IMBALANCE_FACTOR = 1.5
BRANCHES = {  # smg's cache-aware policy branches, in words
    "tree_match": "matched a cached prefix: sent to the worker holding it",
    "min_load": "load imbalance past the balance thresholds: sent to the least-loaded worker",
    "expected_wait_fallback": "no useful match: sent to the shortest expected wait",
    "first_healthy_fallback": "no candidate: sent to the first healthy worker",
    "random_fallback": "no candidate: sent to a random worker",
    "spill": "the matched worker was too busy: spilled to another",
}


def _selector(router: Router) -> str:
    name = router.name.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{router="{name}"}}'


def _by(samples: list[dict], label: str) -> dict[str, float]:
    return {s["labels"].get(label, ""): s["value"] for s in samples}


def router_traffic(*, router: Router, listed: set[str] | None = None, prom: PromQL | None = None) -> dict:
    """The module docstring's figures for ``router``; ``listed``: the URLs the router lists now (when known,
    the imbalance check compares only those: a drained worker's share is 0 on purpose). Never raises for the
    TSDB being down (``absent`` says so); a query the TSDB refuses (a bug of ours) raises ``QueryError``."""
    out: dict = {"window_s": WINDOW_S, "workers": [], "decisions": [], "decided": 0, "imbalance": None}
    out["absent"] = ""
    out["unavailable_since"] = None
    if not router.metrics_url:
        out["absent"] = "no metrics URL recorded: the TSDB does not scrape this router"
        return out
    prom = prom or PromQL()
    sel, w = _selector(router), f"[{WINDOW_S}s]"
    try:
        rates = _by(prom.query(f"sum by (worker) (rate(smg_worker_requests_total{sel}{w}))"), "worker")
        active = _by(prom.query(f"sum by (worker) (smg_worker_requests_active{sel})"), "worker")
        health = _by(prom.query(f"min by (worker) (smg_worker_health{sel})"), "worker")
        branches = _by(
            prom.query(f"sum by (branch) (increase(smg_cache_aware_policy_branch_total{sel}{w}))"), "branch"
        )
    except MetricsUnavailable:
        out["unavailable_since"] = unavailable_since()
        out["absent"] = "metrics unavailable"
        return out
    if not rates:
        out["absent"] = (
            f"no per-worker request rate: the TSDB has fewer than two scrapes of the router's "
            f"smg_worker_requests_total in the last {WINDOW_S} s"
        )
        return out
    inventory = {wk.router_url: wk for wk in router.workers.all()}
    total = sum(rates.values())
    rows = [
        {
            "url": url,
            "worker": inventory.get(url.rstrip("/")),
            "rate": round(rate, 3),
            "share": rate / total if total > 0 else None,
            "active": active.get(url),
            "healthy": None if url not in health else health[url] >= 1,
        }
        for url, rate in rates.items()
    ]
    rows.sort(key=lambda r: (-r["rate"], r["url"]))
    out["workers"] = rows
    decided = sum(branches.values())
    out["decisions"] = [
        {"branch": b, "label": BRANCHES.get(b, b), "count": round(n), "share": n / decided}
        for b, n in sorted(branches.items(), key=lambda kv: -kv[1])
        if decided > 0 and n > 0
    ]
    out["decided"] = sum(d["count"] for d in out["decisions"])
    serving = [r for r in rows if listed is None or r["url"].rstrip("/") in listed]
    out["imbalance"] = _imbalance(serving, total * WINDOW_S, branches)
    return out


def _imbalance(rows: list[dict], requests: float, branches: dict[str, float]) -> dict | None:
    if len(rows) < 2 or requests < MIN_REQUESTS:
        return None
    top = rows[0]
    fair = 1 / len(rows)
    if top["share"] is None or top["share"] < max(IMBALANCE_FACTOR * fair, 0.5 + 1e-9):
        return None
    unhealthy = [r for r in rows[1:] if r["healthy"] is False]
    decided = sum(branches.values())
    matched = branches.get("tree_match", 0.0) / decided if decided > 0 else 0.0
    if unhealthy:
        names = ", ".join(_name(r) for r in unhealthy)
        cause = f"{names} fail{'s' if len(unhealthy) == 1 else ''} the router's health checks"
    elif matched >= 0.5:
        cause = (
            f"cache-aware routing: {matched * 100:.0f} % of dispatches matched a cached prefix and went to "
            "the worker holding it, so the prefixes (and their traffic) gather on it; the router balances by "
            "load only past its balance thresholds (--balance-abs-threshold, --balance-rel-threshold)"
        )
    else:
        cause = "not visible in the router's metrics"
    return {"worker": _name(top), "share": top["share"], "fair": fair, "cause": cause}


def _name(row: dict) -> str:
    return row["worker"].name if row["worker"] is not None else row["url"]
