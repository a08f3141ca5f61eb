"""Prometheus HTTP service discovery: the scrape targets of the fleet, read from the inventory.

The TSDB (``http_sd_configs`` in deploy/prometheus/prometheus.yml) reads this list and scrapes every
worker's and every router's ``/metrics`` itself, so adding a worker needs no change to the TSDB. Shape
(Prometheus' HTTP SD format): a JSON list of ``{"targets": ["host:port"], "labels": {...}}``, one per
target. Worker labels: ``worker`` (its name), ``host`` (its host's name; empty when it has none), ``role``
(mixed / prefill / decode / encoder, as last seen), ``tp`` (--tp-size), ``engine`` (``kvfleet`` or
``sglang``, as its agent registered it), ``model`` and ``storage_backend`` (its L3 backend, e.g. ``file`` or
``mooncake``; empty, so absent in the TSDB, without one: the fleet view's per-pool L3 figures,
`live.pool_exprs`; the shipped scrape configuration keeps it on ``up`` only, so an attach or a detach does
not start new series of the worker's metrics). Router labels: ``router`` (its name) and
``role`` = ``router``; a router without a ``metrics_url`` is not listed. ``__scheme__`` and
``__metrics_path__`` carry the URL's scheme and path.
"""

from urllib.parse import urlsplit

from controlplane.inventory.models import EngineWorker, Router


def _target(url: str, path: str) -> tuple[str, dict]:
    parts = urlsplit(url)
    return parts.netloc, {"__scheme__": parts.scheme or "http", "__metrics_path__": path}


def scrape_targets() -> list[dict]:
    """Every worker and every router with a metrics URL, as Prometheus HTTP SD target groups."""
    groups = []
    for worker in EngineWorker.objects.select_related("host").order_by("name"):
        base = urlsplit(worker.url).path.rstrip("/")
        address, meta = _target(worker.url, f"{base}/metrics")
        labels = {
            "worker": worker.name,
            "host": worker.host.name if worker.host else "",
            "role": worker.role,
            "tp": str(worker.tp_size),
            "engine": worker.engine,
            "model": worker.model_name,
            "storage_backend": worker.storage_backend or "",
        }
        groups.append({"targets": [address], "labels": {**meta, **labels}})
    for router in Router.objects.exclude(metrics_url="").order_by("name"):
        address, meta = _target(router.metrics_url, urlsplit(router.metrics_url).path or "/metrics")
        groups.append({"targets": [address], "labels": {**meta, "router": router.name, "role": "router"}})
    return groups
